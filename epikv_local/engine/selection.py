"""The single eviction-selection step shared by all eviction policies (numpy only).

Every policy produces one score per live KV position of a sequence (higher =
keep).  :func:`select_evictions` picks the unprotected positions with the
lowest scores; :func:`protected_mask` builds the usual protection mask
(attention sinks, recent window, prompt).
"""

from __future__ import annotations

import numpy as np

__all__ = ["select_evictions", "protected_mask"]


def _positions_1d(positions) -> np.ndarray:
    pos = np.asarray(positions)
    if pos.ndim != 1:
        raise ValueError(f"positions must have shape (N,), got shape {pos.shape}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"positions must be integers, got dtype {pos.dtype}")
    return pos.astype(np.int64, copy=False)


def select_evictions(positions: np.ndarray, scores: np.ndarray,
                     protected: np.ndarray, n_evict: int) -> np.ndarray:
    """Choose which positions to evict.

    positions: (N,) int live token positions of one sequence (distinct).
    scores: (N,) float, higher = keep.  NaN counts as the lowest score.
    protected: (N,) bool; protected positions are never chosen.
    n_evict: number of positions wanted (>= 0).

    Returns the sorted (ascending) int64 array of the
    ``min(n_evict, n_unprotected)`` unprotected positions with the lowest
    scores; NaN scores first, and ties broken by older (smaller) position first.
    """
    pos = _positions_1d(positions)
    sc = np.asarray(scores, dtype=np.float64)
    prot = np.asarray(protected)
    if sc.ndim != 1 or prot.ndim != 1:
        raise ValueError(
            f"scores and protected must be 1-D, got shapes {sc.shape} and {prot.shape}")
    if not (pos.shape[0] == sc.shape[0] == prot.shape[0]):
        raise ValueError(
            f"length mismatch: positions {pos.shape[0]}, scores {sc.shape[0]}, "
            f"protected {prot.shape[0]}")
    if prot.size and prot.dtype != np.bool_:
        raise ValueError(f"protected must be a bool array, got dtype {prot.dtype}")
    prot = prot.astype(bool, copy=False)
    if isinstance(n_evict, (bool, np.bool_)) or not isinstance(n_evict, (int, np.integer)):
        raise ValueError(f"n_evict must be an int, got {n_evict!r}")
    if n_evict < 0:
        raise ValueError(f"n_evict must be >= 0, got {n_evict}")
    ascending = bool(np.all(pos[1:] > pos[:-1]))  # the engine's case: O(N), and distinct by construction
    if not ascending:
        order = np.argsort(pos, kind="stable")
        pos, sc, prot = pos[order], sc[order], prot[order]
        if np.any(pos[1:] == pos[:-1]):
            raise ValueError("positions contain duplicates")

    cand = ~prot
    cpos = pos[cand]  # ascending: index order is age order, which breaks ties
    csc = sc[cand]
    n = min(int(n_evict), cpos.shape[0])
    if n == 0:
        return np.empty(0, dtype=np.int64)
    # NaN first (oldest first), then the n' lowest scores by a partial partition: O(N), not a full sort, so a
    # round stays cheap at budgets of tens of thousands of cells
    nan_idx = np.flatnonzero(np.isnan(csc))
    if len(nan_idx) >= n:
        return cpos[nan_idx[:n]].astype(np.int64, copy=False)
    rest = n - len(nan_idx)
    finite_idx = np.flatnonzero(~np.isnan(csc))
    key = csc[finite_idx]
    kth = np.partition(key, rest - 1)[rest - 1]
    below = finite_idx[key < kth]
    ties = finite_idx[key == kth][: rest - len(below)]  # equal scores: the oldest go first
    chosen = np.concatenate([nan_idx, below, ties])
    return np.sort(cpos[chosen]).astype(np.int64, copy=False)


def protected_mask(positions: np.ndarray, *, n_sink: int, n_recent: int,
                   newest_pos: int, prompt_end: int | None) -> np.ndarray:
    """Protection mask for live positions (N,) -> (N,) bool.

    A position p is protected when any of:

    * ``p < n_sink`` (attention sinks: the first n_sink tokens),
    * ``p > newest_pos - n_recent`` (the n_recent most recent positions,
      newest_pos included; n_recent = 0 protects none),
    * ``prompt_end is not None and p < prompt_end`` (the whole prompt).
    """
    pos = _positions_1d(positions)
    for name, v in (("n_sink", n_sink), ("n_recent", n_recent)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    mask = (pos < n_sink) | (pos > newest_pos - n_recent)
    if prompt_end is not None:
        mask |= pos < prompt_end
    return mask
