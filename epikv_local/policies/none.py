"""No eviction: plain llama.cpp behaviour, the cache simply fills up. Signal read: none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import Policy


@dataclass
class NoEviction(Policy):
    name: ClassVar[str] = "none"
    evicts: ClassVar[bool] = False

    def score(self, positions: np.ndarray) -> np.ndarray:
        return np.zeros(len(positions))
