"""R-KV (Cai et al., 2025) for decoding: importance minus redundancy, and its attention-free half.

R-KV rates a key by ``lam * importance - (1 - lam) * redundancy``. Our reading of its redundancy term:
per KV head, the cosine similarity of every pair of live keys; a key is redundant when *newer* keys say the
same thing (similarity above ``threshold``): ``red(p) = sum over newer p' with cos > threshold of cos(p, p')``
divided by the number of live keys, averaged over heads and key layers, then softmax-normalised over the live
keys as in the paper. Among near-duplicates the newest copy therefore survives, unlike KeyDiff's similarity to
the mean, which treats every copy alike.

* ``rkv_redundancy`` (:class:`RKVRedundancyPolicy`): score = ``-redundancy``; keys only, flash attention on.
* ``rkv`` (:class:`RKVPolicy`): importance = the attention the cells received from the last ``window`` decodes
  (SnapKV's observation window), normalised to sum 1, mixed with ``lam``; needs the attention matrix, so
  flash attention off.

Cost: one (N x N) similarity per head and key layer at every scoring (N = live keys); state as KeyDiff's
(unit key rows of the live positions).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._attn import per_position
from ._keys import KeyLayers, PositionRows, obs_keys
from .base import ModelShape, Observation, Policy, Signals, check_float, check_int

_EPS = 1e-12


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@dataclass
class RKVRedundancyPolicy(KeyLayers, Policy):
    name: ClassVar[str] = "rkv_redundancy"
    n_key_layers: int | None = 4
    threshold: float = 0.5

    def __post_init__(self):
        self.check_key_layers()
        check_float(self.name, "threshold", self.threshold, -1.0, 1.0, hi_open=True, what="a cosine")
        self._n_kv = 1
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        self._n_kv = max(1, shape.n_head_kv)
        return KeyLayers.signals(self, shape)

    def reset(self) -> None:
        self._store = PositionRows()   # (N, L, n_kv, head_dim) float32 unit rows per head of the live positions

    def observe(self, obs: Observation) -> None:
        k = obs_keys(obs, type(self).__name__)
        if not len(k):
            return
        k = k.reshape(k.shape[0], k.shape[1], self._n_kv, -1)
        self._store.append(obs.positions, (k / (np.linalg.norm(k, axis=-1, keepdims=True) + _EPS)).astype(np.float32))

    def redundancy(self) -> np.ndarray:
        """(N,) softmax-normalised redundancy of the stored (live) rows, ascending positions."""
        n = len(self._store.pos)
        k = np.moveaxis(self._store.rows, 0, 2)                        # (L, H, N, d)
        sim = k @ np.swapaxes(k, -1, -2)                               # (L, H, N, N): cos(p_i, p_j)
        newer = np.triu(np.ones((n, n), dtype=bool), 1)                # j > i: rows sorted by position
        red = np.where(newer & (sim > self.threshold), sim, 0.0).sum(axis=-1).mean(axis=(0, 1)) / n
        return _softmax(red.astype(np.float64))

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._store.scores(positions, lambda: -self.redundancy())


@dataclass
class RKVPolicy(RKVRedundancyPolicy):
    name: ClassVar[str] = "rkv"
    needs_attention: ClassVar[bool] = True
    lam: float = 0.1
    window: int = 16

    def __post_init__(self):
        check_float("rkv", "lam", self.lam, 0.0, 1.0)
        check_int("rkv", "window", self.window, 1)
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        keys = super().signals(shape)
        return Signals(key_layers=keys.key_layers, attention_layers=tuple(range(shape.n_layer)))

    def reset(self) -> None:
        super().reset()
        self._rows: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.window)

    def observe(self, obs: Observation) -> None:
        super().observe(obs)
        which = "attn_last" if len(obs.positions) == 1 else "attn_received"
        self._rows.append(per_position(obs, which, "RKVPolicy"))

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._store.scores(positions, self._mixed)

    def _mixed(self) -> np.ndarray:
        """(N,) lam * importance - (1 - lam) * redundancy of the live rows."""
        stored = self._store.pos
        imp = np.zeros(len(stored))
        for pos, vals in self._rows:   # attention of the observation window, per stored position
            j = np.searchsorted(stored, pos)
            ok = (j < len(stored)) & (stored[np.minimum(j, len(stored) - 1)] == pos)
            np.add.at(imp, j[ok], vals[ok])
        imp = imp / imp.sum() if imp.sum() > 0 else np.full(len(imp), 1.0 / len(imp))
        return self.lam * imp - (1.0 - self.lam) * self.redundancy()
