"""Helpers shared by the key-based policies (knorm, keydiff, lagkv)."""

from __future__ import annotations

import numpy as np


def spaced_layers(n_layer: int, n: int | None) -> tuple[int, ...]:
    """``n`` layers evenly spaced over ``0..n_layer-1`` (first and last included); None or >= n_layer: all."""
    if n is None or n >= n_layer:
        return tuple(range(n_layer))
    if n < 1:
        raise ValueError(f"number of key layers must be >= 1, got {n}")
    if n == 1:
        return (n_layer // 2,)
    return tuple(sorted({int(round(i * (n_layer - 1) / (n - 1))) for i in range(n)}))


def obs_keys(obs, who: str) -> np.ndarray:
    """obs.keys as (T, L, d_k) float64; RuntimeError when the session captured none."""
    if obs.keys is None:
        raise RuntimeError(f"{who}.observe without keys: the session must capture key_layers() first")
    k = np.asarray(obs.keys, dtype=np.float64)
    if k.ndim != 3:
        raise ValueError(f"keys must have shape (T, n_key_layers, d_k), got {k.shape}")
    return k
