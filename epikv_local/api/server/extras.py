"""llama-server's endpoints beside OpenAI's: ``POST /tokenize``, ``POST /detokenize`` and ``GET /props``, in its
shapes, kept to what is true of this server.

- ``POST /tokenize`` ``{"content": str, "add_special": false, "parse_special": true, "with_pieces": false}`` ->
  ``{"tokens": [id, ...]}``, or with pieces ``{"tokens": [{"id": id, "piece": str}, ...]}`` (a piece that is
  not valid UTF-8 on its own is its list of byte values, as llama-server gives it);
- ``POST /detokenize`` ``{"tokens": [id, ...]}`` -> ``{"content": str}`` (special tokens rendered as text);
- ``GET /props``: ``default_generation_settings`` (the KV budget as ``n_ctx`` and the sampling defaults a
  request that sets none gets), ``total_slots`` 1, ``model_path`` (the file name only: the server does not tell
  where its files are), ``model_alias``, ``chat_template`` (the GGUF's, when it is the one used), ``build_info``,
  ``max_prompt_tokens`` and ``epikv`` (``kv_budget``, ``policy``).

Tokenizing runs in a worker thread beside a generation (the vocabulary is read-only). This module imports
fastapi and pydantic at the top: :func:`~epikv_local.api.server.routes.create_app` imports it.
"""

import inspect
from pathlib import Path

from fastapi import Depends
from pydantic import BaseModel, Field

from .. import responses
from .params import STRICT

#: the sampling parameters /props reports, with the Llama's defaults
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
            "presence_penalty")


class TokenizeRequest(BaseModel):
    model_config = STRICT
    content: str = Field(description="the text to tokenize")
    add_special: bool = Field(False, description="add the model's BOS token (when it has one)")
    parse_special: bool = Field(True, description="read special tokens such as <|im_start|> in the text as such")
    with_pieces: bool = Field(False, description="return each token's text with its id")


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    tokens: list[int] = Field(description="token ids")


def piece(llama, token: int):
    """A token's text (llama-server's ``piece``): a str when its bytes are UTF-8, else their values."""
    raw = llama.detokenize([token], special=True)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def generation_defaults(llama, max_tokens: int) -> dict:
    """The sampling a request that sets nothing gets (the Llama's defaults) and the server's token limit."""
    from ..llama import REASONING_TEMPERATURE, REASONING_TOP_P

    params = inspect.signature(llama.completion_steps).parameters
    out = {name: params[name].default for name in SAMPLING if name in params}
    out["temperature"] = REASONING_TEMPERATURE if out.get("temperature") is None else out["temperature"]
    out["top_p"] = REASONING_TOP_P if out.get("top_p") is None else out["top_p"]
    out["n_predict"] = max_tokens
    return out


def props(llama, alias: str, max_tokens: int) -> dict:
    import llama_cpp

    from ... import __version__

    gguf_template = llama.chat_format == "chat_template.default"
    return {"default_generation_settings": {"n_ctx": llama.n_ctx(), "params": generation_defaults(llama, max_tokens)},
            "total_slots": 1, "model_path": Path(llama.model_path).name, "model_alias": alias,
            "chat_format": llama.chat_format,
            "chat_template": llama.metadata.get("tokenizer.chat_template", "") if gguf_template else "",
            "build_info": f"epikv-local {__version__} (llama-cpp-python {llama_cpp.__version__})",
            "max_prompt_tokens": llama.max_prompt_tokens,
            responses.EXTENSION: {"kv_budget": llama.n_ctx(), "policy": llama.session.policy.name}}


def add_routes(router, service, authenticate, max_tokens: int) -> None:
    """Add the three endpoints to ``router`` (behind ``authenticate``, a FastAPI dependency). A shutdown does
    not wait for a tokenization in flight (``abandon_on_cancel``): the server's close gives up on it after the
    grace period."""
    import anyio

    def borrowed(call):
        with service.borrow() as llama:
            return call(llama)

    @router.post("/tokenize", dependencies=[Depends(authenticate)])
    async def tokenize(body: TokenizeRequest):
        def run(llama):
            # a text too long to be a prompt is refused before it is tokenized (seconds of native work)
            llama.check_prompt_bytes(len(body.content.encode("utf-8")))
            ids = llama.tokenize(body.content, add_bos=body.add_special, special=body.parse_special)
            return [{"id": t, "piece": piece(llama, t)} for t in ids] if body.with_pieces else ids
        return {"tokens": await anyio.to_thread.run_sync(borrowed, run, abandon_on_cancel=True)}

    @router.post("/detokenize", dependencies=[Depends(authenticate)])
    async def detokenize(body: DetokenizeRequest):
        def run(llama):
            return llama.detokenize(body.tokens, special=True).decode("utf-8", "replace")
        return {"content": await anyio.to_thread.run_sync(borrowed, run, abandon_on_cancel=True)}

    @router.get("/props", dependencies=[Depends(authenticate)])
    async def get_props():
        return props(service.llama, service.alias, max_tokens)
