"""Prompts: the model's own chat template (rendered by llama-cpp-python's Jinja2 formatter) and tokenizing."""

from __future__ import annotations

from ..engine.handles import Model
from ..errors import ModelError


def apply_chat_template(model: Model, prompt: str, system: str | None = None) -> str:
    """Render a single-turn chat with the model's own template (GGUF ``tokenizer.chat_template``)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = model.meta("tokenizer.chat_template")
    if not template:
        raise ModelError(f"model {model.path.name} has no chat template (tokenizer.chat_template); drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    fmt = Jinja2ChatFormatter(template=template, eos_token=model.eos_text(), bos_token=model.bos_text())
    return fmt(messages=messages).prompt


def tokenize_prompt(model: Model, text: str) -> list[int]:
    """Tokenize, adding BOS only if the rendered text does not already start with it."""
    bos = model.bos_text()
    add_special = not (bos and text.startswith(bos))
    return model.tokenize(text, add_special=add_special, parse_special=True)


def flatten_text_parts(message: dict) -> dict:
    """A message whose content is a list of text parts (``[{"type": "text", "text": ...}, ...]``), with the texts
    joined by newlines, as llama-server does for templates that take a string; anything else unchanged (the
    message check names what is wrong with it)."""
    content = message.get("content")
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return {**message, "content": "\n".join(p["text"] for p in content)}
    return message
