"""Random eviction: a sanity baseline every real policy must beat.

Scores: each position gets one uniform [0, 1) draw when it is first observed (a seeded ``numpy`` Generator),
so the ranking is fixed for the token's lifetime and deterministic for a given seed and token order.
Signal read: none (only the positions of each decode), hence no capture cost at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import Observation, Policy, PositionScores, check_int


@dataclass
class RandomPolicy(Policy):
    name: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self):
        check_int("random", "seed", self.seed, 0, 2**63 - 1)
        self._scores = PositionScores()
        super().__post_init__()

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._scores.reset()

    def observe(self, obs: Observation) -> None:
        if len(obs.positions):
            self._scores.set(obs.positions, self._rng.random(len(obs.positions)))

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._scores.get(positions)
