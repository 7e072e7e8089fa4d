"""KeyDiff (Park et al., 2025): keep the keys that differ most from the average key.

Scores: ``-mean over key layers of cos(k_l(p), mean_l)``, where ``mean_l`` is the mean of the L2-normalised
layer-l keys of the positions live at scoring time. Keys parallel to the mean are redundant (evicted first),
keys orthogonal or opposite to it are kept. The score depends on the live set, so it is recomputed at every
``score`` call.

Signal read: the keys after RoPE captured by the patched llama.cpp build when each token is processed (what
is written to the KV cache); attention-free, so flash attention stays on.

State: per position the L2-normalised key row of each key layer (whole row, all KV heads together), i.e.
(n_key_layers, d_k) floats per *live* position: at ``score(positions)`` the rows of positions not in
``positions`` are dropped (evicted positions never come back), so memory is bounded by the budget plus the
tokens decoded since the last eviction. Default key layers: 4 evenly spaced layers (first, last and two in
between) to bound that memory and the copy per token; ``n_key_layers=None`` uses all layers.
Positions never observed score NaN (lowest), which cannot happen for live positions in a session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._keys import KeyLayers, obs_keys
from .base import Observation, Policy

_EPS = 1e-12


@dataclass
class KeyDiffPolicy(KeyLayers, Policy):
    name: ClassVar[str] = "keydiff"
    n_key_layers: int | None = 4

    def __post_init__(self):
        self.check_key_layers()
        super().__post_init__()

    def reset(self) -> None:
        self._pos = np.empty(0, dtype=np.int64)   # ascending stored positions
        self._keys: np.ndarray | None = None        # (N, L, d_k) unit rows

    def observe(self, obs: Observation) -> None:
        k = obs_keys(obs, "KeyDiffPolicy")
        if not len(k):
            return
        unit = k / (np.linalg.norm(k, axis=-1, keepdims=True) + _EPS)
        pos = np.asarray(obs.positions, dtype=np.int64)
        if self._keys is None:
            self._pos, self._keys = pos.copy(), unit
        else:
            self._pos = np.concatenate([self._pos, pos])
            self._keys = np.concatenate([self._keys, unit])
        if len(self._pos) > 1 and np.any(np.diff(self._pos) <= 0):  # keep sorted, unique (last write wins)
            rev = len(self._pos) - 1 - np.unique(self._pos[::-1], return_index=True)[1]
            self._pos, self._keys = self._pos[rev], self._keys[rev]

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        out = np.full(len(positions), np.nan)
        if self._keys is None or not len(positions):
            return out
        keep = np.isin(self._pos, positions)
        self._pos, self._keys = self._pos[keep], self._keys[keep]
        if not len(self._pos):
            return out
        mean = self._keys.mean(axis=0)                                   # (L, d_k)
        mean /= np.linalg.norm(mean, axis=-1, keepdims=True) + _EPS
        cos = np.einsum("nld,ld->nl", self._keys, mean).mean(axis=1)    # (N,)
        idx = np.searchsorted(self._pos, positions)
        idx_c = np.minimum(idx, len(self._pos) - 1)
        found = self._pos[idx_c] == positions
        out[found] = -cos[idx_c[found]]
        return out
