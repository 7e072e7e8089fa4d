"""Embeddings for ``epikv_local.Llama.embed`` / ``create_embedding``: a separate llama.cpp context created with
``embeddings=True`` on the Llama's model, apart from the budgeted generation cache.

llama-cpp-python computes embeddings on its one context (built with ``Llama(embedding=True)``) and resets it
after each call. Here the generation context is budget-sized and holds a conversation, so embeddings get their
own context instead: created on the first ``embed`` call, kept for later ones, freed with the Llama. Each input
is one forward pass at positions 0..n-1 of sequence 0 of a cleared cache (an embedding never needs more cells
than its input has tokens, so nothing is evicted), which also leaves the conversation's cache untouched.
"""

from __future__ import annotations

import enum
import threading

import numpy as np

from ..engine.handles import Closing, Context, Model
from ..errors import ConfigError

#: cells (= tokens per input) of the embeddings context: llama-cpp-python's default n_ctx and n_batch, so that
#: an input is truncated (``truncate=True``) or refused at the same length as with its defaults
EMBED_N_CTX = 512


class PoolingType(enum.IntEnum):
    """llama.h's ``enum llama_pooling_type``. Members are ints: they compare equal to llama-cpp-python's
    ``LLAMA_POOLING_TYPE_*`` values (which its ``pooling_type()`` returns) and carry the name too."""

    UNSPECIFIED = -1
    NONE = 0
    MEAN = 1
    CLS = 2
    LAST = 3
    RANK = 4


def pooling_type(value) -> PoolingType | None:
    """A requested pooling type (None / UNSPECIFIED: the model's own, returned as None), checked."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = PoolingType[value.upper()]
        except KeyError:
            raise ConfigError(f"pooling_type must be one of {', '.join(p.name for p in PoolingType)}, "
                              f"got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value not in set(PoolingType):
        raise ConfigError(f"pooling_type must be a LLAMA_POOLING_TYPE_* value (-1..4), got {value!r}")
    return None if value == PoolingType.UNSPECIFIED else PoolingType(value)


class Embedder(Closing):
    """An embeddings context on ``model`` (owned; context manager) and the lock that serialises its use.

    n_ctx: cells and the largest input (tokens); pooling: None = the model's pooling type. flash_attn,
    n_threads, type_k, type_v: as the generation context's, so that both run the same kernels.
    """

    def __init__(self, model: Model, n_ctx: int = EMBED_N_CTX, pooling: int | None = None,
                 flash_attn: bool = True, n_threads: int | None = None, type_k: str = "f16", type_v: str = "f16"):
        self.n_batch = n_ctx
        # n_ubatch = n_batch = n_ctx: a non-causal (encoder) model must see a whole input in one ubatch
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, flash_attn=flash_attn, n_threads=n_threads,
                           type_k=type_k, type_v=type_v, embeddings=True, pooling_type=pooling)
        self.pooling = PoolingType(self.ctx.pooling_type())
        self._lock = threading.Lock()  # one input at a time: the context holds one sequence

    def close(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.close()

    def embed_tokens(self, tokens: list[int]) -> np.ndarray:
        """One forward pass over ``tokens`` (1..n_batch ids): (n_tokens, n_embd) float32 per-token embeddings
        with pooling NONE, else the pooled (n_embd,) float32 vector ((n_cls_out,) with RANK)."""
        n = len(tokens)
        if not 1 <= n <= self.n_batch:
            raise ConfigError(f"an embeddings input takes 1..{self.n_batch} tokens, got {n}")
        with self._lock:
            if self.ctx.mem:  # encoder-only models have no memory to clear
                self.ctx.clear()
            # every token is an output: llama.cpp pools over the outputs (llama-cpp-python marks them all too)
            self.ctx.decode(tokens, np.arange(n, dtype=np.int64), logits_all=True)
            if self.pooling == PoolingType.NONE:
                return np.stack([self.ctx.embeddings_ith(i) for i in range(n)])
            return self.ctx.embeddings_seq(0)


def normalized(v: np.ndarray) -> np.ndarray:
    """L2-normalise each row (float64, as llama-cpp-python's ``normalize_embedding``); zero rows stay zero."""
    v = np.asarray(v, dtype=np.float64)
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.divide(v, norm, out=v.copy(), where=norm != 0)
