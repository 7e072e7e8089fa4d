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
from typing import Any, Iterable

from . import logprobs as lp

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


def completion(cid: str, model: str, text: str, reason: str, usage: dict, extension: dict,
               logprobs: dict | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}],
            "usage": usage, EXTENSION: extension}


def completion_chunk(cid: str, created: int, model: str, text: str, reason: str | None = None,
                     extension: dict | None = None, logprobs: dict | None = None) -> dict:
    chunk = {"id": cid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}]}
    if extension is not None:
        chunk[EXTENSION] = extension
    return chunk


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def chat_delta_chunk(template: dict, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> dict:
    """A chat stream chunk like ``template`` (id, created, model) with another delta / finish_reason /
    logprobs (chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...], "refusal"}``)."""
    return {"id": template["id"], "object": "chat.completion.chunk", "created": template["created"],
            "model": template["model"],
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def extension(st) -> dict:
    """The ``"epikv"`` statistics of a call's final response or chunk, from its ``GenerationStats``."""
    return {"policy": st.policy, "kv_budget": st.kv_budget, "live_cells": st.n_live_cells,
            "max_live_cells": st.max_live_cells, "n_evicted": st.n_evicted_call, "n_evicted_total": st.n_evicted,
            "kv_bytes": st.kv_bytes, "n_ctx": st.n_ctx, "flash_attn": st.flash_attn,
            "prompt_tokens_reused": st.n_prompt_reused, "prompt_tokens_decoded": st.n_prompt_decoded,
            "decode_tokens_per_s": round(st.decode_tokens_per_s, 3), "reasoning_tokens": st.n_reasoning_tokens,
            "reasoning_forced_close": st.reasoning_forced_close}


def completion_from(steps: Iterable[ChunkStep], with_logprobs: bool = False) -> dict:
    """A ``text_completion`` from the steps of one completion stream: the texts joined, the chunks' logprobs
    merged (``with_logprobs``: a logprobs dict even when no chunk had one), the last chunk's finish reason
    and the statistics of the last step."""
    text, parts, last = [], [], None
    for last in steps:
        choice = last.chunk["choices"][0]
        text.append(choice["text"])
        parts.append(choice.get("logprobs"))
    chunk, st = last.chunk, last.stats
    merged = lp.merge(parts) if with_logprobs or any(parts) else None
    return completion(chunk["id"], chunk["model"], "".join(text), chunk["choices"][0]["finish_reason"],
                      usage(st.n_prompt_tokens, st.n_generated_tokens), extension(st), merged)
