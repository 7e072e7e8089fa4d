"""K-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

Scores: ``-mean over key layers of ||k_l(p)||_2`` -- keys with a *small* L2 norm attract the most attention,
so low norm = keep. Computed once per token when it is decoded.

Signal read: the keys after RoPE, one row (n_head_kv * head_dim floats) per token and key layer, captured by
the patched llama.cpp build when the token is processed (exactly what is written to the KV cache). Keys are
the paper's signal and cost one small copy per layer with the logits; no attention matrix is needed, so
flash attention stays on.

Head handling: policies do not know the model. With ``n_head_kv=None`` (default) the norm is the L2 norm of
the whole row (all KV heads of the layer together, i.e. sqrt of the sum of squared head norms); with
``n_head_kv`` given, the row is split into that many heads and the per-head norms are averaged, as in the
paper. Both rank a uniformly smaller key above a larger one.

Key layers: all layers by default (``n_key_layers=None``); an integer picks that many evenly spaced layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import ConfigError
from ._keys import KeyLayers, obs_keys
from .base import Observation, Policy, PositionScores


@dataclass
class KNormPolicy(KeyLayers, Policy):
    name: ClassVar[str] = "knorm"
    n_key_layers: int | None = None
    n_head_kv: int | None = None

    def __post_init__(self):
        self.check_key_layers()
        if self.n_head_kv is not None and (isinstance(self.n_head_kv, bool) or not isinstance(self.n_head_kv, int)
                                           or self.n_head_kv < 1):
            raise ConfigError(f"knorm: n_head_kv must be None or an integer >= 1, got {self.n_head_kv!r}")
        self._scores = PositionScores()
        super().__post_init__()

    def reset(self) -> None:
        self._scores.reset()

    def observe(self, obs: Observation) -> None:
        k = obs_keys(obs, "KNormPolicy")
        if not len(k):
            return
        if self.n_head_kv:
            T, L, d = k.shape
            if d % self.n_head_kv:
                raise ConfigError(f"knorm: a key row of {d} floats does not split into {self.n_head_kv} heads")
            norms = np.linalg.norm(k.reshape(T, L, self.n_head_kv, d // self.n_head_kv), axis=-1).mean(axis=(1, 2))
        else:
            norms = np.linalg.norm(k, axis=-1).mean(axis=1)
        self._scores.set(obs.positions, -norms)

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._scores.get(positions)
