"""StreamingLLM (Xiao et al., 2023): keep the attention sinks and the most recent tokens.

As a scorer: score = position, so the selection step evicts the oldest unprotected tokens first; the sinks
are protected by the engine's ``n_sink``. Signal read: none (positions only), so flash attention stays on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import Policy


@dataclass
class StreamingLLM(Policy):
    name: ClassVar[str] = "streaming"

    def score(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.float64)
