"""EPIKV-mix: the residual-stream score combined with key-based signals, weights chosen per model.

What the evidence showed EPIKV lacks (docs/benchmarks.md): on SmolLM2 the residual-stream score alone is
behind StreamingLLM, and on other small models a key-based score (KeyDiff) is best at tight budgets. So this
variant rates each live position by a weighted sum of *ranks*, one per component signal:

    score(p) = sum_c w_c * rank_c(p) / (N - 1)        (rank 0 = the component's lowest score, N live positions)

components: ``epikv`` (the two-band residual-stream z-score, :class:`EpikvPolicy`), ``keydiff`` (dissimilarity
to the mean key: a redundancy penalty, :class:`KeyDiffPolicy`) and ``triattention`` (expected future
attention from pre-RoPE query statistics, :class:`TriAttentionPolicy`). Ranks make the scales comparable; a
component whose score is missing (NaN) ranks lowest. Weights 0 switch a component off (nothing of it is
captured). ``epikv-local calibrate`` chooses the weights, EPIKV's layers and window, and the recent share per
model on the dev traces (docs/calibration.md, step 3); the defaults (1, 1, 0) are an even mix of EPIKV and
KeyDiff, not a tuned setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import ConfigError
from .base import ModelShape, Observation, Policy, Signals, check_float, rank01
from .epikv import EpikvPolicy
from .keydiff import KeyDiffPolicy
from .triattention import TriAttentionPolicy


@dataclass
class EpikvMixPolicy(Policy):
    name: ClassVar[str] = "epikv_mix"
    calibratable: ClassVar[bool] = True

    w_epikv: float = 1.0
    w_keydiff: float = 1.0
    w_triattention: float = 0.0
    layers: tuple[int, ...] | None = None
    window: int = 128
    n_key_layers: int | None = 4
    query_stats: str | None = None

    def __post_init__(self):
        for w in ("w_epikv", "w_keydiff", "w_triattention"):
            check_float("epikv_mix", w, getattr(self, w), 0.0)
        if self.w_epikv + self.w_keydiff + self.w_triattention <= 0:
            raise ConfigError("epikv_mix: at least one weight must be > 0")
        parts: dict[str, Policy] = {}
        if self.w_epikv > 0:
            parts["epikv"] = EpikvPolicy(layers=self.layers, window=self.window)
        if self.w_keydiff > 0:
            parts["keydiff"] = KeyDiffPolicy(n_key_layers=self.n_key_layers)
        if self.w_triattention > 0:
            parts["triattention"] = TriAttentionPolicy(n_key_layers=self.n_key_layers, query_stats=self.query_stats)
        self._parts = parts
        self._weights = {"epikv": self.w_epikv, "keydiff": self.w_keydiff, "triattention": self.w_triattention}
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        sigs = {k: p.bind(shape) for k, p in self._parts.items()}
        # keydiff and triattention read the same evenly spaced key layers (same n_key_layers)
        key_layers = next((s.key_layers for s in sigs.values() if s.key_layers), ())
        query_layers = next((s.query_layers for s in sigs.values() if s.query_layers), ())
        layers = sigs["epikv"].g_layers if "epikv" in sigs else ()
        return Signals(g_layers=layers, key_layers=key_layers, query_layers=query_layers)

    def reset(self) -> None:
        for p in self._parts.values():
            p.reset()

    def observe(self, obs: Observation) -> None:
        for p in self._parts.values():
            p.observe(obs)

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        out = np.zeros(len(positions))
        for k, p in self._parts.items():
            out += self._weights[k] * rank01(p.score(positions))
        return out
