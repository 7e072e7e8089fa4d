"""Non-streaming responses assembled from the chunks of the Llama's stream.

Every request runs as the Llama's stream (so that a client that disconnects also stops a long non-streaming
generation); a non-streaming response is built from its chunks here. The Llama's reasoning splitter makes the
streamed deltas and its own final message agree, so the result is what its non-streaming call returns.
``stats`` is the generation's statistics (``n_prompt_tokens``, ``n_generated_tokens``: token counts; None: zero
usage). Imports nothing but the Llama's response shapes.
"""

from .. import responses


def _usage(stats) -> dict:
    """OpenAI's ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) of ``stats``."""
    if stats is None:
        return responses.usage(0, 0)
    return responses.usage(stats.n_prompt_tokens, stats.n_generated_tokens)


def assemble_chat(chunks: list[dict], stats) -> dict:
    """A ``chat.completion`` from its ``chat.completion.chunk``s (as the Llama's non-streaming call returns)."""
    role, content, reasoning, finish, ext = "assistant", [], [], None, None
    for c in chunks:
        choice = c["choices"][0]
        delta = choice.get("delta") or {}
        role = delta.get("role") or role
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        finish = choice.get("finish_reason") or finish
        ext = c.get(responses.EXTENSION, ext)
    message = {"role": role, "content": "".join(content)}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    first = chunks[0]
    return {"id": first["id"], "object": "chat.completion", "created": first["created"], "model": first["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(stats), responses.EXTENSION: ext}


def assemble_completion(chunks: list[dict], stats) -> dict:
    """A ``text_completion`` from its stream chunks."""
    text, finish, ext = [], None, None
    for c in chunks:
        choice = c["choices"][0]
        text.append(choice.get("text") or "")
        finish = choice.get("finish_reason") or finish
        ext = c.get(responses.EXTENSION, ext)
    first = chunks[0]
    return {"id": first["id"], "object": "text_completion", "created": first["created"], "model": first["model"],
            "choices": [{"text": "".join(text), "index": 0, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(stats), responses.EXTENSION: ext}
