"""EPIKV eviction scores from per-layer hidden-state change norms (numpy only).

Definitions (see ``docs/scoring.md`` for the full write-up):

* Positions are token indices ``t = 0, 1, ...`` of one sequence, in processing
  order.
* ``g_l(t) = ||h_l(t) - h_l(t-1)||_2`` is the L2 norm of the change of layer
  ``l``'s output hidden state between consecutive tokens.  It is in units of
  the hidden-state L2 norm.  ``g_l(0)`` is NaN when there is no previous token.
* Each layer's ``g`` is normalised causally against the ``window`` values
  *before* ``t`` (``g[max(0, t - window) : t]``, excluding ``t`` itself):
  ``"zscore"`` (mean / population std), ``"lag"`` (median / MAD, our own
  robust definition) or ``"raw"`` (no normalisation, NaN -> 0).  Normalised
  values ``z`` are unitless (except for ``"raw"``).
* The score is ``s(t) = causal_moving_average(z_A - z_B, smooth)(t)`` where
  ``A`` is the "important" band layer and ``B`` the "expendable" band layer
  (or ``s = smooth(z_A)`` for the single-band ablation).  Higher score = keep;
  the lowest scores are evicted first (see :mod:`epikv_local.selection`).

This module imports numpy only (and the package's exception classes), never llama_cpp or native code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import ConfigError

__all__ = [
    "NORMALIZATIONS",
    "MAD_SCALE",
    "ScoringConfig",
    "diff_norms",
    "rolling_zscore",
    "lag_normalize",
    "causal_moving_average",
    "normalize",
    "epikv_scores",
    "StreamingScorer",
]

NORMALIZATIONS = ("zscore", "lag", "raw")
#: Scale that makes the MAD a consistent estimator of the std for normal data.
MAD_SCALE = 1.4826
# Rows of the (rows, window) matrix materialised at once by the batch kernels.
_BLOCK = 4096


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
        x, (bool, np.bool_)
    )


def _check_window_params(window, min_history, eps, z_clip) -> None:
    if not _is_int(window) or window < 2:
        raise ConfigError(f"window must be an int >= 2, got {window!r}")
    if not _is_int(min_history) or min_history < 2 or min_history > window:
        raise ConfigError(
            f"min_history must be an int with 2 <= min_history <= window ({window}), "
            f"got {min_history!r}"
        )
    if not _is_real(eps) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError(f"eps must be a finite number > 0, got {eps!r}")
    if not _is_real(z_clip) or math.isnan(z_clip) or z_clip <= 0:
        raise ConfigError(f"z_clip must be a number > 0, got {z_clip!r}")


@dataclass(frozen=True)
class ScoringConfig:
    """Parameters of the EPIKV score.

    layer_a: "important" band layer index, expressed for a ``ref_depth``-layer model.
    layer_b: "expendable" band layer index (same convention), or None for the
        single-band ablation (score = smoothed z_A).
    ref_depth: number of layers of the model ``layer_a``/``layer_b`` refer to.
    window: trailing window length W in tokens; the reference set for token t is
        the W values before t (t excluded).
    min_history: fewer valid (non-NaN) reference values than this -> z(t) = 0.
    smooth: length of the causal moving average applied to the score (1 = none).
    eps: added to the scale (std or scaled MAD) to avoid division by zero.
    z_clip: normalised values are clipped to [-z_clip, z_clip].
    normalization: "zscore", "lag" (robust median/MAD) or "raw".
    """

    layer_a: int = 10
    layer_b: int | None = 21
    ref_depth: int = 32
    window: int = 128
    min_history: int = 8
    smooth: int = 4
    eps: float = 1e-6
    z_clip: float = 10.0
    normalization: str = "zscore"

    def __post_init__(self) -> None:
        if not _is_int(self.layer_a) or self.layer_a < 0:
            raise ConfigError(f"layer_a must be an int >= 0, got {self.layer_a!r}")
        if self.layer_b is not None:
            if not _is_int(self.layer_b) or self.layer_b < 0:
                raise ConfigError(
                    f"layer_b must be None or an int >= 0, got {self.layer_b!r}"
                )
            if self.layer_b == self.layer_a:
                raise ConfigError(
                    f"layer_b must differ from layer_a, got layer_b={self.layer_b!r}"
                )
        if not _is_int(self.ref_depth) or self.ref_depth < 1:
            raise ConfigError(f"ref_depth must be an int >= 1, got {self.ref_depth!r}")
        _check_window_params(self.window, self.min_history, self.eps, self.z_clip)
        if not _is_int(self.smooth) or self.smooth < 1:
            raise ConfigError(f"smooth must be an int >= 1, got {self.smooth!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(
                f"normalization must be one of {NORMALIZATIONS}, "
                f"got {self.normalization!r}"
            )

    def layers_for_depth(self, n_layer: int) -> tuple[int, ...]:
        """Map layer_a/layer_b from ``ref_depth`` to a model with ``n_layer`` layers.

        ``mapped = floor(l * n_layer / ref_depth + 0.5)``, clamped to
        ``[0, n_layer - 2]`` (the last layer is unusable: llama.cpp keeps only the
        output rows there).  32 -> (10, 21); 30 -> (9, 20); 24 -> (8, 16).
        Returns ``(a,)`` for single-band, ``(a, b)`` otherwise.  Raises
        ValueError when ``n_layer < 2`` or when the two mapped layers collide.
        """
        if not _is_int(n_layer) or n_layer < 2:
            raise ConfigError(f"n_layer must be an int >= 2, got {n_layer!r}")

        def _map(layer: int) -> int:
            mapped = int(math.floor(layer * n_layer / self.ref_depth + 0.5))
            return min(max(mapped, 0), n_layer - 2)

        a = _map(self.layer_a)
        if self.layer_b is None:
            return (a,)
        b = _map(self.layer_b)
        if a == b:
            raise ConfigError(
                f"layers collide for n_layer={n_layer}: layer_a={self.layer_a} and "
                f"layer_b={self.layer_b} both map to layer {a}"
            )
        return (a, b)


def diff_norms(h: np.ndarray, prev: np.ndarray | None) -> np.ndarray:
    """L2 norms of consecutive hidden-state differences.

    h: (T, d) hidden states of T consecutive tokens (any float dtype).
    prev: (d,) hidden state of the token just before ``h[0]``, or None.
    Returns (T,) float64 ``g`` (units of the hidden-state L2 norm):
    ``g[0] = ||h[0] - prev||`` (NaN when prev is None), ``g[i] = ||h[i] - h[i-1]||``.
    """
    h = np.asarray(h)
    if h.ndim != 2:
        raise ConfigError(f"h must have shape (T, d), got shape {h.shape}")
    T, d = h.shape
    h64 = h.astype(np.float64, copy=False)
    out = np.empty(T, dtype=np.float64)
    if T == 0:
        return out
    if prev is None:
        out[0] = np.nan
    else:
        prev = np.asarray(prev)
        if prev.shape != (d,):
            raise ConfigError(f"prev must have shape ({d},) to match h, got {prev.shape}")
        out[0] = np.linalg.norm(h64[0] - prev.astype(np.float64, copy=False))
    if T > 1:
        out[1:] = np.linalg.norm(np.diff(h64, axis=0), axis=1)
    return out


def _as_1d_float(g, name: str = "g") -> np.ndarray:
    g = np.asarray(g, dtype=np.float64)
    if g.ndim != 1:
        raise ConfigError(f"{name} must have shape (T,), got shape {g.shape}")
    return g


def _windows(ext: np.ndarray, window: int, b: int, nb: int) -> np.ndarray:
    """(nb, window) C-contiguous copy; row i = ext[b+i : b+i+window]."""
    return np.ascontiguousarray(
        np.lib.stride_tricks.sliding_window_view(ext[b:b + window + nb - 1], window))


def _zscore_rows(win: np.ndarray, x: np.ndarray, min_history: int, eps: float,
                 z_clip: float) -> np.ndarray:
    """z of x[i] against the reference row win[i] (NaN = missing).

    win: (n, W) C-contiguous float64, x: (n,).  Both the batch and the streaming
    paths reduce contiguous rows of length W with this function, so they
    perform the identical floating-point operations.
    """
    valid = ~np.isnan(win)
    cnt = valid.sum(axis=1)
    denom = np.maximum(cnt, 1)
    mu = np.where(valid, win, 0.0).sum(axis=1) / denom
    dev = np.where(valid, win - mu[:, None], 0.0)
    var = (dev * dev).sum(axis=1) / denom  # two-pass: never negative
    sigma = np.sqrt(np.maximum(var, 0.0))
    with np.errstate(invalid="ignore"):
        z = np.clip((x - mu) / (sigma + eps), -z_clip, z_clip)
    z[(cnt < min_history) | np.isnan(x)] = 0.0
    return z


def _median_sorted(s: np.ndarray) -> float:
    n = s.shape[0]
    m = n // 2
    return float(s[m]) if n % 2 else float((s[m - 1] + s[m]) * 0.5)


def _lag_rows(win: np.ndarray, x: np.ndarray, min_history: int, eps: float,
              z_clip: float) -> np.ndarray:
    """Robust (median / MAD) analogue of :func:`_zscore_rows`."""
    out = np.zeros(x.shape[0], dtype=np.float64)
    for i in range(x.shape[0]):
        xi = x[i]
        if xi != xi:  # NaN
            continue
        ref = win[i]
        ref = np.sort(ref[~np.isnan(ref)])
        if ref.shape[0] < min_history:
            continue
        med = _median_sorted(ref)
        mad = _median_sorted(np.sort(np.abs(ref - med)))
        out[i] = min(max((xi - med) / (mad * MAD_SCALE + eps), -z_clip), z_clip)
    return out


def _rows_kernel(normalization: str):
    return _zscore_rows if normalization == "zscore" else _lag_rows


def _windowed_ext(ext: np.ndarray, window: int, kernel, min_history: int,
                  eps: float, z_clip: float) -> np.ndarray:
    """Apply a rows kernel to ext[window:], each against the ``window`` entries
    of ext before it.  ext: (window + T,) float64, NaN = missing."""
    T = ext.shape[0] - window
    out = np.empty(T, dtype=np.float64)
    for b in range(0, T, _BLOCK):
        nb = min(_BLOCK, T - b)
        out[b:b + nb] = kernel(_windows(ext, window, b, nb),
                               ext[window + b:window + b + nb], min_history, eps, z_clip)
    return out


def _nan_prefix(g: np.ndarray, window: int) -> np.ndarray:
    return np.concatenate([np.full(window, np.nan), g])


def rolling_zscore(g: np.ndarray, window: int, min_history: int = 8,
                   eps: float = 1e-6, z_clip: float = 10.0) -> np.ndarray:
    """Causal rolling z-score of ``g`` (shape (T,)); returns (T,) unitless z.

    Reference set for token t: the valid (non-NaN) values of
    ``g[max(0, t - window) : t]`` (the ``window`` values before t, t excluded).
    ``z(t) = clip((g(t) - mean) / (std + eps), -z_clip, z_clip)`` with the
    population std (ddof=0).  ``z(t) = 0`` when ``g(t)`` is NaN or the reference
    set has fewer than ``min_history`` valid values.  Computed in float64 with a
    two-pass (mean, then squared deviations) variance per window, vectorised
    over blocks of tokens.
    """
    _check_window_params(window, min_history, eps, z_clip)
    g = _as_1d_float(g)
    return _windowed_ext(_nan_prefix(g, window), window, _zscore_rows, min_history,
                         float(eps), float(z_clip))


def lag_normalize(g: np.ndarray, window: int, min_history: int = 8,
                  eps: float = 1e-6, z_clip: float = 10.0) -> np.ndarray:
    """Lag-normalised ``g`` (our own definition: a robust rolling z-score).

    Same reference set as :func:`rolling_zscore` (the valid values of the
    ``window`` tokens before t).  With ``med`` its median and
    ``MAD = median(|ref - med|)``:
    ``z(t) = clip((g(t) - med) / (1.4826 * MAD + eps), -z_clip, z_clip)``;
    0 when ``g(t)`` is NaN or fewer than ``min_history`` valid reference values.
    Input (T,), output (T,) unitless.
    """
    _check_window_params(window, min_history, eps, z_clip)
    g = _as_1d_float(g)
    return _windowed_ext(_nan_prefix(g, window), window, _lag_rows, min_history,
                         float(eps), float(z_clip))


def _cma_ext(ext: np.ndarray, k: int, n_before: int) -> np.ndarray:
    """Causal moving average of ext[k-1:], given k-1 preceding entries.

    Only the last ``min(n_before, k-1)`` entries of the prefix are real; the
    others must be 0.  Shared by the batch and streaming paths.
    """
    T = ext.shape[0] - (k - 1)
    if k == 1:
        return ext.copy()
    out = np.empty(T, dtype=np.float64)
    for b in range(0, T, _BLOCK):
        nb = min(_BLOCK, T - b)
        win = _windows(ext, k, b, nb)
        cnt = np.minimum(np.arange(n_before + b + 1, n_before + b + nb + 1), k)
        out[b:b + nb] = win.sum(axis=1) / cnt
    return out


def causal_moving_average(x: np.ndarray, k: int) -> np.ndarray:
    """``y[t] = mean(x[max(0, t - k + 1) : t + 1])`` for x of shape (T,); k >= 1.

    Returns (T,) float64 in the units of x.  NaN in x propagates to the k
    outputs whose window contains it.
    """
    if not _is_int(k) or k < 1:
        raise ConfigError(f"k must be an int >= 1, got {k!r}")
    x = _as_1d_float(x, "x")
    ext = np.concatenate([np.zeros(k - 1), x])
    return _cma_ext(ext, k, 0)


def _normalize_ext(ext: np.ndarray, cfg: ScoringConfig) -> np.ndarray:
    if cfg.normalization != "raw":
        return _windowed_ext(ext, cfg.window, _rows_kernel(cfg.normalization),
                             cfg.min_history, float(cfg.eps), float(cfg.z_clip))
    x = ext[cfg.window:]
    return np.where(np.isnan(x), 0.0, x)


def normalize(g: np.ndarray, cfg: ScoringConfig) -> np.ndarray:
    """Normalise one layer's ``g`` (T,) according to ``cfg.normalization``.

    "zscore" -> :func:`rolling_zscore`, "lag" -> :func:`lag_normalize`,
    "raw" -> g with NaN replaced by 0.  Returns (T,) float64.
    """
    g = _as_1d_float(g)
    return _normalize_ext(_nan_prefix(g, cfg.window), cfg)


def _check_layers(cfg: ScoringConfig, layers: Sequence[int]) -> tuple[int, ...]:
    layers = tuple(int(l) for l in layers)
    expected = 1 if cfg.layer_b is None else 2
    if len(layers) != expected:
        raise ConfigError(
            f"layers must have {expected} entr{'y' if expected == 1 else 'ies'} "
            f"for this config (layer_b={cfg.layer_b!r}), got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"layers must be distinct, got {layers!r}")
    return layers


def epikv_scores(g_by_layer: Mapping[int, np.ndarray] | np.ndarray,
                 cfg: ScoringConfig, layers: Sequence[int]) -> np.ndarray:
    """Batch (offline) reference EPIKV scores for one sequence.

    g_by_layer: dict ``{layer: g (T,)}`` containing every entry of ``layers``,
        or an array (T, len(layers)) whose columns follow ``layers``
        (a (T,) array is accepted for single-band).
    layers: as returned by ``cfg.layers_for_depth(n_layer)``.
    Returns s (T,) = causal_moving_average(norm_a - norm_b, cfg.smooth)
    (norm_a alone for single-band).  Higher = keep.
    """
    layers = _check_layers(cfg, layers)
    if isinstance(g_by_layer, Mapping):
        missing = [l for l in layers if l not in g_by_layer]
        if missing:
            raise ConfigError(f"g_by_layer lacks layers {missing}")
        cols = [_as_1d_float(g_by_layer[l], f"g_by_layer[{l}]") for l in layers]
    else:
        arr = np.asarray(g_by_layer, dtype=np.float64)
        if arr.ndim == 1 and len(layers) == 1:
            arr = arr[:, None]
        if arr.ndim != 2 or arr.shape[1] != len(layers):
            raise ConfigError(
                f"g_by_layer array must have shape (T, {len(layers)}), got {arr.shape}")
        cols = [arr[:, j] for j in range(len(layers))]
    T = cols[0].shape[0]
    if any(c.shape[0] != T for c in cols):
        raise ConfigError(f"per-layer g lengths differ: {[c.shape[0] for c in cols]}")
    norm = [normalize(c, cfg) for c in cols]
    diff = norm[0] if len(norm) == 1 else norm[0] - norm[1]
    return _cma_ext(np.concatenate([np.zeros(cfg.smooth - 1), diff]), cfg.smooth, 0)


class StreamingScorer:
    """Incremental EPIKV scorer for one sequence, used during generation.

    State: the last ``window`` g values of each layer (a (n_layers, window)
    array in chronological order, NaN = none yet) and the last ``smooth - 1``
    unsmoothed scores, i.e. O(window + smooth); never the whole history.
    Feeding a sequence in any chunking gives the same scores as
    :func:`epikv_scores` on the whole sequence: both paths reduce the same
    contiguous reference rows with the same kernels.
    """

    def __init__(self, cfg: ScoringConfig, layers: Sequence[int]):
        self.cfg = cfg
        self.layers = _check_layers(cfg, layers)
        self._kernel = (None if cfg.normalization == "raw"
                        else _rows_kernel(cfg.normalization))
        self.reset()

    def reset(self) -> None:
        """Forget all history (start of a new sequence)."""
        self._buf = np.full((len(self.layers), self.cfg.window), np.nan)
        self._smooth_prefix = np.zeros(self.cfg.smooth - 1)
        self._n_seen = 0

    @property
    def n_seen(self) -> int:
        """Number of tokens processed since construction / the last reset."""
        return self._n_seen

    def _normalize_new(self, g_new: np.ndarray) -> np.ndarray:
        """(T, L) g -> (T, L) normalised values; advances the g buffers."""
        cfg = self.cfg
        T, L = g_new.shape
        if self._kernel is None:  # raw
            norm = np.where(np.isnan(g_new), 0.0, g_new)
        elif T == 1:
            # rows of self._buf are the (contiguous) reference windows
            norm = self._kernel(self._buf, g_new[0], cfg.min_history,
                                float(cfg.eps), float(cfg.z_clip))[None, :]
        else:
            norm = np.empty((T, L))
            for j in range(L):
                ext = np.concatenate([self._buf[j], g_new[:, j]])
                norm[:, j] = _windowed_ext(ext, cfg.window, self._kernel,
                                           cfg.min_history, float(cfg.eps),
                                           float(cfg.z_clip))
        W = cfg.window
        if T >= W:
            self._buf[:] = g_new[-W:].T
        else:
            self._buf[:, :W - T] = self._buf[:, T:].copy()
            self._buf[:, W - T:] = g_new.T
        return norm

    def update(self, g_new: np.ndarray) -> np.ndarray:
        """Score T newly processed tokens.

        g_new: (T, len(layers)) g values (columns in the order of ``layers``;
        NaN allowed, e.g. for the first token).  Returns (T,) float64 scores.
        """
        g_new = np.asarray(g_new, dtype=np.float64)
        L = len(self.layers)
        if g_new.ndim != 2 or g_new.shape[1] != L:
            raise ConfigError(f"g_new must have shape (T, {L}), got {g_new.shape}")
        T = g_new.shape[0]
        if T == 0:
            return np.empty(0, dtype=np.float64)
        norm = self._normalize_new(g_new)
        diff = norm[:, 0] if L == 1 else norm[:, 0] - norm[:, 1]
        k = self.cfg.smooth
        if k == 1:
            out = np.array(diff, dtype=np.float64)
        elif T == 1:  # same arithmetic as _cma_ext, without the window view
            ext = np.concatenate([self._smooth_prefix, diff])
            out = ext.reshape(1, k).sum(axis=1) / min(self._n_seen + 1, k)
            self._smooth_prefix = ext[1:]
        else:
            ext = np.concatenate([self._smooth_prefix, diff])
            out = _cma_ext(ext, k, self._n_seen)
            self._smooth_prefix = ext[-(k - 1):].copy()
        self._n_seen += T
        return out
