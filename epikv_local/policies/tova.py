"""TOVA, Token Omission Via Attention (Oren et al., 2024): keep what the newest token attends to.

Scores: the attention weight from the newest query (``obs.attn_last``, averaged over the captured layers and
heads) at the latest decode, mapped to positions through ``obs.cell_pos``. Positions that query did not see
(decoded after it) get +inf (keep). Nothing is accumulated: each decode replaces the scores.

Signal read: the attention matrix read back by the native shim; flash attention never materialises it, so
this policy requires flash attention off (``needs_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._attn import per_position
from .base import Observation, Policy


@dataclass
class TOVAPolicy(Policy):
    name: ClassVar[str] = "tova"
    needs_attention: ClassVar[bool] = True

    def reset(self) -> None:
        # only the newest query's row matters: keep it (sorted by position) instead of a per-position history
        self._pos = np.empty(0, dtype=np.int64)
        self._vals = np.empty(0, dtype=np.float64)

    def observe(self, obs: Observation) -> None:
        pos, vals = per_position(obs, "attn_last", "TOVAPolicy")
        order = np.argsort(pos)
        self._pos, self._vals = pos[order], vals[order]

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        s = np.full(len(positions), np.inf)  # positions the newest query has not seen yet: keep
        if len(self._pos):
            idx = np.minimum(np.searchsorted(self._pos, positions), len(self._pos) - 1)
            hit = self._pos[idx] == positions
            s[hit] = self._vals[idx[hit]]
        return s
