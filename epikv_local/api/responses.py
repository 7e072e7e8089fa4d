"""OpenAI / llama-cpp-python response shapes (``llama_cpp.llama_types``) built as plain dicts.

Completions: ``{"id": "cmpl-…", "object": "text_completion", "created", "model", "choices": [{"text",
"index", "logprobs", "finish_reason"}], "usage"}``; chat responses are produced from them by llama-cpp-python's
own converters and get ``message.reasoning_content`` / ``delta.reasoning_content`` here. Every final response
and final stream chunk carries one extension field, ``"epikv"``, with the eviction statistics of the call.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

#: the extension field's name
EXTENSION = "epikv"


@dataclass(frozen=True)
class ChunkStep:
    """One item of a ``Llama`` stream with its statistics: ``chunk`` is the OpenAI stream chunk (a dict, as
    ``stream=True`` yields it) and ``stats`` the generation's ``GenerationStats`` as of this chunk (prompt and
    generated tokens, evictions, live cells, timings). Front doors that report statistics (the server, the
    terminal chat) read them here rather than from the Llama."""

    chunk: dict
    stats: Any


def new_id() -> str:
    return f"cmpl-{uuid.uuid4()}"


def finish_reason(stop_reason: str) -> str:
    """Our stop reasons ("eog", "stop", "max_tokens") as OpenAI's finish_reason ("stop" / "length")."""
    return "length" if stop_reason == "max_tokens" else "stop"


def completion(cid: str, model: str, text: str, reason: str, usage: dict, extension: dict) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
            "usage": usage, EXTENSION: extension}


def completion_chunk(cid: str, created: int, model: str, text: str, reason: str | None = None,
                     extension: dict | None = None) -> dict:
    chunk = {"id": cid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}]}
    if extension is not None:
        chunk[EXTENSION] = extension
    return chunk


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def chat_delta_chunk(template: dict, delta: dict, reason: str | None = None) -> dict:
    """A chat stream chunk like ``template`` (id, created, model) with another delta / finish_reason."""
    return {"id": template["id"], "object": "chat.completion.chunk", "created": template["created"],
            "model": template["model"],
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
