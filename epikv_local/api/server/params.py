"""Request bodies and their translation into Llama arguments.

The request models are llama-cpp-python's server's (``CreateChatCompletionRequest``,
``CreateCompletionRequest``: field names, types and ranges as it accepts them); only the chat messages are left
to the Llama's own check, whose errors name the message. Sampling fields a request does not set take the
Llama's defaults (the reasoning-model temperature 0.6 / top-p 0.95, no ``max_tokens`` limit), not the request
model's. This module imports pydantic and llama-cpp-python's server at the top (so llama_cpp):
:func:`~epikv_local.api.server.routes.create_app` imports it, nothing at import time.
"""

from typing import Any

from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import Field

from ..chat import flatten_text_parts
from .errors import APIError

#: request fields that are not Llama arguments (checked or converted here)
NOT_LLAMA_ARGS = frozenset({"n", "best_of", "user", "logit_bias_type", "min_tokens", "stream"})

CompletionRequest = CreateCompletionRequest


class ChatRequest(CreateChatCompletionRequest):
    # the Llama checks each message (check_messages: role, content, naming the index); pydantic's union of
    # message TypedDicts would answer a wrong content type with a list of role mismatches
    messages: list[dict[str, Any]] = Field(default_factory=list, description="the conversation")


def token_bias(body) -> dict | None:
    """The request's ``logit_bias`` when it is keyed by token text (``logit_bias_type="tokens"``), to be turned
    into token ids once the model is held; None otherwise (ids are passed on as they are)."""
    return body.logit_bias if body.logit_bias_type == "tokens" else None


def request_kwargs(body, alias: str, input_field: str) -> dict:
    """The request's fields as Llama arguments (unset ones take the Llama's defaults), checked, without
    ``input_field`` (``"messages"`` or ``"prompt"``: the caller converts it) and without a text-keyed
    ``logit_bias`` (:func:`token_bias`). ``alias``: the one model id this server answers to."""
    excluded = {input_field, "logit_bias"} if body.logit_bias_type == "tokens" else {input_field}
    if body.model is not None and body.model != alias:
        raise APIError(404, f"the model `{body.model}` does not exist; this server serves `{alias}`",
                       "invalid_request_error", "model", "model_not_found")
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
    if getattr(body, "best_of", None) not in (None, 1):
        raise APIError(400, f"best_of must be 1, got {body.best_of}", param="best_of")
    if body.min_tokens:
        raise APIError(400, "min_tokens is not supported by epikv-local", param="min_tokens")
    kw = {k: v for k, v in body.model_dump(exclude_unset=True, exclude=NOT_LLAMA_ARGS | excluded).items()
          if v is not None}
    if body.logit_bias is not None and body.logit_bias_type != "tokens":
        bad = [k for k in body.logit_bias if not k.lstrip("-").isdigit()]
        if bad:
            raise APIError(400, f"logit_bias keys must be token ids, got {bad[:3]} (or set "
                                "logit_bias_type='tokens')", param="logit_bias")
    kw["model"] = alias
    return kw


def chat_kwargs(body: ChatRequest, alias: str) -> dict:
    """``Llama.create_chat_completion`` arguments of a chat request (messages with text parts joined)."""
    kw = request_kwargs(body, alias, "messages")
    kw["messages"] = [flatten_text_parts(m) for m in body.messages]
    return kw


def completion_kwargs(body: CompletionRequest, alias: str) -> dict:
    """``Llama.create_completion`` arguments of a completion request: one prompt (a list of one is unpacked)."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) > 1:
            raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0] if prompt else ""
    kw = request_kwargs(body, alias, "prompt")
    kw["prompt"] = prompt
    return kw
