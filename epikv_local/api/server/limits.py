"""The server's limits on one request: their defaults, the :class:`Limits` the app is built with, and their check.

Each limit is refused with an OpenAI-shaped error that names it and its flag, before any token is generated
where it can be (docs/security.md has the table):

- ``max_body_bytes`` (``--max-body-bytes``): bytes of one request body; more is 413;
- ``max_messages`` (``--max-messages``): chat messages in one request; more is 400;
- ``max_tokens`` (``--max-tokens``): tokens one request may generate; a request that sets no ``max_tokens`` /
  ``max_completion_tokens`` gets this one, one that asks for more is refused (400);
- ``max_request_seconds`` (``--max-request-seconds``): seconds one request may hold the model (its prefill and
  generation; waiting in the queue does not count); then its generation is cancelled and it ends with a 503
  (a stream: an error event) naming the limit;
- ``stall_seconds`` (``--stall-seconds``): seconds one send of a stream may wait for a client that reads
  nothing (its connection's send buffer full); then the stream is dropped and the model freed;
- ``max_json_depth``: nesting of a JSON body (no flag: an OpenAI request nests a few levels).

The prompt-token limit (``--max-prompt-tokens``, default 4 × the KV budget) is the Llama's own
``max_prompt_tokens``: :func:`~epikv_local.api.server.cli.run` passes it to the constructor. Imports nothing but
the standard library.
"""

from dataclasses import dataclass, fields

from ...errors import ConfigError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 8192
DEFAULT_MAX_REQUEST_SECONDS = 600.0
DEFAULT_STALL_SECONDS = 30.0
DEFAULT_MAX_JSON_DEPTH = 64
#: ``--max-prompt-tokens`` when unset: this many times the KV budget
PROMPT_TOKENS_PER_BUDGET_CELL = 4

#: each limit's command-line flag, named in its errors
FLAGS = {"max_body_bytes": "--max-body-bytes", "max_messages": "--max-messages", "max_tokens": "--max-tokens",
         "max_request_seconds": "--max-request-seconds", "stall_seconds": "--stall-seconds",
         "max_json_depth": "max_json_depth"}


@dataclass(frozen=True)
class Limits:
    """One request's limits (units in the names: bytes, messages, tokens, seconds, nesting levels)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_request_seconds: float = DEFAULT_MAX_REQUEST_SECONDS
    stall_seconds: float = DEFAULT_STALL_SECONDS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or value <= 0 or (f.type is int and not isinstance(value, int)) or value != value:
                kind = "an integer >= 1" if f.type is int else "a number of seconds > 0"
                raise ConfigError(f"{FLAGS[f.name]} must be {kind}, got {value!r}")


def default_max_prompt_tokens(kv_budget: int) -> int:
    """``--max-prompt-tokens`` when unset: enough for any prompt the budget can serve with eviction, and a bound
    on how long one request's prefill may hold the model."""
    return PROMPT_TOKENS_PER_BUDGET_CELL * kv_budget
