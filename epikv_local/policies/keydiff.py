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

from ._keys import KeyLayers, PositionRows, obs_keys
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
        self._store = PositionRows()   # (N, L, d_k) unit key rows of the live positions

    def observe(self, obs: Observation) -> None:
        k = obs_keys(obs, "KeyDiffPolicy")
        if len(k):
            self._store.append(obs.positions, k / (np.linalg.norm(k, axis=-1, keepdims=True) + _EPS))

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._store.scores(positions, self._dissimilarity)

    def _dissimilarity(self) -> np.ndarray:
        """(N,) -mean over key layers of cos(row, mean unit key of the live rows)."""
        keys = self._store.rows
        mean = keys.mean(axis=0)                                          # (L, d_k)
        mean /= np.linalg.norm(mean, axis=-1, keepdims=True) + _EPS
        return -np.einsum("nld,ld->nl", keys, mean).mean(axis=1)
