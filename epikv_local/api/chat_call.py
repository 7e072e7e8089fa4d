"""One chat call through llama-cpp-python's chat handler: the ``llama`` the handler is given
(:class:`HandlerCall`), the checks of the OpenAI arguments the handler takes on trust (:func:`chat_arguments`),
and the reasoning split of its response (:func:`split_message`) and stream (:func:`chat_steps`).
"""

from __future__ import annotations

from typing import Iterator

from ..errors import ConfigError
from . import responses
from .chat import prompt_template_marks
from .reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning
from .responses import ChunkStep

#: what a tool without parameters takes (OpenAI: "omitting parameters defines a function with an empty
#: parameter list"; llama-cpp-python's handlers read ``parameters`` unconditionally)
NO_PARAMETERS = {"type": "object", "properties": {}}


class HandlerCall:
    """One chat call's view of the Llama, handed to llama-cpp-python's chat handler as its ``llama``.

    The handler renders the prompt with the model's formatter and completes it through this object's
    :meth:`create_completion` (once, or several times for ``chatml-function-calling``'s tool choice), which
    is where the rendered prompt is known: whether it opens a thinking block is kept here, with the
    statistics of each step of the completion, for this call only (nothing is stored on the Llama). The
    call's own arguments that a handler does not know (``reasoning_budget``) travel here too. Every other
    attribute is the Llama's.
    """

    def __init__(self, llama, reasoning_budget: int | None = None, messages: list[dict] | None = None):
        self._llama = llama
        self.reasoning_budget = reasoning_budget
        self.messages = messages or []  # what the prompt is rendered from: which of its tokens are the template's
        self.opens_thinking = False  # the rendered prompt ends inside an open <think> block
        self.stats = None  # GenerationStats as of the last step the handler read

    def __getattr__(self, name: str):
        return getattr(self._llama, name)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """The Llama's, after its prompt-size check (the handler tokenizes the rendered prompt here)."""
        if isinstance(text, (bytes, bytearray)):
            self._llama.check_prompt_bytes(len(text))
        return self._llama.tokenize(text, add_bos, special)

    def create_completion(self, prompt, stream: bool = False, **kwargs):
        text = prompt if isinstance(prompt, str) else self._llama.detokenize(list(prompt), special=True).decode(
            "utf-8", "replace")
        self.opens_thinking = prompt_opens_thinking(text)
        kwargs.setdefault("reasoning_budget", self.reasoning_budget)
        if kwargs.get("suffix") is None and self.messages:  # which tokens the template wrote, on the tokens the
            # completion will decode (a text prompt tokenized as completion_steps does; a token list was validated
            # by the detokenize above)
            tokens = list(prompt) if not isinstance(prompt, str) else self._llama._prompt_tokens(prompt, None)[0]
            kwargs["template"] = prompt_template_marks(self._llama._model, tokens, self.messages)
        steps = self._recorded(self._llama.completion_steps(prompt, **kwargs))
        if stream:
            return steps
        return responses.completion_from((ChunkStep(c, self.stats) for c in steps),
                                         with_logprobs=kwargs.get("logprobs") is not None)

    __call__ = create_completion

    def _recorded(self, steps: Iterator[ChunkStep]) -> Iterator[dict]:
        try:
            for step in steps:
                self.stats = step.stats
                yield step.chunk
        finally:
            steps.close()


def _check_tools(tools, tool_choice, functions, function_call) -> list | None:
    """ConfigError for tools the handlers would fail on with a KeyError; a tool without ``parameters``
    gets an empty parameter list. Returns the tools to pass (a copy when one was completed)."""
    if tools is not None:
        if not isinstance(tools, (list, tuple)):
            raise ConfigError(f"tools must be a list of tools, got {type(tools).__name__}")
        out = []
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ConfigError(f"tools[{i}] is not supported: a tool is {{'type': 'function', 'function': "
                                  f"{{'name': ..., 'parameters': {{...JSON schema...}}}}}}, got {t!r}")
            out.append(t if "parameters" in fn else {**t, "function": {**fn, "parameters": NO_PARAMETERS}})
        tools = out
    if functions is not None and (not isinstance(functions, (list, tuple)) or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions)):
        raise ConfigError("functions must be a list of {'name': ..., 'parameters': {...}} dicts")
    named = tool_choice if isinstance(tool_choice, dict) else None
    if named is not None:
        name = (named.get("function") or {}).get("name") if isinstance(named.get("function"), dict) else None
        if not isinstance(name, str):
            raise ConfigError(f"tool_choice must be 'none', 'auto' or {{'type': 'function', 'function': "
                              f"{{'name': ...}}}}, got {tool_choice!r}")
        if tools is None or name not in [t["function"]["name"] for t in tools]:
            raise ConfigError(f"tool_choice names {name!r}, which is not one of the tools")
    elif tool_choice is not None and tool_choice not in ("none", "auto"):
        # "required" included: llama-cpp-python's handlers know only these (chatml-function-calling asserts)
        raise ConfigError(f"tool_choice must be 'none', 'auto' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {tool_choice!r}")
    if function_call is not None and not (function_call in ("none", "auto") or (
            isinstance(function_call, dict) and isinstance(function_call.get("name"), str))):
        raise ConfigError(f"function_call must be 'none', 'auto' or {{'name': ...}}, got {function_call!r}")
    return tools


def _response_format(response_format):
    """The response format as llama-cpp-python's handlers read it: ``{"type": "json_object"}`` (any JSON),
    ``{"type": "json_object", "schema": S}``; OpenAI's ``{"type": "json_schema", "json_schema": {"schema":
    S}}`` is translated into the latter (llama-cpp-python 0.3.36's handlers would ignore it)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConfigError(f"response_format must be a dict like {{'type': 'json_object'}}, got {response_format!r}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise ConfigError(f"response_format.schema must be a JSON schema (a dict), got {schema!r}")
        return response_format
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConfigError("response_format {'type': 'json_schema'} needs 'json_schema': {'name': ..., "
                              "'schema': {...}}")
        return {"type": "json_object", "schema": schema}
    raise ConfigError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def chat_arguments(kwargs: dict) -> dict:
    """The handler's keyword arguments, checked: tools, tool_choice, functions, function_call, response_format
    (see :func:`_response_format`) and logprobs (``logprobs=True`` alone: the sampled tokens' logprobs, as in
    OpenAI, i.e. ``top_logprobs=0``; llama-cpp-python would return none)."""
    kw = dict(kwargs)
    kw["tools"] = _check_tools(kw.get("tools"), kw.get("tool_choice"), kw.get("functions"), kw.get("function_call"))
    kw["response_format"] = _response_format(kw.get("response_format"))
    logprobs, top = kw.get("logprobs"), kw.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ConfigError(f"logprobs must be True, False or None in a chat (top_logprobs says how many), "
                          f"got {logprobs!r}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise ConfigError(f"top_logprobs must be an integer >= 0, got {top!r}")
    if logprobs and top is None:
        kw["top_logprobs"] = 0
    return kw


def split_message(out: dict, opens_thinking: bool) -> None:
    """Move the reasoning of a chat response's message into ``reasoning_content`` (in place). A message
    without text content (tool calls: ``content`` None) is left as it is."""
    msg = out["choices"][0]["message"]
    content = msg.get("content")
    if isinstance(content, str):
        reasoning, msg["content"] = split_reasoning(content, opens_thinking)
        if reasoning:
            msg["reasoning_content"] = reasoning


def chat_steps(chunks: Iterator[dict], call: HandlerCall, split: bool) -> Iterator[ChunkStep]:
    """The handler's chat chunks as :class:`ChunkStep`s, with ``<think>`` text moved into
    ``delta.reasoning_content`` (``split``) and the call's ``"epikv"`` statistics on the last chunk. Text the
    splitter holds back (a tag may be split over chunks) carries its chat logprobs entries with it to the
    chunk that finally has it; chunks without text content (the role, tool-call deltas) pass unchanged."""
    splitter = ReasoningSplitter(call.opens_thinking) if split else None
    pending: list = []  # chat logprobs entries ("content") of text not yet handed out
    try:
        for chunk in chunks:
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            if choice.get("finish_reason") is not None:
                if splitter is not None:
                    yield from _deltas(chunk, *splitter.flush(), pending, call.stats)
                if pending:
                    choice["logprobs"] = {"content": pending, "refusal": None}
                    pending = []
                chunk[responses.EXTENSION] = responses.extension(call.stats)
                yield ChunkStep(chunk, call.stats)
            elif splitter is not None and isinstance(delta.get("content"), str) and not delta.get("tool_calls") \
                    and not delta.get("function_call"):
                pending.extend((choice.get("logprobs") or {}).get("content") or [])
                yield from _deltas(chunk, *splitter.feed(delta["content"]), pending, call.stats)
            else:
                yield ChunkStep(chunk, call.stats)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _deltas(template: dict, reasoning: str, content: str, pending: list, stats) -> Iterator[ChunkStep]:
    for key, text in (("reasoning_content", reasoning), ("content", content)):
        if text:
            lp = {"content": list(pending), "refusal": None} if pending else None
            pending.clear()
            yield ChunkStep(responses.chat_delta_chunk(template, {key: text}, logprobs=lp), stats)
