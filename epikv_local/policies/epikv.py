"""EPIKV: attention-free eviction by the rolling two-band z-score of the residual-stream change.

Each decoded token t gets, once, the score s(t) = smooth(z_A(t) - z_B(t)) computed causally by
:class:`epikv_local.policies.scoring.StreamingScorer` from g of layers A and B. Formulas: docs/scoring.md.

Signal read: g, the L2 norm of the change of a layer's output hidden state between consecutive tokens,
captured by the patched llama.cpp build for the band layers only. It needs neither the keys nor the attention
matrix, so flash attention stays on and the capture costs one small copy per band layer and decode.

Settings (dataclass fields): ``layers`` are this model's own layer indices, one (single band: s = smooth(z_A))
or two (A, B); when None, ``ref_layers`` of a ``ref_depth``-layer model (the paper's 10, 21 of 32) are mapped
by relative depth (:meth:`ScoringConfig.layers_for_depth`). ``span`` (positions, default 0): a token scores the
maximum of the stored scores within ``span`` positions either side, evicted neighbours included. Why: the
causal smoothing puts a score's peak a few tokens after the text that raised it (on the dev passkey contexts the
code's last digits ranked in the top 5 % and its first digits near the median), so without it the tail of a fact
survives and its head goes. The registered variants (``epikv_lag``, ``epikv_raw``, ``epikv_single``,
``epikv_span``) are named configurations of this one class (see the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import ConfigError
from .base import ModelShape, Observation, Policy, PositionScores, Signals, check_int
from .scoring import ScoringConfig, StreamingScorer


@dataclass
class EpikvPolicy(Policy):
    name: ClassVar[str] = "epikv"
    calibratable: ClassVar[bool] = True

    layers: tuple[int, ...] | None = None
    window: int = 128
    smooth: int = 4
    normalization: str = "zscore"
    min_history: int = 8
    ref_layers: tuple[int, ...] = (10, 21)
    ref_depth: int = 32
    span: int = 0

    def __post_init__(self):
        if self.layers is not None:
            self.layers = self._check_layers("layers", self.layers)
        self.ref_layers = self._check_layers("ref_layers", self.ref_layers)
        self._config(self.ref_layers, self.ref_depth)  # validates window, smooth, normalization, min_history
        check_int("epikv", "span", self.span, 0, 16)
        self._scorer: StreamingScorer | None = None
        self._scores = PositionScores()
        super().__post_init__()

    def _check_layers(self, what: str, layers) -> tuple[int, ...]:
        try:
            t = tuple(int(x) for x in layers)
        except (TypeError, ValueError):
            raise ConfigError(f"epikv: {what} must be one or two layer indices, got {layers!r}") from None
        if not 1 <= len(t) <= 2 or len(set(t)) != len(t) or min(t) < 0:
            raise ConfigError(f"epikv: {what} must be one or two distinct layer indices >= 0, got {layers!r}")
        return t

    def _config(self, layers: tuple[int, ...], depth: int) -> ScoringConfig:
        return ScoringConfig(layer_a=layers[0], layer_b=layers[1] if len(layers) > 1 else None, ref_depth=depth,
                             window=self.window, smooth=self.smooth, normalization=self.normalization,
                             min_history=min(self.min_history, self.window))

    def scoring_config(self, n_layer: int) -> ScoringConfig:
        """The scoring settings on an ``n_layer``-layer model, layers as that model's own indices."""
        layers = self.layers or self._config(self.ref_layers, self.ref_depth).layers_for_depth(n_layer)
        return self._config(layers, n_layer)

    def signals(self, shape: ModelShape) -> Signals:
        cfg = self.scoring_config(shape.n_layer)
        layers = (cfg.layer_a,) if cfg.layer_b is None else (cfg.layer_a, cfg.layer_b)
        self._scorer = StreamingScorer(cfg, layers)
        return Signals(g_layers=layers)

    def reset(self) -> None:
        if self._scorer is not None:
            self._scorer.reset()
        self._scores.reset()

    def observe(self, obs: Observation) -> None:
        if self._scorer is None or obs.g is None:
            raise RuntimeError("EpikvPolicy.observe without g: bind the policy and capture its layers first")
        self._scores.set(obs.positions, self._scorer.update(obs.g))

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        scores = self._scores.get(positions)
        for offset in (o for d in range(1, self.span + 1) for o in (-d, d)):
            q = positions + offset
            ok = q >= 0
            near = np.full(len(positions), np.nan)
            near[ok] = self._scores.get(q[ok])
            scores = np.fmax(scores, near)  # NaN (never decoded) neighbours lift nothing
        return scores
