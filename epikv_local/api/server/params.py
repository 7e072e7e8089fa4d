"""Request bodies and their translation into Llama arguments.

The request models are llama-cpp-python's server's (``CreateChatCompletionRequest``,
``CreateCompletionRequest``: field names and ranges as it accepts them), made strict (``"max_tokens": "10"`` or
``true`` is a 400, not coerced), plus OpenAI's ``max_completion_tokens`` (which wins over ``max_tokens``) and
``stream_options``. The chat messages are checked here for what the chat template cannot take (a missing or
null ``content``, also beside tool calls: 400 naming the message) and their count (``--max-messages``); the rest
of their check is the Llama's, whose errors name the message. Any ``model`` name is accepted (one model is served: responses
name its alias). Sampling fields a request does not set take the Llama's defaults (the reasoning-model
temperature 0.6 / top-p 0.95), not the request model's; ``max_tokens`` defaults to the server's ``--max-tokens``,
and more than it is refused. This module imports pydantic and llama-cpp-python's server at the top (so
llama_cpp): :func:`~epikv_local.api.server.routes.create_app` imports it, nothing at import time.
"""

from typing import Any

from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import BaseModel, ConfigDict, Field

from ..chat import flatten_text_parts, message_problem
from .errors import APIError
from .limits import Limits

#: request fields that are not Llama arguments (checked or converted here)
NOT_LLAMA_ARGS = frozenset({"n", "best_of", "user", "logit_bias_type", "min_tokens", "stream", "stream_options",
                            "max_completion_tokens", "max_tokens"})
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = Field(False, description="send a last chunk with the usage (and no choices) before [DONE]")


class CompletionRequest(CreateCompletionRequest):
    model_config = STRICT
    stream_options: StreamOptions | None = None


class ChatRequest(CreateChatCompletionRequest):
    model_config = STRICT
    # the messages are checked by check_chat_messages and the Llama (naming the index); pydantic's union of
    # message TypedDicts would answer a wrong content type with a list of role mismatches
    messages: list[dict[str, Any]] = Field(default_factory=list, description="the conversation")
    # OpenAI's {"type": "json_schema", "json_schema": {...}} too (llama-cpp-python's model allows text and
    # json_object only); the Llama checks it and names what is wrong
    response_format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema")
    max_completion_tokens: int | None = Field(None, description="tokens to generate at most (wins over max_tokens)")
    stream_options: StreamOptions | None = None


def token_bias(body) -> dict | None:
    """The request's ``logit_bias`` when it is keyed by token text (``logit_bias_type="tokens"``), to be turned
    into token ids once the model is held; None otherwise (ids are passed on as they are)."""
    return body.logit_bias if body.logit_bias_type == "tokens" else None


def include_usage(body) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return body.stream_options is not None and body.stream_options.include_usage


def max_tokens(body, limits: Limits) -> int:
    """The request's token limit: ``max_completion_tokens``, else ``max_tokens``, else the server's
    ``--max-tokens``; asking for more than the server's is a 400 naming it."""
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    asked = getattr(body, field)
    if asked is None:
        return limits.max_tokens
    if asked < 1:
        raise APIError(400, f"{field} must be >= 1, got {asked}", param=field, code="invalid_value")
    if asked > limits.max_tokens:
        raise APIError(400, f"{field} is {asked}, over the server's limit of {limits.max_tokens} tokens "
                            "(--max-tokens)", param=field, code="max_tokens_exceeded")
    return asked


#: the most choices one request may ask for (``n``): each is a generation of up to max_tokens
MAX_CHOICES = 8


def choices(body) -> int:
    """The request's ``n`` (checked by :func:`request_kwargs`)."""
    return body.n or 1


def request_kwargs(body, alias: str, input_field: str, limits: Limits) -> dict:
    """The request's fields as Llama arguments (unset ones take the Llama's defaults), checked, without
    ``input_field`` (``"messages"`` or ``"prompt"``: the caller converts it) and without a text-keyed
    ``logit_bias`` (:func:`token_bias`). ``alias``: the model id responses carry, whatever ``model`` says."""
    excluded = {input_field, "logit_bias"} if body.logit_bias_type == "tokens" else {input_field}
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in 1..{MAX_CHOICES} (choices per request), got {body.n}", param="n")
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
    kw["max_tokens"] = max_tokens(body, limits)
    kw["model"] = alias
    return kw


def check_chat_messages(messages: list[dict], limits: Limits) -> None:
    """400 naming the message: more than ``--max-messages``, or a message whose content the chat template cannot
    render (:func:`~epikv_local.api.chat.message_problem`: content missing, null without tool calls or not text;
    tool calls not of OpenAI's shape)."""
    if len(messages) > limits.max_messages:
        raise APIError(400, f"{len(messages)} messages, over the server's limit of {limits.max_messages} "
                            "(--max-messages)", param="messages", code="too_many_messages")
    for i, m in enumerate(messages):
        problem = message_problem(m)
        if problem:
            raise APIError(400, f"messages[{i}].{problem[0]} {problem[1]}", param=f"messages[{i}].{problem[0]}",
                           code="invalid_value")


def chat_kwargs(body: ChatRequest, alias: str, limits: Limits) -> dict:
    """``Llama.create_chat_completion`` arguments of a chat request (messages with text parts joined)."""
    kw = request_kwargs(body, alias, "messages", limits)
    check_chat_messages(body.messages, limits)
    kw["messages"] = [flatten_text_parts(m) for m in body.messages]
    return kw


def completion_kwargs(body: CompletionRequest, alias: str, limits: Limits) -> dict:
    """``Llama.create_completion`` arguments of a completion request: one prompt (a list of one is unpacked)."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) > 1:
            raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0] if prompt else ""
    kw = request_kwargs(body, alias, "prompt", limits)
    kw["prompt"] = prompt
    return kw
