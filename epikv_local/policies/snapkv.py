"""SnapKV (Li et al., 2024) adapted to decoding: attention of an observation window, max-pooled.

Scores: the sum of the attention rows of the last ``window`` decodes (a deque of per-decode vectors mapped
to positions: ``attn_last`` for single-token decodes; for multi-token decodes, e.g. prefill chunks,
``attn_received``, the sum over that decode's queries, counted as one entry), then a 1-D max filter of width
``kernel`` over the live positions sorted by position (SnapKV's pooling, which keeps the neighbours of an
attended token so that whole spans survive). Positions never attended in the window score 0 before pooling.

Signal read: the attention matrix read back by the native shim (averaged over the captured layers and
heads); flash attention never materialises it, so this policy requires flash attention off.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._attn import per_position
from .base import Observation, Policy, check_int


def max_filter_1d(x: np.ndarray, kernel: int) -> np.ndarray:
    """Centred running max of width ``kernel`` (edges use the available neighbours)."""
    if kernel <= 1 or len(x) == 0:
        return x.copy()
    left = (kernel - 1) // 2
    right = kernel - 1 - left
    padded = np.concatenate([np.full(left, -np.inf), x, np.full(right, -np.inf)])
    return np.lib.stride_tricks.sliding_window_view(padded, kernel).max(axis=1)


@dataclass
class SnapKVPolicy(Policy):
    name: ClassVar[str] = "snapkv"
    needs_attention: ClassVar[bool] = True
    window: int = 16
    kernel: int = 5

    def __post_init__(self):
        check_int("snapkv", "window", self.window, 1)
        check_int("snapkv", "kernel", self.kernel, 1)
        super().__post_init__()

    def reset(self) -> None:
        self._rows: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.window)

    def observe(self, obs: Observation) -> None:
        which = "attn_last" if len(obs.positions) == 1 else "attn_received"
        self._rows.append(per_position(obs, which, "SnapKVPolicy"))

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if not len(positions):
            return np.zeros(0)
        top = int(positions.max()) + 1
        acc = np.zeros(top)
        for pos, vals in self._rows:
            m = pos < top
            np.add.at(acc, pos[m], vals[m])
        order = np.argsort(positions, kind="stable")
        pooled = max_filter_1d(acc[positions[order]], self.kernel)
        out = np.empty(len(positions))
        out[order] = pooled
        return out
