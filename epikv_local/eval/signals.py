"""Calibration, step 3: choose this model's policy among the signals (dev traces only).

EPIKV's own settings (step 2, :mod:`.calibrate`) make the best *residual-stream* policy; on some models a
key-based score or plain recency is better (docs/benchmarks.md). This step evaluates a fixed list of
candidates, each a (registered policy, settings, recent share), on the same dev traces and budgets, and
selects the one with the lowest objective, overall and per budget:

    objective = mean over traces x budgets of (all-token ΔNLL + key-token ΔNLL) / 2
    objective at budget b = mean over traces of the same at b

Both choices are *guarded* (:func:`guarded_choice`): a candidate replaces StreamingLLM only when its paired
advantage over it on the dev traces exceeds one standard error of the per-trace differences; a margin inside
the noise keeps StreamingLLM. The per-budget choice is what ``--policy calibrated`` runs at a given KV budget (the nearest calibrated budget on
a log scale, :meth:`~epikv_local.api.calibration.CalibrationResult.selected_for`); the overall one when the budget
is unknown. Step 3 may use longer traces and more budgets than step 2 (``Grid.signal_budgets``) so that roomy
budgets (512, 1024) get a choice of their own.

(key tokens as in docs/longrange.md: W = 64, threshold 2.0 nats, from a full-cache and a local-window pass per
trace). The first half is what every token sees; the second is the long-range part that a recent window
cannot serve. StreamingLLM is a candidate, so on the dev traces the selection is never worse than it.

Candidates (:func:`candidates`): streaming; EPIKV with step 2's settings; KeyDiff, TriAttention (offline query
statistics of the dev traces) and R-KV's redundancy term at recent shares 0.5 and 0.75; EPIKV-mix (EPIKV +
KeyDiff ranks) with KeyDiff weights 0.5, 1 and 2 at step 2's recent share, and with TriAttention (12 in all;
the ``--fast`` profile keeps 7: the rivals at step 2's recent share and the mixes of weight 1).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.budget import BudgetConfig
from ..engine.handles import Context, Model
from ..engine.native import CAPTURE_Q
from ..policies import PolicySpec, policy_spec
from ..policies.rope import check_invertible, to_complex
from ..policies.triattention import QueryStats
from . import longrange as lr
from .fidelity import CompareJob, TraceSpans, compare_passes, key_positions_of, local_window_nll
from .progress import progress_bar

#: standard errors by which a candidate's paired dev advantage over StreamingLLM must exceed 0 (guarded_choice)
GUARD_SE = 1.0
OBJECTIVE = ("mean over traces x budgets of (delta_nll + key_delta_nll) / 2; by_budget: the same per budget "
             "(mean over traces)")


def collect_query_stats(model: Model, traces: list[tuple[str, list[int]]], n_threads: int | None = None,
                        chunk: int = 64, log: Callable[[str], None] | None = None) -> QueryStats:
    """Pre-RoPE query statistics of every layer over ``traces`` (one full-cache pass each, queries captured)."""
    sh = model.info.shape
    check_invertible(sh, "query statistics")
    layers = tuple(range(sh.n_layer))
    qs = QueryStats(layers, sh.n_head, (sh.rope_dims or sh.head_dim) // 2)
    n_ctx = max(len(t) for _, t in traces)
    with Context(model, n_ctx=n_ctx, n_batch=chunk, n_threads=n_threads) as ctx:
        for il in layers:
            ctx.set_layer_capture(il, True, CAPTURE_Q)
        for _, toks in progress_bar(traces, "query statistics", unit="trace"):
            ctx.clear()
            # logits_from one past the last position: no chunk gets an output row (only the queries are read)
            for pos in ctx.prefill_chunks(toks, chunk=chunk, logits_from=len(toks)):
                rows = np.stack([ctx.layer_capture(il, len(pos), CAPTURE_Q) for il in layers], axis=1)
                qs.update(to_complex(rows, pos, sh, sh.n_head))
    if log:
        log(f"query statistics of {qs.count} tokens x {len(layers)} layers")
    return qs


def candidates(epikv: dict, recent: float, query_stats: str | None, fast: bool = False
               ) -> list[tuple[str, tuple, float]]:
    """(policy name, settings as sorted (key, value) pairs, recent share) to compare, without repeats;
    ``epikv`` = step 2's {"layers", "window"}, ``recent`` its recent share. ``fast``: the rivals at ``recent`` only and one EPIKV-mix weight (7 candidates, not 12)."""
    out: list[tuple[str, dict, float]] = [("streaming", {}, 0.5), ("epikv", dict(epikv), recent)]
    for rf in ((recent,) if fast else (0.5, 0.75)):
        out.append(("keydiff", {}, rf))
        out.append(("rkv_redundancy", {}, rf))
        if query_stats:
            out.append(("triattention", {"query_stats": query_stats}, rf))
    for w in ((1.0,) if fast else (0.5, 1.0, 2.0)):
        out.append(("epikv_mix", {**epikv, "w_keydiff": w}, recent))
    if query_stats:
        out.append(("epikv_mix", {**epikv, "w_keydiff": 0.0, "w_triattention": 1.0, "query_stats": query_stats},
                    recent))
    return _unique(out)


def _unique(out: list[tuple[str, dict, float]]) -> list[tuple[str, tuple, float]]:
    return list(dict.fromkeys((n, tuple(sorted(o.items())), r) for n, o, r in out))


def select_policy(model: Model, traces: list[tuple[str, list[int]]], refs: list, budgets: list[int],
                  chunk: int, n_sink: int, epikv: dict, recent: float, query_stats: str | None,
                  n_threads: int | None = None, log: Callable[[str], None] | None = None, fast: bool = False,
                  n_parallel: int = 1) -> dict:
    """Evaluate :func:`candidates` on ``traces`` (full-cache references ``refs``, flash attention on) and
    return {"objective", "chosen", "by_budget", "candidates", "seconds"}.

    chosen: the candidate with the lowest objective over all budgets (what runs when the budget is unknown);
    by_budget: per budget, the candidate with the lowest objective at that budget, as
    [{"kv_budget", "policy", "options", "recent_fraction", "delta_nll", "key_delta_nll", "objective"}] sorted
    by budget: the best signal changes with the budget (a tight cache needs recency, a roomy one can afford
    scored tokens), so the calibrated policy follows it (:meth:`CalibrationResult.selected_for`).
    n_parallel: a candidate's traces x budgets decoded together as sequences of one context.
    """
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    spans = []
    for (tid, toks), ref in zip(traces, refs):
        wn = local_window_nll(model, toks, lr.KEY_WINDOW, ref.eval_start, len(toks) - 1, n_threads=n_threads)
        sp = TraceSpans(len(toks), key_positions=key_positions_of(ref, toks, wn, lr.KEY_THRESHOLD, len(toks)),
                        key_window=lr.KEY_WINDOW, key_threshold=lr.KEY_THRESHOLD)
        spans.append(sp)
    cands = candidates(epikv, recent, query_stats, fast=fast)
    results = []
    bar = progress_bar(total=len(cands) * len(traces) * len(budgets), desc="signals", unit="pass")
    try:
        for name, opts_t, rf in cands:
            opts = dict(opts_t)
            base = policy_spec(name)
            spec = PolicySpec(name, base.cls, {**base.preset, **opts})
            vals: dict[int, list[float]] = {b: [] for b in budgets}
            keys: dict[int, list[float]] = {b: [] for b in budgets}
            per_trace: dict[int, list[float]] = {b: [] for b in budgets}  # each trace's objective
            plan = [(toks, ref, sp, b) for (_, toks), ref, sp in zip(traces, refs, spans) for b in budgets]
            rows = compare_passes(model, spec, [CompareJob(toks, ref, BudgetConfig(
                kv_budget=b, n_sink=n_sink, recent_fraction=rf, protect_prompt=False), sp) for toks, ref, sp, b in plan],
                chunk, n_threads=n_threads, n_parallel=n_parallel)
            for (_, _, _, b), row in zip(plan, rows):
                vals[b].append(row["delta_nll"])
                k = row.get("key_delta_nll")
                if k is not None:
                    keys[b].append(k)
                per_trace[b].append(_objective([row["delta_nll"]], [] if k is None else [k])["objective"])
            bar.update(len(plan))
            per_budget = {b: {**_objective(vals[b], keys[b]), "per_trace": per_trace[b]} for b in budgets}
            r = {"policy": name, "options": _jsonable(opts), "recent_fraction": rf,
                 **_objective([v for b in budgets for v in vals[b]], [k for b in budgets for k in keys[b]]),
                 "per_trace": [float(np.mean([per_trace[b][i] for b in budgets])) for i in range(len(traces))],
                 "per_budget": {str(b): m for b, m in per_budget.items()}}
            results.append(r)
            log(f"{name} {_short(opts)} recent {rf}: ΔNLL {r['delta_nll']:+.4f} key ΔNLL {r['key_delta_nll']:+.4f} "
                f"-> {r['objective']:+.4f} (" + ", ".join(f"{b}: {m['objective']:+.4f}" for b, m in per_budget.items())
                + ")")
    finally:
        bar.close()
    chosen, margin = guarded_choice([(r, r["objective"], r["per_trace"]) for r in results])
    chosen = {**{k: v for k, v in chosen.items() if k not in ("per_budget", "per_trace")}, "vs_streaming": margin}
    by_budget = []
    for b in budgets:
        rb, margin = guarded_choice([(r, r["per_budget"][str(b)]["objective"], r["per_budget"][str(b)]["per_trace"])
                                     for r in results])
        by_budget.append({"kv_budget": int(b), "policy": rb["policy"], "options": rb["options"],
                          "recent_fraction": rb["recent_fraction"],
                          **{k: v for k, v in rb["per_budget"][str(b)].items() if k != "per_trace"},
                          "vs_streaming": margin})
    return {"objective": OBJECTIVE, "guard_se": GUARD_SE, "chosen": chosen, "by_budget": by_budget,
            "candidates": results, "seconds": round(time.perf_counter() - t0, 1)}


def guarded_choice(scored: list[tuple[dict, float, list[float]]], guard_se: float | None = None
                   ) -> tuple[dict, dict]:
    """The candidate to run, from (candidate, mean objective, per-trace objectives) triples, one of them
    StreamingLLM's (``candidate["policy"] == "streaming"``; the traces in the same order for all).

    The lowest mean objective wins only if it beats StreamingLLM by more than the noise of the dev traces: the
    per-trace paired differences d = candidate - streaming must have mean + ``guard_se`` standard errors < 0
    (with fewer than 2 traces, no standard error: mean < 0). Otherwise the next-lowest that passes, else
    StreamingLLM. Why: with 3 dev traces a margin of 1 % of the objective is noise, and a policy chosen on noise
    can be worse than StreamingLLM on held-out traces (it was: docs/benchmarks.md). Returns (candidate,
    {"mean", "se", "n_traces", "fallback"}) for the paired difference of the returned one to StreamingLLM."""
    guard_se = GUARD_SE if guard_se is None else guard_se
    stream = next((c, m, t) for c, m, t in scored if c["policy"] == "streaming")
    s = np.asarray(stream[2], dtype=np.float64)
    fallback = False
    for cand, mean, per_trace in sorted(scored, key=lambda x: x[1]):
        if cand is stream[0]:
            break
        d = np.asarray(per_trace, dtype=np.float64) - s
        se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size >= 2 else 0.0
        if float(d.mean()) + guard_se * se < 0:
            return cand, {"mean": float(d.mean()), "se": se, "n_traces": int(d.size), "fallback": fallback}
        fallback = True  # a lower mean did not clear the guard
    return stream[0], {"mean": 0.0, "se": 0.0, "n_traces": int(s.size), "fallback": fallback}


def _objective(vals: list[float], keys: list[float]) -> dict:
    """{"delta_nll", "key_delta_nll", "objective"} of one candidate's passes (objective: their mean; the
    all-token ΔNLL alone when no pass had key tokens)."""
    all_mean = float(np.mean(vals))
    key_mean = float(np.mean(keys)) if keys else float("nan")
    obj = (all_mean + key_mean) / 2 if np.isfinite(key_mean) else all_mean
    return {"delta_nll": all_mean, "key_delta_nll": key_mean, "objective": obj}


def _jsonable(opts: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else os.fspath(v) if isinstance(v, Path) else v)
            for k, v in opts.items()}


def _short(opts: dict) -> str:
    return ", ".join(f"{k}={Path(v).name if k == 'query_stats' else v}" for k, v in opts.items()) or "defaults"
