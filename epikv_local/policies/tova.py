"""TOVA, Token Omission Via Attention (Oren et al., 2024): keep what the newest token attends to.

Scores: the attention weight from the newest query (``obs.attn_last``, averaged over the captured layers and
heads) at the latest decode, mapped to positions through ``obs.cell_pos``. Positions that query did not see
(decoded after it) get +inf (keep). Nothing is accumulated: each decode replaces the scores.

Signal read: the attention matrix read back by the native shim; flash attention never materialises it, so
this policy requires flash attention off (``needs_attention``).
"""

from __future__ import annotations

import numpy as np

from ._attn import per_position
from .base import Observation, Policy, PositionScores


class TOVAPolicy(Policy):
    name = "tova"
    needs_attention = True

    def __init__(self):
        self._scores = PositionScores()

    def reset(self) -> None:
        self._scores.reset()

    def observe(self, obs: Observation) -> None:
        pos, vals = per_position(obs, "attn_last", "TOVAPolicy")
        self._scores.reset()
        if len(pos):
            self._scores.set(pos, vals)

    def score(self, positions: np.ndarray) -> np.ndarray:
        s = np.array(self._scores.get(positions), dtype=np.float64)
        s[np.isnan(s)] = np.inf
        return s
