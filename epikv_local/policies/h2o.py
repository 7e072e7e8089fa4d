"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023): keep the tokens that received the most attention.

Scores: accumulated attention received by each position since it entered the cache, i.e. the sum over every
later query (and itself) of its attention weight, averaged over the captured layers and heads
(``obs.attn_received`` mapped to positions through ``obs.cell_pos``; cells holding no position are ignored).
H2O's "recent window" is not part of the score: it is the engine's ``n_recent`` protection.

Signal read: the attention matrix (``kq_soft_max`` of each layer) read back by the native shim. Flash
attention never materialises it, so this policy requires flash attention off (``needs_attention``); the
session refuses it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._attn import per_position
from .base import Observation, Policy, PositionScores


@dataclass
class H2OPolicy(Policy):
    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = True

    def __post_init__(self):
        self._scores = PositionScores()
        super().__post_init__()

    def reset(self) -> None:
        self._scores.reset()

    def observe(self, obs: Observation) -> None:
        pos, vals = per_position(obs, "attn_received", "H2OPolicy")
        if len(pos):
            self._scores.add(pos, vals)

    def score(self, positions: np.ndarray) -> np.ndarray:
        return np.array(self._scores.get(positions), dtype=np.float64)
