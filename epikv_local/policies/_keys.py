"""Helpers shared by the key-based policies (knorm, keydiff, lagkv)."""

from __future__ import annotations

from typing import Callable

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


class PositionRows:
    """Per-position rows (keys, unit keys, pre-RoPE keys...) of the live positions, ascending by position.

    ``pos``: (N,) int64; ``rows``: (N, ...) array or None before the first ``append``. A position written again
    keeps its last rows. :meth:`keep_live` drops the rows of evicted positions (they never come back), so the
    memory is bounded by the budget plus the tokens decoded since the last eviction.
    """

    def __init__(self) -> None:
        self.pos = np.empty(0, dtype=np.int64)
        self.rows: np.ndarray | None = None

    def append(self, positions: np.ndarray, rows: np.ndarray) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        if self.rows is None:
            self.pos, self.rows = positions.copy(), rows
        else:
            self.pos = np.concatenate([self.pos, positions])
            self.rows = np.concatenate([self.rows, rows])
        if len(self.pos) > 1 and np.any(np.diff(self.pos) <= 0):  # keep sorted, unique (last write wins)
            last = len(self.pos) - 1 - np.unique(self.pos[::-1], return_index=True)[1]
            self.pos, self.rows = self.pos[last], self.rows[last]

    def keep_live(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drop the rows of positions not in ``positions`` (M,); return (index into the kept rows of each of
        ``positions``, found mask), both (M,)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.rows is None:
            return np.zeros(len(positions), dtype=np.int64), np.zeros(len(positions), dtype=bool)
        keep = np.isin(self.pos, positions)
        self.pos, self.rows = self.pos[keep], self.rows[keep]
        if not len(self.pos):
            return np.zeros(len(positions), dtype=np.int64), np.zeros(len(positions), dtype=bool)
        idx = np.minimum(np.searchsorted(self.pos, positions), len(self.pos) - 1)
        return idx, self.pos[idx] == positions

    def scores(self, positions: np.ndarray, per_row: Callable[[], np.ndarray]) -> np.ndarray:
        """Scores (M,) float64 of ``positions`` (M,): after :meth:`keep_live`, ``per_row()`` rates the kept rows
        ((N,) in row order); positions without rows score NaN (lowest)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.full(len(positions), np.nan)
        idx, found = self.keep_live(positions)
        if found.any():
            out[found] = per_row()[idx[found]]
        return out
