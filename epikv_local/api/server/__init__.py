"""``epikv-local serve``: an OpenAI-compatible HTTP server for one :class:`~epikv_local.api.llama.Llama`.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models``, llama-server's ``POST /tokenize``, ``POST /detokenize`` and ``GET
/props``, and ``GET /health``. Responses are the Llama's own: reasoning is split into ``reasoning_content`` and
every response (and the last stream chunk) carries the ``"epikv"`` eviction statistics. Any ``model`` name is
accepted (one model is served: responses name its alias); ``max_completion_tokens`` wins over ``max_tokens``;
``stream_options.include_usage`` ends a stream with a usage chunk. Errors have OpenAI's shape, ``{"error":
{"message", "type", "param", "code"}}``: a bad request (a body that is not a JSON object within limits, fields
of the wrong type, any ``EpikvError`` of the Llama such as a ``BudgetError``) is a 4xx and leaves the server
healthy; a full queue, a shutdown or a request past its time is 503; a missing or wrong ``--api-key`` bearer
token is 401.

In front of the routes, the gate (:mod:`.gate`) checks, before anything is parsed: the ``Host`` header (loopback
names only on a loopback server: DNS rebinding), the ``Origin`` (CORS: loopback origins unless
``--cors-origins``), the API key (every path but ``/health``; each key one client identity), then the body's
size and shape (:mod:`.jsonbody`: UTF-8, bounded nesting, no lone surrogates). Each request is bounded
(:mod:`.limits`: body bytes, messages, prompt tokens, generated tokens, seconds holding the model, seconds a
stream may stall); docs/security.md has the table and the trust model.

Scheduling: the model has one KV cache, so requests run one at a time. Up to ``--max-queue`` more wait in
FIFO order, beyond that a request is answered 503 at once; one whose client leaves gives its place back.
Generation is blocking native work: each request's generation runs in a thread of its own that pulls the Llama's
stream into a small buffer read by the event loop, so decoding the next token overlaps sending the last one and
the loop keeps answering ``/health``. The thread stops when the client goes away, the server shuts down
(SIGINT / SIGTERM) or the request runs past ``--max-request-seconds``: between two tokens by itself, inside a
long prefill through ``llama.cancel()`` (aimed at that job only); it closes the Llama's iterator and only then
frees the model for the next request. The cache is reset between requests of different identities (unless
``--share-prompt-cache``), so prefix reuse tells no client about another's prompt. Every request, streaming or
not, is run as the Llama's stream; a non-streaming response is assembled from the chunks (the Llama's reasoning
splitter makes streamed deltas and the final message agree), so a client that disconnects also stops a long
non-streaming generation. ``/health`` reports the queue and counts the generations served, cut off, and their
tokens.

How llama-cpp-python's server (``llama-cpp-python[server]``, pinned with the bindings) is reused, and why not
its ``create_app``: its app is built around a module-global ``LlamaProxy`` that constructs ``llama_cpp.Llama``
from its ``ModelSettings`` (which know nothing of a KV budget or a policy), and its routes call the stock
class's methods unbound (``llama_cpp.Llama.create_chat_completion(llama, ...)``), so handing it our object
would run llama-cpp-python's implementation on it. Its double lock also queues without bound (no 503) and its
error route turns validation errors into 500s (and fails on a body that is not JSON). So this package builds a
small FastAPI app of its own and reuses the pieces that fit: the request models (``CreateChatCompletionRequest``,
``CreateCompletionRequest``: field names and ranges as llama-cpp-python's server accepts them, made strict; the
chat messages are checked here and by the Llama, whose errors name the message), ``RouteErrorHandler``
(subclassed: ``EpikvError`` and validation errors become 4xx instead of 500; the gate has checked the body to be
a JSON object before its recovery path re-reads it), its logit-bias token conversion, sse-starlette's
``EventSourceResponse`` (with its per-send timeout for stalled clients) and uvicorn. Sampling fields a request
does not set take the Llama's defaults (the reasoning-model temperature 0.6 / top-p 0.95), not the request
model's; ``max_tokens`` defaults to the server's ``--max-tokens``.

The modules, split as llama-cpp-python's server is (``llama_cpp/server/{app,errors,types}.py``):

- :mod:`.cli`: ``serve``'s arguments and :func:`run` (listen, load the Llama, serve with uvicorn);
- :mod:`.routes`: :func:`create_app` and the OpenAI endpoints; :mod:`.extras`: llama-server's;
- :mod:`.gate`: Host, Origin, key and body checks before routing; :mod:`.jsonbody`: the limited JSON parse;
- :mod:`.limits`: one request's limits and their defaults;
- :mod:`.service`: the FIFO slot, admission, cache ownership and counters (``Service``); :mod:`.job`: the
  generation thread with its buffer and its cancellation (``Job``);
- :mod:`.streaming`: a request's life once checked (start: admit, wait, open the stream; respond: events or JSON);
- :mod:`.params`: the request models and their translation into Llama arguments;
- :mod:`.errors`: OpenAI-shaped errors, their statuses and the error route;
- :mod:`.assembly`: non-streaming responses (and the usage chunk) from the stream's chunks.

Importing this package is cheap: fastapi, uvicorn, sse-starlette and llama_cpp are imported by
:func:`create_app` / :func:`run` only (:mod:`.errors`, :mod:`.params`, :mod:`.streaming` and :mod:`.extras`
import them at the top and are imported by :func:`create_app` only; :mod:`.gate`, :mod:`.jsonbody`,
:mod:`.limits`, :mod:`.service` and :mod:`.job` need the standard library only), since the CLI imports this
package to build its parser.
"""

from .assembly import assemble_chat, assemble_completion
from .cli import DEFAULT_HOST, DEFAULT_PORT, SHUTDOWN_GRACE_S, add_args, run
from .routes import create_app
from .limits import Limits
from .service import DEFAULT_MAX_QUEUE

__all__ = ["DEFAULT_HOST", "DEFAULT_MAX_QUEUE", "DEFAULT_PORT", "SHUTDOWN_GRACE_S", "Limits", "add_args",
           "assemble_chat", "assemble_completion", "create_app", "run"]
