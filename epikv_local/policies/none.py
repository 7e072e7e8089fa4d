"""No eviction: plain llama.cpp behaviour, the cache simply fills up. Signal read: none."""

from __future__ import annotations

import numpy as np

from .base import Policy


class NoEviction(Policy):
    name = "none"
    evicts = False

    def score(self, positions: np.ndarray) -> np.ndarray:
        return np.zeros(len(positions))
