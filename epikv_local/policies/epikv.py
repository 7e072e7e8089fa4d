"""EPIKV: attention-free eviction by the rolling two-band z-score of the residual-stream change.

Each decoded token t gets, once, the score s(t) = smooth(z_A(t) - z_B(t)) computed causally by
:class:`epikv_local.scoring.StreamingScorer` from g of layers A and B (mapped to the model's depth by
:meth:`ScoringConfig.layers_for_depth`). Formulas: docs/scoring.md.
"""

from __future__ import annotations

import numpy as np

from ..scoring import ScoringConfig, StreamingScorer
from .base import Policy


class EpikvPolicy(Policy):
    name = "epikv"

    def __init__(self, cfg: ScoringConfig | None = None):
        self.cfg = cfg or ScoringConfig()
        self._layers: tuple[int, ...] | None = None
        self._scorer: StreamingScorer | None = None
        self._scores = np.full(1024, np.nan)

    def layers(self, n_layer: int) -> tuple[int, ...]:
        layers = self.cfg.layers_for_depth(n_layer)
        if self._layers != layers:
            self._layers = layers
            self._scorer = StreamingScorer(self.cfg, layers)
        return layers

    def reset(self) -> None:
        if self._scorer is not None:
            self._scorer.reset()
        self._scores[:] = np.nan

    def observe(self, positions: np.ndarray, g: np.ndarray | None) -> None:
        if self._scorer is None or g is None:
            raise RuntimeError("EpikvPolicy.observe before layers(): the engine must set up capture first")
        s = self._scorer.update(g)
        top = int(positions.max()) + 1
        if top > len(self._scores):
            grown = np.full(max(top, 2 * len(self._scores)), np.nan)
            grown[: len(self._scores)] = self._scores
            self._scores = grown
        self._scores[positions] = s

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._scores[positions]

    def describe(self) -> dict:
        c = self.cfg
        return {"policy": self.name, "layers": list(self._layers or ()), "window": c.window,
                "smooth": c.smooth, "normalization": c.normalization}
