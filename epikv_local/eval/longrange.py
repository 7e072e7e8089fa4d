"""Long-range fidelity metrics (numpy only): key tokens, the answer span, paired comparisons, the key-token grid.

All-token ΔNLL is dominated by tokens that only need local context, which any recent window serves. These
metrics look at the tokens that need more:

* **Key tokens** (LongPPL-style, Fang et al. 2024): position ``t`` (the prediction of token ``t + 1``) is a key
  position when its NLL under the full cache is much lower than under a short *local window* of context:
  ``nll_window(t) - nll_full(t) > threshold`` (nats). The local window is a fresh, truncated context (see
  :func:`window_blocks`): every position sees at least the last ``window`` tokens and fewer than
  ``window + stride``, decoded from scratch (its first token acts as the attention sink, like LongPPL's
  truncated contexts). The mask is a property of the trace, computed once from the reference pass.
* **Answer span**: the gold final answer is appended to the (truncated) trace as
  ``ANSWER_HEAD + answer + ANSWER_TAIL``; the span is the positions that predict the answer's own tokens.
* **Paired comparisons**: per-trace differences ``metric(policy) - metric(baseline)`` (same trace, same budget)
  with a percentile bootstrap CI resampling traces (:func:`paired_bootstrap_ci`).

Units: NLL, ΔNLL and KL in nats per token; ``top1_agreement`` is 0/1 per position (a share when averaged).
Shapes: per-position arrays are (N,) float64, aligned by absolute position; masks are (N,) bool. A mean over an
empty set is ``nan`` (rows store it as ``None``).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from .stats import bootstrap_ci

#: the all-token metrics of the fidelity harness (same names as ``fidelity.METRICS``)
BASE_METRICS = ("nll", "nll_ref", "delta_nll", "top1_agreement", "kl")
KEY_METRICS = tuple(f"key_{m}" for m in BASE_METRICS)
ANSWER_METRICS = tuple(f"answer_{m}" for m in BASE_METRICS)
#: every metric that gets a per-trace paired difference to the baseline policy
PAIRED_METRICS = BASE_METRICS + KEY_METRICS + ANSWER_METRICS

#: local window (tokens) and key threshold (nats) chosen on the dev split (docs/longrange.md)
KEY_WINDOW = 64
KEY_THRESHOLD = 2.0
#: share of the window that one fresh block evaluates (stride = window * fraction): positions see between
#: ``window`` and ``window + stride - 1`` tokens of context; a trace costs about ``(1 + 1/fraction)`` decodes of
#: itself without logits
WINDOW_STRIDE_FRACTION = 0.5

#: the text appended after the truncated trace: ANSWER_HEAD + gold answer + ANSWER_TAIL
ANSWER_HEAD = "\n\n**Final Answer**\n\\[ \\boxed{"
ANSWER_TAIL = "} \\]"


# -- the local window -------------------------------------------------------------------------------------------
def window_stride(window: int, fraction: float = WINDOW_STRIDE_FRACTION) -> int:
    return max(1, int(window * fraction))


def window_blocks(eval_start: int, eval_end: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Blocks ``(a, s, e)`` of the local-window pass over positions ``eval_start <= t < eval_end``.

    Each block decodes ``tokens[a:e]`` in a fresh (empty) context and reads the output rows of positions
    ``s .. e - 1`` (row ``t - a``). ``a = max(0, s - window + 1)``, so position ``t`` sees the
    ``t - a + 1`` tokens ``tokens[a .. t]``: between ``window`` and ``window + stride - 1`` of them (all of the
    prefix when ``t < window``).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    stride = window_stride(window) if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    out = []
    for s in range(eval_start, eval_end, stride):
        out.append((max(0, s - window + 1), s, min(s + stride, eval_end)))
    return out


# -- key tokens ---------------------------------------------------------------------------------------------------
def key_token_mask(nll_full: np.ndarray, nll_window: np.ndarray, threshold: float) -> np.ndarray:
    """(N,) bool: ``nll_window - nll_full > threshold`` (nats); NaN entries are never key tokens."""
    full = np.asarray(nll_full, dtype=np.float64)
    win = np.asarray(nll_window, dtype=np.float64)
    if full.shape != win.shape or full.ndim != 1:
        raise ValueError(f"nll arrays must be equal (N,) shapes, got {full.shape} and {win.shape}")
    gain = win - full
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(gain), False, gain > threshold)


def masked_means(per_position: dict[str, np.ndarray], mask: np.ndarray, prefix: str = "") -> dict[str, float]:
    """Means of each (N,) array of ``per_position`` over the (N,) bool ``mask``, keyed ``prefix + name``;
    ``nan`` when the mask is empty."""
    mask = np.asarray(mask, dtype=bool)
    n = int(mask.sum())
    out = {}
    for k, v in per_position.items():
        v = np.asarray(v, dtype=np.float64)
        if v.shape != mask.shape:
            raise ValueError(f"{k}: shape {v.shape} does not match the mask {mask.shape}")
        out[prefix + k] = float(v[mask].mean()) if n else float("nan")
    return out


# -- the answer span ----------------------------------------------------------------------------------------------
def answer_parts(answer) -> tuple[str, str, str]:
    """(head, answer text, tail) of the appended final answer; the answer's own tokens are scored."""
    text = str(answer).strip()
    if not text:
        raise ValueError("the answer is empty")
    return ANSWER_HEAD, text, ANSWER_TAIL


def answer_positions(n_trace: int, n_head: int, n_answer: int) -> np.ndarray:
    """Absolute positions that predict the answer's tokens when ``head + answer + tail`` tokens follow a trace of
    ``n_trace`` tokens: answer token ``k`` sits at ``n_trace + n_head + k`` and is predicted one position before."""
    return np.arange(n_trace + n_head - 1, n_trace + n_head + n_answer - 1, dtype=np.int64)


# -- paired comparisons -------------------------------------------------------------------------------------------
def _num(x) -> float:
    return float("nan") if x is None else float(x)


def paired_bootstrap_ci(x: Sequence[float], y: Sequence[float], n_resamples: int = 1000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean, low, high, n) of the paired differences ``x - y``: pairs where either is NaN/None are dropped, the
    remaining differences resampled (a percentile bootstrap over the pairs, i.e. over traces)."""
    a = np.array([_num(v) for v in x], dtype=np.float64)
    b = np.array([_num(v) for v in y], dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples need equal lengths, got {a.shape} and {b.shape}")
    d = a - b
    d = d[~np.isnan(d)]
    mean, lo, hi = bootstrap_ci(d, n_resamples=n_resamples, seed=seed, level=level)
    return mean, lo, hi, int(d.size)


def paired_summary(rows: list[dict], baseline: str = "streaming", metrics: Iterable[str] = PAIRED_METRICS,
                   n_resamples: int = 1000, seed: int = 0) -> dict[tuple[str, int], dict[str, dict]]:
    """Per (policy, kv_budget) other than ``baseline``: for each metric present in the rows, the paired
    difference to ``baseline`` on the same trace and budget (rows need ``trace_id``), as
    ``{mean, ci_low, ci_high, n_traces}``. Pairs missing either side are left out."""
    metrics = tuple(metrics)
    base = {(r["trace_id"], r["kv_budget"]): r for r in rows if r.get("policy") == baseline and "trace_id" in r}
    groups: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
    for r in rows:
        if r.get("policy") == baseline or "trace_id" not in r:
            continue
        b = base.get((r["trace_id"], r["kv_budget"]))
        if b is not None:
            groups.setdefault((r["policy"], r["kv_budget"]), []).append((r, b))
    out = {}
    for key, pairs in groups.items():
        res = {}
        for m in metrics:
            if not any(m in r and m in b for r, b in pairs):
                continue
            mean, lo, hi, n = paired_bootstrap_ci([r.get(m) for r, _ in pairs], [b.get(m) for _, b in pairs],
                                                  n_resamples=n_resamples, seed=seed)
            res[m] = {"mean": mean, "ci_low": lo, "ci_high": hi, "n_traces": n}
        out[key] = res
    return out


def summary_ci(values: Iterable, n_resamples: int = 1000, seed: int = 0) -> dict:
    """Mean and bootstrap CI over traces of values that may be missing (None/NaN dropped), with their count."""
    v = np.array([_num(x) for x in values], dtype=np.float64)
    v = v[~np.isnan(v)]
    mean, lo, hi = bootstrap_ci(v, n_resamples=n_resamples, seed=seed)
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "n_traces": int(v.size)}


def none_if_nan(d: dict) -> dict:
    """Copy of ``d`` with NaN floats replaced by None (strict JSON)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


# -- choosing the window and the threshold on the dev split ---------------------------------------------------------
def key_grid(traces: list[dict], windows: Sequence[int], thresholds: Sequence[float], a: str = "random",
             b: str = "streaming", n_resamples: int = 1000, seed: int = 0) -> list[dict]:
    """Evaluate every (window, threshold) pair on per-position data of several traces.

    traces: one dict per trace: ``window_nll`` {window: (N,) local-window NLL}, ``positions`` (N,) absolute
    positions of those entries, and ``passes`` {(policy, budget): {"positions": (M,), "nll_ref", "delta_nll",
    "top1_agreement": (M,)}} (the evaluated positions of that pass, a subset of ``positions``).

    Returns one entry per pair and budget: the key share of the evaluated positions (pooled and per trace),
    each policy's mean key ΔNLL / top-1 over traces, and the paired difference of key ΔNLL of every policy to
    ``b`` (``paired_vs_<b>``; bootstrap CI over traces, with the standardised size ``d_z = mean / sd`` of the
    per-trace differences); ``paired`` is the one of ``a`` (what :func:`select_key_setting` reads).
    """
    out = []
    budgets = sorted({bud for t in traces for (_, bud) in t["passes"]})
    policies = list(dict.fromkeys(p for t in traces for (p, _) in t["passes"]))
    for w in windows:
        for thr in thresholds:
            for bud in budgets:
                per_policy: dict[str, dict[str, list]] = {p: {"dnll": [], "top1": []} for p in policies}
                n_key, n_eval, shares = 0, 0, []
                for t in traces:
                    pos = np.asarray(t["positions"])
                    win = np.asarray(t["window_nll"][w], dtype=np.float64)
                    share_done = False
                    for p in policies:
                        pp = t["passes"].get((p, bud))
                        if pp is None:
                            per_policy[p]["dnll"].append(float("nan"))
                            per_policy[p]["top1"].append(float("nan"))
                            continue
                        idx = np.searchsorted(pos, pp["positions"])
                        mask = key_token_mask(pp["nll_ref"], win[idx], thr)
                        m = masked_means({"delta_nll": pp["delta_nll"], "top1_agreement": pp["top1_agreement"]},
                                         mask)
                        per_policy[p]["dnll"].append(m["delta_nll"])
                        per_policy[p]["top1"].append(m["top1_agreement"])
                        if not share_done:
                            n_key += int(mask.sum())
                            n_eval += len(mask)
                            shares.append(float(mask.mean()) if len(mask) else float("nan"))
                            share_done = True
                entry = {"window": int(w), "threshold": float(thr), "kv_budget": int(bud), "n_key": n_key,
                         "n_eval": n_eval, "key_share": n_key / n_eval if n_eval else float("nan"),
                         "key_share_per_trace": shares,
                         "key_delta_nll": {p: summary_ci(v["dnll"], n_resamples, seed) for p, v in per_policy.items()},
                         "key_top1_agreement": {p: summary_ci(v["top1"], n_resamples, seed)
                                                for p, v in per_policy.items()}}
                if b in per_policy:
                    entry[f"paired_vs_{b}"] = {}
                    for p in policies:
                        if p == b:
                            continue
                        pr = _paired_effect(per_policy[p]["dnll"], per_policy[b]["dnll"], n_resamples, seed)
                        entry[f"paired_vs_{b}"][p] = pr
                        if p == a:
                            entry["paired"] = {"a": a, "b": b, **pr}
                out.append(entry)
    return out


def _paired_effect(x, y, n_resamples: int, seed: int) -> dict:
    """Paired difference x - y over traces: mean, bootstrap CI, count, d_z = mean / sd (ddof 1) and whether the CI
    excludes zero."""
    mean, lo, hi, n = paired_bootstrap_ci(x, y, n_resamples, seed)
    d = np.array([_num(v) for v in x], dtype=np.float64) - np.array([_num(v) for v in y], dtype=np.float64)
    d = d[~np.isnan(d)]
    sd = float(d.std(ddof=1)) if d.size > 1 else float("nan")
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "n_traces": n,
            "d_z": mean / sd if sd and sd > 0 else float("nan"), "ci_excludes_zero": bool(n > 1 and (lo > 0 or hi < 0))}


def select_key_setting(grid: list[dict], budget: int, share_range: tuple[float, float] = (0.05, 0.20)) -> dict:
    """The rule used to choose (window, threshold) on the dev split: among the pairs whose pooled key share at
    ``budget`` lies in ``share_range``, the one with the largest ``|d_z|`` of the paired key-ΔNLL difference
    (random - streaming) at that budget (ties: the smaller window, then the larger threshold). When no pair has a
    usable share, the pair whose share is closest to the range. Returns ``{window, threshold, reason}``."""
    rows = [g for g in grid if g["kv_budget"] == budget]
    if not rows:
        raise ValueError(f"no grid entry at budget {budget}")
    lo, hi = share_range
    usable = [g for g in rows if lo <= g["key_share"] <= hi]

    def sep(g):
        d = g.get("paired", {}).get("d_z", float("nan"))
        return -1.0 if d is None or math.isnan(d) else abs(d)

    if usable:
        best = max(usable, key=lambda g: (sep(g), -g["window"], g["threshold"]))
        reason = (f"key share {best['key_share']:.3f} in [{lo}, {hi}] and the largest |d_z| "
                  f"({sep(best):.2f}) of key ΔNLL random - streaming at budget {budget} among {len(usable)} usable pairs")
    else:
        best = min(rows, key=lambda g: (min(abs(g["key_share"] - lo), abs(g["key_share"] - hi)), -sep(g)))
        reason = f"no pair had a key share in [{lo}, {hi}] at budget {budget}; closest share {best['key_share']:.3f}"
    return {"window": best["window"], "threshold": best["threshold"], "kv_budget": budget, "reason": reason}
