"""Undo llama.cpp's rotary position embedding (RoPE) on captured keys and queries (numpy only).

The patched build captures keys and queries *after* RoPE (what attention sees). TriAttention reasons about
them *before* RoPE, where they concentrate around fixed centres. RoPE rotates each pair of dimensions
``(x_a, x_b)`` of a head by ``theta_i(p) = p * freq_scale * freq_base^(-2i / rope_dims)``; in complex form
``c = x_a + i x_b`` becomes ``c * exp(i theta_i(p))``. Pairs: ``(2i, 2i + 1)`` for llama.cpp's NORM type,
``(i, i + rope_dims / 2)`` for NEOX. Dimensions beyond ``rope_dims`` are not rotated.

Exact for plain RoPE with linear frequency scaling. YaRN's attention factor and ramp, M-RoPE and the vision
types are not modelled: :func:`check_invertible` refuses ``rope_type`` "other" and "none".
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .base import ModelShape


def check_invertible(shape: ModelShape, who: str) -> None:
    """ConfigError unless this model's RoPE is one that :func:`to_complex` can undo."""
    if shape.rope_type not in ("norm", "neox"):
        raise ConfigError(f"{who}: needs plain RoPE (llama.cpp NORM or NEOX) to undo it, this model's is "
                          f"{shape.rope_type!r}")
    if not shape.head_dim:
        raise ConfigError(f"{who}: needs the model's head size (n_embd and n_head)")


def frequencies(shape: ModelShape) -> np.ndarray:
    """(F,) float64 angular frequency of each rotated pair, radians per position (F = rope_dims / 2)."""
    dims = shape.rope_dims or shape.head_dim
    i = np.arange(dims // 2, dtype=np.float64)
    return shape.rope_freq_scale * shape.rope_freq_base ** (-2.0 * i / dims)


def to_complex(rows: np.ndarray, positions: np.ndarray, shape: ModelShape, n_heads: int) -> np.ndarray:
    """Rows after RoPE -> the rotated pairs before RoPE, as complex numbers.

    rows: (T, ..., n_heads * head_dim) float (any leading axes after T, e.g. layers);
    positions: (T,) int positions the rows were rotated with.
    Returns (T, ..., n_heads, F) complex128 (F = rope_dims / 2 pairs; unrotated dimensions are dropped).
    """
    x = np.asarray(rows, dtype=np.float64)
    hd = shape.head_dim
    x = x.reshape(x.shape[:-1] + (n_heads, hd))
    dims = shape.rope_dims or hd
    if shape.rope_type == "norm":
        c = x[..., 0:dims:2] + 1j * x[..., 1:dims:2]
    else:
        c = x[..., : dims // 2] + 1j * x[..., dims // 2: dims]
    theta = np.asarray(positions, dtype=np.float64)[:, None] * frequencies(shape)[None, :]   # (T, F)
    theta = theta.reshape((theta.shape[0],) + (1,) * (c.ndim - 2) + (theta.shape[1],))
    return c * np.exp(-1j * theta)
