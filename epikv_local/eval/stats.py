"""Statistics of the evaluation harness (numpy only): log-probabilities, rank statistics, bootstrap CIs."""

from __future__ import annotations

from typing import Iterable

import numpy as np


# -- log-probabilities ----------------------------------------------------------------------------------------
def log_softmax(logits: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Row-wise log-softmax of (..., V) logits: float64 max-shifted log-sum-exp, returned as ``dtype``
    (float32 by default, so identical logits give bit-identical log-probs)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    lse = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return (z - lse).astype(dtype, copy=False)


def nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row: logits (k, V), targets (k,) -> (k,) float64 nats."""
    lp = log_softmax(logits, dtype=np.float64)
    return -lp[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]


def bootstrap_ci(values: Iterable[float], n_resamples: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and a percentile bootstrap CI (resampling the values)."""
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(v.mean())
    if v.size == 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.size, size=(n_resamples, v.size))
    boot = v[idx].mean(axis=1)
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [a, 1.0 - a])
    # the percentile interval of the resampled means contains the sample mean except in degenerate float
    # cases; widen to it so the reported interval always brackets the point estimate
    return mean, float(min(lo, mean)), float(max(hi, mean))


# -- rank statistics ------------------------------------------------------------------------------------------
def rankdata(x) -> np.ndarray:
    """Ranks 1..n of x (n,), ties get their average rank (like scipy.stats.rankdata 'average')."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(n, dtype=np.float64)
    # group ties: boundaries where the sorted value changes
    bounds = np.flatnonzero(np.diff(xs) != 0) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [n]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0  # mean of ranks s+1 .. e
    return ranks


def spearman(x, y) -> float:
    """Spearman rank correlation of x and y (n,): Pearson correlation of the average ranks; NaN when either is
    constant or n < 2. NaN entries of x or y are dropped pairwise."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    if len(x) < 2:
        return float("nan")
    rx, ry = rankdata(x), rankdata(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def auroc(scores, positive) -> float:
    """Area under the ROC curve of ``scores`` for the boolean ``positive`` (Mann-Whitney U / (n1 n0), ties
    counted 1/2). NaN when there are no positives or no negatives."""
    s = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    ok = ~np.isnan(s)
    s, pos = s[ok], pos[ok]
    n1 = int(pos.sum())
    n0 = len(pos) - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = rankdata(s)
    return float((r[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def top_fraction(labels, frac: float = 0.1) -> np.ndarray:
    """Boolean mask of the labels at or above the (1 - frac) quantile (the top decile by default)."""
    y = np.asarray(labels, dtype=np.float64)
    return y >= np.quantile(y, 1.0 - frac)


def within_groups_spearman(x, y, groups) -> float:
    """Mean over groups (e.g. checkpoints) of the Spearman correlation inside each group (NaN groups skipped)."""
    x, y, groups = np.asarray(x, float), np.asarray(y, float), np.asarray(groups)
    vals = [spearman(x[groups == gv], y[groups == gv]) for gv in np.unique(groups)]
    vals = [v for v in vals if not np.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def signal_stats(signal, labels, groups) -> dict:
    labels = np.asarray(labels, float)
    return {"spearman": spearman(signal, labels), "spearman_within": within_groups_spearman(signal, labels, groups),
            "auroc_top10": auroc(signal, top_fraction(labels))}
