"""LagKV (Liang et al., 2025): score a chunk of tokens against the next chunk, "the lag reference".

Tokens are split into consecutive chunks of ``chunk`` positions (chunk i = positions
[i*chunk, (i+1)*chunk)). Chunk i is normalised per channel by the min and max over chunk i+1:
``kn = (k - min) / (max - min + eps)``; score = mean over key layers of the std over channels of ``kn``
(a token whose key stands out from its successors' range varies more and is kept). K only: llama.cpp's
values are not captured, so the V half of the paper's score is left out; the row is taken whole (all KV
heads together) rather than per head.

Signal read: the keys after RoPE captured per layer by the patched llama.cpp build when each token is
processed (exactly the cache content); attention-free, so flash attention stays on.

Causality: positions whose following chunk is not complete yet have no score and get +inf (keep); when the
chunk after them completes their score is computed once. Only the keys of the last two incomplete/pending
chunks are stored. Default key layers: all (``n_key_layers=None``); an integer picks evenly spaced layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._keys import KeyLayers, obs_keys
from .base import Observation, Policy, PositionScores, check_int

_EPS = 1e-6


@dataclass
class LagKVPolicy(KeyLayers, Policy):
    name: ClassVar[str] = "lagkv"
    chunk: int = 16
    n_key_layers: int | None = None

    def __post_init__(self):
        check_int("lagkv", "chunk", self.chunk, 2)
        self.check_key_layers()
        self._scores = PositionScores()
        super().__post_init__()

    def reset(self) -> None:
        self._scores.reset()
        self._chunks: dict[int, np.ndarray] = {}   # chunk index -> (chunk, L, d_k) keys
        self._filled: dict[int, np.ndarray] = {}   # chunk index -> (chunk,) bool

    def observe(self, obs: Observation) -> None:
        k = obs_keys(obs, "LagKVPolicy")
        pos = np.asarray(obs.positions, dtype=np.int64)
        c = self.chunk
        for ci in np.unique(pos // c):
            sel = pos // c == ci
            if ci not in self._chunks:
                self._chunks[ci] = np.zeros((c,) + k.shape[1:])
                self._filled[ci] = np.zeros(c, dtype=bool)
            self._chunks[ci][pos[sel] % c] = k[sel]
            self._filled[ci][pos[sel] % c] = True
        for ci in sorted(self._chunks):
            prev = ci - 1
            if self._filled[ci].all() and prev in self._chunks and self._filled[prev].all():
                self._score_chunk(prev, self._chunks[ci])
                del self._chunks[prev], self._filled[prev]

    def _score_chunk(self, ci: int, ref: np.ndarray) -> None:
        lo, hi = ref.min(axis=0), ref.max(axis=0)                      # (L, d_k)
        kn = (self._chunks[ci] - lo) / (hi - lo + _EPS)                # (chunk, L, d_k)
        s = kn.std(axis=-1).mean(axis=-1)                              # (chunk,)
        self._scores.set(np.arange(ci * self.chunk, (ci + 1) * self.chunk), s)

    def score(self, positions: np.ndarray) -> np.ndarray:
        s = np.array(self._scores.get(positions), dtype=np.float64)
        s[np.isnan(s)] = np.inf
        return s
