"""Non-streaming responses assembled from the chunks of the Llama's stream.

Every request runs as the Llama's stream (so that a client that disconnects also stops a long non-streaming
generation); a non-streaming response is built from its chunks here. The Llama's reasoning splitter makes the
streamed deltas and its own final message agree, so the result is what its non-streaming call returns: the
texts joined, the logprobs entries of the chunks concatenated (chat: ``logprobs.content``; completions: the
four lists), tool-call deltas merged by their index. ``stats`` is the generation's statistics
(``n_prompt_tokens``, ``n_generated_tokens``: token counts; None: zero usage). Imports nothing but the Llama's
response shapes.
"""

from .. import logprobs as lp
from .. import responses


def _usage(stats) -> dict:
    """OpenAI's ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) of ``stats``."""
    if stats is None:
        return responses.usage(0, 0)
    return responses.usage(stats.n_prompt_tokens, stats.n_generated_tokens)


def _merge_tool_calls(calls: dict, deltas) -> None:
    """Add the Llama's streamed ``tool_calls`` deltas to ``calls`` ({index: call}): ids, types and names are set
    by the first delta that has them (llama-cpp-python's handlers repeat them in every delta; OpenAI sends them
    once), the arguments' pieces are joined."""
    for d in deltas or ():
        call = calls.setdefault(d.get("index", len(calls)), {"id": None, "type": "function",
                                                             "function": {"name": "", "arguments": ""}})
        call["id"] = d.get("id") or call["id"]
        call["type"] = d.get("type") or call["type"]
        fn = d.get("function") or {}
        call["function"]["name"] = call["function"]["name"] or fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


def _by_choice(chunks: list[dict]) -> list[list[dict]]:
    """The chunks of each choice (``n`` > 1 interleaves them; each chunk carries one choice), by index."""
    groups: dict = {}
    for c in chunks:
        groups.setdefault(c["choices"][0].get("index", 0), []).append(c)
    return [groups[i] for i in sorted(groups)]


def assemble_chat(chunks: list[dict], stats) -> dict:
    """A ``chat.completion`` from its ``chat.completion.chunk``s (as the Llama's non-streaming call returns),
    one choice per index."""
    first = chunks[0]
    choices, ext = [], None
    for i, group in enumerate(_by_choice(chunks)):
        choice, ext_i = _chat_choice(group)
        choices.append(dict(choice, index=i))
        ext = ext if ext is not None else ext_i
    return {"id": first["id"], "object": "chat.completion", "created": first["created"], "model": first["model"],
            "choices": choices, "usage": _usage(stats), responses.EXTENSION: ext}


def _chat_choice(chunks: list[dict]) -> tuple[dict, dict | None]:
    role, content, reasoning, finish, ext = "assistant", [], [], None, None
    entries, with_logprobs, calls = [], False, {}
    for c in chunks:
        choice = c["choices"][0]
        delta = choice.get("delta") or {}
        role = delta.get("role") or role
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        _merge_tool_calls(calls, delta.get("tool_calls"))
        if choice.get("logprobs") is not None:
            with_logprobs = True
            entries.extend(choice["logprobs"].get("content") or [])
        finish = choice.get("finish_reason") or finish
        ext = c.get(responses.EXTENSION, ext)
    message = {"role": role, "content": "".join(content) if any(content) or not calls else None}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"index": 0, "message": message, "logprobs": {"content": entries, "refusal": None} if with_logprobs
            else None, "finish_reason": finish}, ext


def assemble_completion(chunks: list[dict], stats) -> dict:
    """A ``text_completion`` from its stream chunks, one choice per index."""
    choices, ext = [], None
    for i, group in enumerate(_by_choice(chunks)):
        text, finish, parts = [], None, []
        for c in group:
            choice = c["choices"][0]
            text.append(choice.get("text") or "")
            parts.append(choice.get("logprobs"))
            finish = choice.get("finish_reason") or finish
            ext = c.get(responses.EXTENSION, ext) if i == 0 else ext
        choices.append({"text": "".join(text), "index": i, "logprobs": lp.merge(parts) if any(parts) else None,
                        "finish_reason": finish})
    first = chunks[0]
    return {"id": first["id"], "object": "text_completion", "created": first["created"], "model": first["model"],
            "choices": choices, "usage": _usage(stats), responses.EXTENSION: ext}


def usage_chunk(last: dict, stats) -> dict:
    """The chunk ``stream_options.include_usage`` asks for after the last one: no choices, the usage (OpenAI's
    shape), the same id, object, created and model as the stream's ``last`` chunk."""
    return {"id": last["id"], "object": last["object"], "created": last["created"], "model": last["model"],
            "choices": [], "usage": _usage(stats)}
