#!/usr/bin/env python3
"""The evaluation harness on parallel sequences: one unit of ``calibrate``'s grid (the dev traces x budgets of one
EPIKV setting, teacher-forced and compared with full-cache references) run one pass at a time and as N
sequences of one context (``calibrate --parallel N``, :func:`epikv_local.eval.passes.run_passes`), side by
side in one run, the settings alternating in each repeat.

Reported per setting: seconds for the references and for the grid unit, their ratio to one at a time, and how
far the pooled passes' ΔNLL and KL land from the one-at-a-time ones (the references must be bit-identical).

    M=$(../shared/models/fetch.sh qwen2.5-coder-0.5b)
    python scripts/bench_parallel_passes.py --model "$M" --threads 2 --repeats 2 --out results/parallel_passes_qwen05b.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, ArgParser, provenance, save_json  # noqa: E402

PROG = "bench_parallel_passes"


def unit(model, traces, refs, budgets, chunk, threads, n_parallel):
    """(seconds, rows) of one grid unit: default EPIKV on every trace x budget, compared with ``refs``."""
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.eval.fidelity import CompareJob, compare_passes

    jobs = [CompareJob(t, r, BudgetConfig(kv_budget=b, protect_prompt=False)) for t, r in zip(traces, refs)
            for b in budgets]
    t0 = time.perf_counter()
    rows = compare_passes(model, "epikv", jobs, chunk, n_threads=threads, n_parallel=n_parallel)
    return time.perf_counter() - t0, rows


def main(argv=None) -> int:
    import numpy as np

    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.errors import ConfigError, DataError
    from epikv_local.eval.passes import reference_passes
    from epikv_local.eval.traces import load_traces

    ap = ArgParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "r1_traces_dev.jsonl"),
                    help="dev traces (JSONL)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-traces", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=768, help="tokens per trace (calibrate's default grid: 768)")
    ap.add_argument("--budgets", default="128,256", help="comma-separated KV budgets")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--parallel", default="1,3,6", help="comma-separated n_parallel settings (1 is always run)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("threads", "n_traces", "tokens", "chunk", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
        settings = sorted({1, *(int(n) for n in args.parallel.split(","))})
    except ValueError as e:
        raise ConfigError(f"--budgets and --parallel take comma-separated integers ({e})") from None
    if min(budgets) < 1 or max(budgets) >= args.tokens - 1 or min(settings) < 1:
        raise ConfigError(f"budgets must be in 1..{args.tokens - 2} and --parallel settings >= 1")
    path = check_gguf(args.model) if args.model else default_model_path()
    runs = []
    with Model(path) as model:
        traces = [t for _, t in load_traces(args.traces, model, args.tokens, n_traces=args.n_traces,
                                            min_tokens=args.tokens, interleave_sources=True)]
        if len(traces) < args.n_traces:
            raise DataError(f"{args.traces} has {len(traces)} traces of {args.tokens} tokens, fewer than "
                            f"--n-traces {args.n_traces}")
        start = min(budgets)
        for rep in range(args.repeats):
            order = settings if rep % 2 == 0 else settings[::-1]
            run: dict = {"order": order}
            base_refs = base_rows = None
            for n in order:
                t0 = time.perf_counter()
                refs = reference_passes(model, traces, args.chunk, True, start, n_threads=args.threads,
                                        n_parallel=min(n, len(traces)))
                t_ref = time.perf_counter() - t0
                t_unit, rows = unit(model, traces, refs, budgets, args.chunk, args.threads, n)
                run[str(n)] = {"references_s": round(t_ref, 2), "unit_s": round(t_unit, 2),
                               "rows_per_s": round(len(rows) * (args.tokens - 1 - start) / t_unit, 1),
                               "_refs": refs, "_rows": rows}
                print(f"run {rep + 1}: n_parallel {n}: references {t_ref:.1f}s, grid unit ({len(rows)} passes) "
                      f"{t_unit:.1f}s", flush=True)
            base_refs, base_rows = run["1"].pop("_refs"), run["1"].pop("_rows")
            for n in settings[1:]:
                r = run[str(n)]
                refs, rows = r.pop("_refs"), r.pop("_rows")
                r["references_identical"] = all(np.array_equal(a.logp, b.logp) for a, b in zip(base_refs, refs))
                r["references_max_abs_diff_logp"] = round(max(float(np.abs(a.logp - b.logp).max())
                                                              for a, b in zip(base_refs, refs)), 5)
                r["references_mean_abs_diff_logp"] = round(float(np.mean([np.abs(a.logp - b.logp).mean()
                                                                          for a, b in zip(base_refs, refs)])), 7)
                r["max_abs_diff_delta_nll"] = round(max(abs(a["delta_nll"] - b["delta_nll"])
                                                        for a, b in zip(base_rows, rows)), 5)
                r["max_abs_diff_kl"] = round(max(abs(a["kl"] - b["kl"]) for a, b in zip(base_rows, rows)), 5)
                r["same_evictions"] = all(a["n_evicted"] == b["n_evicted"] for a, b in zip(base_rows, rows))
                r["unit_ratio"] = round(run["1"]["unit_s"] / r["unit_s"], 3)
                r["references_ratio"] = round(run["1"]["references_s"] / r["references_s"], 3)
            run["mean_delta_nll_one_at_a_time"] = round(statistics.mean(a["delta_nll"] for a in base_rows), 5)
            runs.append(run)
    summary = {str(n): {"unit_speedup_median": round(statistics.median(r[str(n)]["unit_ratio"] for r in runs), 3),
                        "references_speedup_median": round(statistics.median(r[str(n)]["references_ratio"]
                                                                             for r in runs), 3)}
               for n in settings[1:]}
    for n, s in summary.items():
        print(f"n_parallel {n}: grid unit {s['unit_speedup_median']}x, references {s['references_speedup_median']}x "
              "the speed of one pass at a time (median over repeats)", flush=True)
    save_json(args.out, {**provenance("bench_parallel_passes.py", argv), "model": Path(path).name,
                         "settings": {**vars(args), "budgets": budgets, "parallel": settings}, "runs": runs,
                         "summary": summary})
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
