"""The scorer contract shared by every eviction policy (kvpress-style: one small scorer per module).

A policy declares which signals it needs (``layers`` for the residual-stream change g, ``key_layers`` for
the keys after RoPE, ``needs_attention`` for the attention matrix, which requires flash attention off). The
session captures exactly those and hands them to ``observe`` once per decode, in order. ``score`` rates live
positions (higher = keep). A policy never chooses evictions itself: the engine passes its scores through the
one selection step (:func:`epikv_local.selection.select_evictions`) with the protection mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Observation:
    """What one decode of T new tokens produced. Shapes: T new tokens, C KV cells.

    positions: (T,) int64 positions of the new tokens.
    g: (T, len(layers)) float64 residual-stream change (NaN for a sequence's first token), or None.
    keys: (T, len(key_layers), d_k) float32 keys after RoPE (d_k = n_head_kv * head_dim), or None.
    cell_pos: (C,) int32 position held by each KV cell after the decode (-1: none), or None.
    attn_received: (C,) float32 attention the cells received from the T new queries (mean over captured
        layers and heads, so each query contributes 1), or None.
    attn_last: (C,) float32 attention from the newest query, same normalisation, or None.
    """

    positions: np.ndarray
    g: np.ndarray | None = None
    keys: np.ndarray | None = None
    cell_pos: np.ndarray | None = None
    attn_received: np.ndarray | None = None
    attn_last: np.ndarray | None = None


class Policy:
    """Base scorer. Subclasses set ``name`` and override ``score`` (and ``observe`` if they need signals)."""

    name = "base"
    evicts = True            # False: the engine never evicts (plain llama.cpp behaviour)
    needs_attention = False  # True: needs kq_soft_max, i.e. flash attention off

    def layers(self, n_layer: int) -> tuple[int, ...]:
        """Layers whose residual-stream change ``g`` this policy needs (empty: none)."""
        return ()

    def key_layers(self, n_layer: int) -> tuple[int, ...]:
        """Layers whose keys this policy needs (empty: none)."""
        return ()

    def attention_layers(self, n_layer: int) -> tuple[int, ...]:
        """Layers whose attention weights are read when ``needs_attention`` (default: all)."""
        return tuple(range(n_layer))

    def reset(self) -> None:
        """Forget everything (new sequence)."""

    def observe(self, obs: Observation) -> None:
        """New tokens were decoded; ``obs`` carries the signals this policy asked for."""

    def score(self, positions: np.ndarray) -> np.ndarray:
        """Scores (N,) float64 of the live ``positions`` (N,) int64; higher = keep."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"policy": self.name}


class PositionScores:
    """A growable float64 array indexed by position (NaN = never scored), for per-token scores."""

    def __init__(self, size: int = 1024):
        self.values = np.full(size, np.nan)

    def reset(self) -> None:
        self.values[:] = np.nan

    def ensure(self, top: int) -> None:
        if top > len(self.values):
            grown = np.full(max(top, 2 * len(self.values)), np.nan)
            grown[: len(self.values)] = self.values
            self.values = grown

    def set(self, positions: np.ndarray, values: np.ndarray) -> None:
        self.ensure(int(positions.max()) + 1)
        self.values[positions] = values

    def add(self, positions: np.ndarray, values: np.ndarray) -> None:
        self.ensure(int(positions.max()) + 1)
        cur = self.values[positions]
        self.values[positions] = np.where(np.isnan(cur), 0.0, cur) + values

    def get(self, positions: np.ndarray) -> np.ndarray:
        self.ensure(int(positions.max()) + 1 if len(positions) else 0)
        return self.values[positions]
