"""Prompts: the model's own chat template (rendered by llama-cpp-python's Jinja2 formatter) and tokenizing."""

from __future__ import annotations

from ..engine.handles import Model
from ..errors import ConfigError, ModelError, utf8

#: the fields that let an assistant turn carry no text (its tool calls are what it says)
CALL_FIELDS = ("tool_calls", "function_call")


def apply_chat_template(model: Model, prompt: str, system: str | None = None) -> str:
    """Render a single-turn chat with the model's own template (GGUF ``tokenizer.chat_template``)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = model.meta("tokenizer.chat_template")
    if not template:
        raise ModelError(f"model {model.path.name} has no chat template (tokenizer.chat_template); drop --chat")
    fmt = Jinja2ChatFormatter(template=template, eos_token=model.eos_text(), bos_token=model.bos_text())
    return fmt(messages=single_turn(prompt, system)).prompt


def single_turn(prompt: str, system: str | None = None) -> list[dict]:
    """The messages of a single-turn chat: an optional system message, then the user's prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_prompt(model: Model, prompt: str, system: str | None = None) -> tuple[list[int], list[bool] | None]:
    """A single-turn chat rendered with the model's template and tokenized (:func:`tokenize_prompt`), with one
    mark per token, True where the template wrote it (:func:`template_marks`; None when nothing can be marked)."""
    tokens = tokenize_prompt(model, apply_chat_template(model, prompt, system))
    return tokens, prompt_template_marks(model, tokens, single_turn(prompt, system))


def tokenize_prompt(model: Model, text: str) -> list[int]:
    """Tokenize, adding BOS only if the rendered text does not already start with it."""
    bos = model.bos_text()
    add_special = not (bos and text.startswith(bos))
    return model.tokenize(text, add_special=add_special, parse_special=True)


def _texts(content) -> list | None:
    """The texts of a message's content: [content] for a string, each part's ``text`` for a list of text parts
    (not yet checked to be strings), None for any other shape."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return [p.get("text") for p in content]
    return None


def _carries_calls(message: dict) -> bool:
    return any(message.get(k) is not None for k in CALL_FIELDS)


def flatten_text_parts(message: dict) -> dict:
    """A message whose content is a list of text parts (``[{"type": "text", "text": ...}, ...]``), with the texts
    joined by newlines, as llama-server does for templates that take a string; the null content of a turn that
    carries tool calls as "" (OpenAI clients send it so; templates render content as text); anything else
    unchanged (:func:`content_problem` names what is wrong with it)."""
    content = message.get("content")
    texts = _texts(content) if isinstance(content, list) else None
    if texts is not None and all(isinstance(t, str) for t in texts):
        return {**message, "content": "\n".join(texts)}
    if content is None and _carries_calls(message):
        return {**message, "content": ""}
    return message


def content_problem(message: dict) -> str | None:
    """Why the chat template cannot render this message's content (the sentence after "messages[i].content"),
    or None: a missing or null content (allowed beside tool calls only), a type that is not text, or text that is
    not valid Unicode (a lone surrogate cannot be encoded, so cannot be tokenized)."""
    content = message.get("content")
    if content is None:
        if _carries_calls(message):
            return None
        return f"is {'null' if 'content' in message else 'missing'}: every message needs a string or a list of " \
               "text parts (null only beside tool_calls)"
    texts = _texts(content)
    if texts is None or not all(isinstance(t, str) for t in texts):
        return f"must be a string or a list of text parts, got {type(content).__name__}"
    for t in texts:
        try:
            utf8(t, "")
        except ConfigError as e:
            return str(e).strip()
    return None


def tool_calls_problem(message: dict) -> tuple[str, str] | None:
    """(field, why) when a message's ``tool_calls`` cannot be rendered, or None: templates render each call's
    ``function.name`` and ``function.arguments`` (``| tojson``), and fail on anything else with a TypeError deep
    inside Jinja."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        return "tool_calls", f"must be a list of tool calls, got {type(calls).__name__}"
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), (str, dict)):
            return f"tool_calls[{k}]", "must be {'id': ..., 'type': 'function', 'function': {'name': str, " \
                                       f"'arguments': str or object}}}}, got {c!r:.120}"
    return None


def message_problem(message: dict) -> tuple[str, str] | None:
    """(field, why) when the chat template cannot render ``message`` (a dict), for an error "messages[i].field
    why": its content (:func:`content_problem`) or its tool calls (:func:`tool_calls_problem`); None when it can."""
    why = content_problem(message)
    return ("content", why) if why else tool_calls_problem(message)


def prompt_template_marks(model, tokens: list[int], messages: list[dict]) -> list[bool] | None:
    """:func:`template_marks` of a tokenized prompt (valid token ids of ``model``, an engine Model)."""
    return template_marks([model.token_bytes(int(t), special=True) for t in tokens], messages)


def template_marks(pieces: list[bytes], messages: list[dict]) -> list[bool] | None:
    """Per token of a rendered chat prompt, whether the chat template wrote it (``Observation.template``).

    pieces: each token's bytes (special tokens as text), whose concatenation is the rendered prompt; messages:
    the conversation it was rendered from. Each message's text content (stripped) is looked up in order in the
    rendered bytes; a token is the template's when none of its bytes falls inside a content found (role
    markers, a default system prompt the template adds, the generation prompt). A token that straddles a
    content's edge is the caller's. None (nothing marked) when there is no content, or when some content is not
    in the rendering verbatim (a template that rewrites what it is given): then every token counts as given.
    """
    text = b"".join(pieces)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        needle = content.strip().encode("utf-8", "surrogatepass")
        at = text.find(needle, cursor)
        if at < 0:
            return None
        spans.append((at, at + len(needle)))
        cursor = at + len(needle)
    if not spans:
        return None
    marks, start, k = [], 0, 0
    for p in pieces:
        end = start + len(p)
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        marks.append(not (k < len(spans) and spans[k][0] < end and end > start))
        start = end
    return marks
