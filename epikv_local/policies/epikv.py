"""EPIKV: attention-free eviction by the rolling two-band z-score of the residual-stream change.

Each decoded token t gets, once, the score s(t) = smooth(z_A(t) - z_B(t)) computed causally by
:class:`epikv_local.scoring.StreamingScorer` from g of layers A and B (mapped to the model's depth by
:meth:`ScoringConfig.layers_for_depth`). Formulas: docs/scoring.md.

Signal read: g, the L2 norm of the change of a layer's output hidden state between consecutive tokens,
captured by the patched llama.cpp build for the band layers only. It needs neither the keys nor the attention
matrix, so flash attention stays on and the capture costs one small copy per band layer and decode.

Registered variants (factories below, one ``name`` each): ``epikv`` (rolling z-score, two bands),
``epikv_lag`` (robust median/MAD normalisation), ``epikv_raw`` (no normalisation), ``epikv_single``
(band A only, ``layer_b=None``). The factories force their variant's setting onto any ``cfg`` passed in.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..scoring import ScoringConfig, StreamingScorer
from .base import Observation, Policy, PositionScores


class EpikvPolicy(Policy):
    name = "epikv"

    def __init__(self, cfg: ScoringConfig | None = None, name: str = "epikv"):
        self.name = name
        self.cfg = cfg or ScoringConfig()
        self._layers: tuple[int, ...] | None = None
        self._scorer: StreamingScorer | None = None
        self._scores = PositionScores()

    def layers(self, n_layer: int) -> tuple[int, ...]:
        layers = self.cfg.layers_for_depth(n_layer)
        if self._layers != layers:
            self._layers = layers
            self._scorer = StreamingScorer(self.cfg, layers)
        return layers

    def reset(self) -> None:
        if self._scorer is not None:
            self._scorer.reset()
        self._scores.reset()

    def observe(self, obs: Observation) -> None:
        if self._scorer is None or obs.g is None:
            raise RuntimeError("EpikvPolicy.observe without g: the session must capture layers() first")
        self._scores.set(obs.positions, self._scorer.update(obs.g))

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._scores.get(positions)

    def describe(self) -> dict:
        c = self.cfg
        return {"policy": self.name, "layers": list(self._layers or ()), "window": c.window,
                "smooth": c.smooth, "normalization": c.normalization}


def epikv_lag(cfg: ScoringConfig | None = None) -> EpikvPolicy:
    """EPIKV with the robust median/MAD ("lag") normalisation."""
    return EpikvPolicy(replace(cfg or ScoringConfig(), normalization="lag"), name="epikv_lag")


def epikv_raw(cfg: ScoringConfig | None = None) -> EpikvPolicy:
    """EPIKV on raw g (no normalisation)."""
    return EpikvPolicy(replace(cfg or ScoringConfig(), normalization="raw"), name="epikv_raw")


def epikv_single(cfg: ScoringConfig | None = None) -> EpikvPolicy:
    """Single-band ablation: score = smoothed z of band A only."""
    return EpikvPolicy(replace(cfg or ScoringConfig(), layer_b=None), name="epikv_single")
