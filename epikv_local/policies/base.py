"""The scorer contract shared by every eviction policy.

A policy sees every decoded token once (``observe``), in order, and scores live positions on demand
(``score``: higher = keep). It never chooses evictions itself: the engine passes its scores through the one
selection step (:func:`epikv_local.selection.select_evictions`) with the protection mask.
"""

from __future__ import annotations

import numpy as np


class Policy:
    """Base scorer. Subclasses set ``name`` and override ``score`` (and ``observe`` if they need signals)."""

    name = "base"
    evicts = True  # False: the engine never evicts (plain llama.cpp behaviour)

    def layers(self, n_layer: int) -> tuple[int, ...]:
        """Layers whose residual-stream change ``g`` this policy needs (empty: no capture)."""
        return ()

    def reset(self) -> None:
        """Forget everything (new sequence)."""

    def observe(self, positions: np.ndarray, g: np.ndarray | None) -> None:
        """New tokens at ``positions`` (T,) int64 were decoded; g is (T, len(layers)) float64 or None."""

    def score(self, positions: np.ndarray) -> np.ndarray:
        """Scores (N,) float64 of the live ``positions`` (N,) int64; higher = keep."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"policy": self.name}
