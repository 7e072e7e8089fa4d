"""The parts of ``llama_cpp.Llama``'s surface beyond completions and chat, as a mixin of
:class:`epikv_local.api.llama.Llama`: embeddings, in-memory states and caches, the low-level
``eval`` / ``sample`` / ``generate`` loop over the budgeted cache (:mod:`.lowlevel`), and the small accessors.

Where a name cannot mean exactly what it means in llama-cpp-python, its docstring says how it differs: ``ctx``
and ``model`` are this package's engine objects, not llama.cpp pointers; a state holds the whole budgeted
session (evictions and policy state), not a llama.cpp context state; embeddings run on a context of their own.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from ..engine.handles import Context, Model
from ..engine.sampling import MAX_SEED
from ..errors import ConfigError, utf8
from . import llama_state
from .embeddings import EMBED_N_CTX, Embedder, PoolingType, normalized, pooling_type
from .llama_state import LlamaState
from .logprobs import logits_to_logprobs as _logits_to_logprobs
from .lowlevel import LowLevel


class LlamaExtras(LowLevel):
    """Mixed into ``Llama``; uses its ``session``, ``_model``, ``_stack``, ``tokenize``, ``detokenize``,
    ``create_chat_completion``, ``model_path``, ``verbose``, ``seed`` and ``_lock``."""

    #: llama-cpp-python's ``pooling_type`` for the embeddings context (``LLAMA_POOLING_TYPE_*`` or a name);
    #: None = the model's own. Read when that context is created (the first ``embed``).
    embedding_pooling_type: int | str | None = None
    #: cells of the embeddings context = the longest input (tokens; llama-cpp-python's default n_batch)
    embedding_n_ctx: int = EMBED_N_CTX
    #: llama-cpp-python's prompt cache (``LlamaRAMCache`` / ``LlamaDiskCache``), set with :meth:`set_cache`
    cache = None
    _embedder: Embedder | None = None

    # -- embeddings ---------------------------------------------------------------------------------------
    def _embeddings(self) -> Embedder:
        """The embeddings context, created on first use and owned by the Llama's stack (closed before the
        session and the model when the Llama closes)."""
        session = self.session  # ConfigError once closed
        with self._lock:
            if self._embedder is None:
                cfg = session.cfg
                emb = Embedder(self._model, n_ctx=self.embedding_n_ctx,
                               pooling=pooling_type(self.embedding_pooling_type), flash_attn=cfg.flash_attn,
                               n_threads=session.ctx.n_threads, type_k=cfg.type_k, type_v=cfg.type_v)
                self._embedder = self._stack.enter_context(emb)
            return self._embedder

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False):
        """Embeddings of a string or a list of strings, as llama-cpp-python's ``Llama(embedding=True).embed``:
        per input a list of n_embd floats (pooled), or with pooling NONE (this model's own, for a generative
        model) a list of per-token lists; a list of those for a list input. normalize: L2-normalise each
        vector. truncate: cut an input to ``embedding_n_ctx`` tokens (else longer is a ConfigError, a
        ValueError). return_count: also return the total number of tokens.

        Differences: each input is its own forward pass on a separate embeddings context (llama-cpp-python
        packs several into one batch: the numbers agree within float rounding); the conversation in the
        budgeted cache is kept (llama-cpp-python resets its one context)."""
        inputs = [input] if isinstance(input, str) else input
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(t, str) for t in inputs):
            raise ConfigError(f"input must be a string or a list of strings, got {type(input).__name__}")
        emb = self._embeddings()
        data, total = [], 0
        for i, text in enumerate(inputs):
            tokens = self.tokenize(utf8(text, f"input {i}"))
            if truncate:
                tokens = tokens[:emb.n_batch]
            if len(tokens) > emb.n_batch:
                raise ConfigError(f"input {i} has {len(tokens)} tokens, over the {emb.n_batch} of the embeddings "
                                  "context (truncate=True cuts it)")
            if not tokens:
                raise ConfigError(f"input {i} is empty (no tokens to embed)")
            total += len(tokens)
            v = emb.embed_tokens(tokens)
            data.append((normalized(v) if normalize else v).tolist())
        output = data[0] if isinstance(input, str) else data
        return (output, total) if return_count else output

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict:
        """OpenAI's embeddings response: {"object": "list", "data": [{"object": "embedding", "embedding":
        [...], "index": i}, ...], "model": model or the model path, "usage": {"prompt_tokens": n,
        "total_tokens": n}} (n: tokens embedded), as llama-cpp-python's."""
        inputs = input if isinstance(input, list) else [input]
        embeds, total = self.embed(inputs, return_count=True)
        return {
            "object": "list",
            "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(embeds)],
            "model": model if model is not None else self.model_path,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }

    def pooling_type(self) -> PoolingType:
        """The embeddings' pooling type as llama-cpp-python returns it (an int, ``LLAMA_POOLING_TYPE_*``; here
        an IntEnum that equals it and has its ``.name``): the embeddings context's once it exists, else the one
        it will get (``embedding_pooling_type``, or the model's)."""
        session = self.session
        if self._embedder is not None:
            return self._embedder.pooling
        requested = pooling_type(self.embedding_pooling_type)
        # llama.cpp resolves "unspecified" to the model's own pooling in any context, embeddings or not
        return requested if requested is not None else PoolingType(session.ctx.pooling_type())

    # -- states and the prompt cache ----------------------------------------------------------------------
    def save_state(self) -> LlamaState:
        """The sequence in memory (``LlamaState``: input_ids, scores, n_tokens, llama_state bytes,
        llama_state_size, seed, ...): the evicted cache with its holes, the engine's bookkeeping and the policy's
        state (the session file format, opaque). :meth:`load_state` continues it with identical logits."""
        row = self._last_logits()
        if row is None:
            row = self._stale_scores()
        n_vocab = self._open_model.info.n_vocab
        scores = row.reshape(1, n_vocab).copy() if row is not None and row.size == n_vocab else np.zeros(
            (0, n_vocab), dtype=np.single)
        return llama_state.capture(self.session, self.seed, scores)

    def load_state(self, state: LlamaState) -> None:
        """Continue a sequence saved by :meth:`save_state` (same model file and cache types; ConfigError for a
        llama_cpp state, DataError for damaged bytes: the session is then left as it was). Supersedes a stream
        still being read. The next sample decodes the last token again (llama-cpp-python: ``_requires_eval``)."""
        llama_state.check(state)
        self._supersede()
        with self._lock:
            llama_state.restore(self.session, state)
        self.seed = state.seed
        self._stale_at = self._logits_mark()
        self._loaded_scores = state.scores

    def _stale_scores(self) -> np.ndarray | None:
        """The loaded state's logits row while the session still is that state, else None."""
        scores = getattr(self, "_loaded_scores", None)
        return scores[-1] if self._logits_stale() and scores is not None and len(scores) else None

    def set_cache(self, cache) -> None:
        """Use ``cache`` (llama-cpp-python's ``LlamaRAMCache`` / ``LlamaDiskCache``, or None) for completions:
        states keyed by token sequences, restored by longest prefix (:meth:`_cache_lookup`, :meth:`_cache_store`)."""
        self.cache = cache

    def _cache_lookup(self, tokens: Sequence[int]) -> bool:
        """Before a completion of ``tokens`` (the prompt ids): load the cached state with the longest common
        prefix when it shares more of ``tokens`` than the session holds (llama-cpp-python's
        ``_create_completion``). Returns whether a state was loaded. An entry that is not a state of this
        package (e.g. saved by llama_cpp into a shared cache) counts as a miss."""
        cache = self.cache
        if not cache:
            return False
        tokens = [int(t) for t in tokens]
        try:
            item = cache[tokens]
        except KeyError:
            return False
        if getattr(item, "format", None) != llama_state.FORMAT:
            return False
        cached = self.longest_token_prefix(np.asarray(item.input_ids).tolist(), tokens)
        if cached <= self.longest_token_prefix(self.session.tokens, tokens):
            return False
        self.load_state(item)
        return True

    def _cache_store(self, tokens: Sequence[int] | None = None) -> None:
        """After a completion: store :meth:`save_state` in the cache under ``tokens`` (llama-cpp-python: prompt +
        completion ids; default: the tokens the session holds)."""
        cache = self.cache
        if not cache:
            return
        key = tuple(self.session.tokens) if tokens is None else tuple(int(t) for t in tokens)
        cache[key] = self.save_state()

    # -- small accessors ------------------------------------------------------------------------------------
    def tokenizer(self):
        """A ``llama_cpp.llama_tokenizer.BaseLlamaTokenizer`` over this Llama (``tokenize`` / ``detokenize``
        on bytes, ``encode`` / ``decode`` on str), as llama-cpp-python's ``LlamaTokenizer``."""
        return _tokenizer_class()(self)

    def set_seed(self, seed: int) -> None:
        """The seed of later samples (0 .. 2^32 - 1; 2^32 - 1 = a random seed, as llama.cpp's default)."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in 0..{MAX_SEED}, got {seed!r}")
        self.seed = int(seed)

    def n_embd(self) -> int:
        """The model's embedding width (floats)."""
        return self._open_model.info.n_embd

    def token_nl(self) -> int:
        """The newline token id (llama_vocab_nl)."""
        m = self._open_model
        with m.using():
            return int(m.nat.llama.llama_vocab_nl(m.vocab))

    @property
    def ctx(self) -> Context:
        """The session's engine :class:`~epikv_local.engine.handles.Context` (llama-cpp-python returns its raw
        ``llama_context_p``; the pointer is ``ctx.handle``, but decoding through it bypasses the budget)."""
        return self.session.ctx

    @property
    def model(self) -> Model:
        """The engine :class:`~epikv_local.engine.handles.Model` (llama-cpp-python returns its raw
        ``llama_model_p``; the pointer is ``model.handle``)."""
        return self._open_model

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any):
        """``create_chat_completion`` as openai's types (``ChatCompletion``, or a generator of
        ``ChatCompletionChunk`` with ``stream=True``); needs the ``openai`` package, as llama-cpp-python's."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise ImportError("To use create_chat_completion_openai_v1, you must install the openai package. "
                              "You can install it with `pip install openai`.") from None
        stream = kwargs.get("stream", False)
        if not isinstance(stream, bool):
            raise ConfigError(f"stream must be a bool, got {stream!r}")
        if stream:
            return (ChatCompletionChunk(**chunk) for chunk in self.create_chat_completion(*args, **kwargs))
        return ChatCompletion(**self.create_chat_completion(*args, **kwargs))

    logits_to_logprobs = staticmethod(_logits_to_logprobs)  # llama-cpp-python's (one copy: api/logprobs.py)

    @staticmethod
    def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
        """The length of the common prefix of two token sequences."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n


@functools.cache
def _tokenizer_class():
    # built on first use: importing llama_cpp before the native library is loaded would bind another libllama
    from llama_cpp.llama_tokenizer import BaseLlamaTokenizer

    class LlamaTokenizer(BaseLlamaTokenizer):
        """llama-cpp-python's ``LlamaTokenizer`` over an ``epikv_local.Llama``."""

        def __init__(self, llama):
            self.llama = llama

        def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
            return self.llama.tokenize(text, add_bos=add_bos, special=special)

        def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
            return self.llama.detokenize(tokens, special=special)

        def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
            return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

        def decode(self, tokens: list[int]) -> str:
            return self.detokenize(tokens).decode("utf-8", errors="ignore")

    return LlamaTokenizer
