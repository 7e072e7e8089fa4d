"""Helpers shared by the key-based policies (knorm, keydiff, lagkv)."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .base import ModelShape, Signals


def spaced_layers(n_layer: int, n: int | None) -> tuple[int, ...]:
    """``n`` layers evenly spaced over ``0..n_layer-1`` (first and last included); None or >= n_layer: all."""
    if n is None or n >= n_layer:
        return tuple(range(n_layer))
    if n < 1:
        raise ConfigError(f"number of key layers must be >= 1, got {n}")
    if n == 1:
        return (n_layer // 2,)
    return tuple(sorted({int(round(i * (n_layer - 1) / (n - 1))) for i in range(n)}))


class KeyLayers:
    """Mixin of the key-based policies: the keys of ``n_key_layers`` evenly spaced layers (None: all)."""

    n_key_layers: int | None

    def check_key_layers(self) -> None:
        n = self.n_key_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"{self.name}: n_key_layers must be None (all layers) or an integer >= 1, got {n!r}")

    def signals(self, shape: ModelShape) -> Signals:
        return Signals(key_layers=spaced_layers(shape.n_layer, self.n_key_layers))


def obs_keys(obs, who: str) -> np.ndarray:
    """obs.keys as (T, L, d_k) float64; RuntimeError when the session captured none (an engine bug)."""
    if obs.keys is None:
        raise RuntimeError(f"{who}.observe without keys: the session must capture the bound key layers")
    k = np.asarray(obs.keys, dtype=np.float64)
    if k.ndim != 3:
        raise ValueError(f"keys must have shape (T, n_key_layers, d_k), got {k.shape}")
    return k
