#!/usr/bin/env python3
"""Quantized KV cache + eviction: memory and teacher-forced fidelity, side by side in one run.

Attention-free eviction keeps flash attention on, and llama.cpp quantizes the V cache only with flash attention
on: the two savings multiply. On the held-out test traces, against the full f16 cache of each trace:

* fidelity (ΔNLL, top-1 agreement, KL) for {f16, q8_0, q4_0} x budgets x {epikv, streaming}, plus the full
  cache in each type (the quantization alone);
* KV bytes as llama.cpp allocates them (its own "KV buffer size" report), and the memory table for 65,536
  generated tokens: the full cache vs budget 2,048 in f16 / q8_0 / q4_0.

    python scripts/bench_quant_kv.py --n-traces 2 --max-tokens 1536 --budgets 256,1024 --threads 2 \\
        --out results/quant_kv.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import provenance, save_json  # noqa: E402

PROG = "bench_quant_kv"
TYPES = ("f16", "q8_0", "q4_0")
REPO = Path(__file__).resolve().parents[1]


def llama_kv_mib(nat) -> float | None:
    """The KV buffer size llama.cpp reported for the context just created (MiB), from its INFO log."""
    for line in reversed(nat.log.info):
        m = re.search(r"KV buffer size\s*=\s*([\d.]+) MiB", line)
        if m:
            return float(m.group(1))
    return None


def memory_table(model, n_cells_full: int, budget: int, n_batch: int) -> list[dict]:
    from epikv_local.engine.budget import context_cells
    from epikv_local.engine.handles import Context

    rows = []
    for label, cells, t in [("full cache", n_cells_full, "f16"), ("full cache", n_cells_full, "q4_0")] + [
            (f"budget {budget}", context_cells(budget, n_batch), t) for t in TYPES]:
        model.nat.log.info.clear()
        with Context(model, n_ctx=cells, n_batch=n_batch, type_k=t, type_v=t, n_threads=1) as ctx:
            rows.append({"cache": label, "type": t, "n_ctx": ctx.n_ctx, "kv_bytes_formula": ctx.kv_bytes,
                         "kv_mib_llama_cpp": llama_kv_mib(model.nat)})
    return rows


def main(argv=None) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.errors import ConfigError, DataError
    from epikv_local.eval.fidelity import compare_pass, reference_pass
    from epikv_local.eval.stats import bootstrap_ci
    from epikv_local.eval.traces import load_traces

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--traces", default=str(REPO.parent / "shared" / "data" / "r1_traces_test.jsonl"))
    ap.add_argument("--n-traces", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1536)
    ap.add_argument("--budgets", default="256,1024")
    ap.add_argument("--policies", default="epikv,streaming")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--generated", type=int, default=65536, help="tokens of the memory table")
    ap.add_argument("--memory-budget", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise ConfigError(f"--budgets takes integers, got {args.budgets!r}") from None
    model_path = check_gguf(args.model) if args.model else default_model_path()
    rows = []
    with Model(model_path) as model:
        traces = load_traces(args.traces, model, args.max_tokens, n_traces=args.n_traces, interleave_sources=True)
        if not traces:
            raise DataError(f"no trace in {args.traces} has {args.max_tokens} tokens")
        for tid, toks in traces:
            ref = reference_pass(model, toks, args.chunk, True, eval_start=min(budgets), n_threads=args.threads)
            for t in TYPES:
                runs = [("none", len(toks))] + [(p, b) for p in args.policies.split(",") for b in budgets]
                for pol, b in runs:
                    if pol == "none" and t == "f16":
                        continue  # that is the reference itself
                    bc = BudgetConfig(kv_budget=b, n_sink=4, protect_prompt=False)
                    # evicting passes: positions >= their budget (the harness's convention); the full cache in a
                    # quantized type: every position from the smallest budget on
                    row = compare_pass(model, toks, ref, pol, bc, args.chunk, n_threads=args.threads,
                                       eval_start=min(budgets) if pol == "none" else None, type_k=t, type_v=t)
                    row.update({"trace_id": tid, "cache": "full" if pol == "none" else f"budget {b}"})
                    rows.append(row)
                    print(f"{tid[-28:]:<28} {t:<5} {row['cache']:<12} {pol:<10} dNLL {row['delta_nll']:+.4f} "
                          f"top1 {row['top1_agreement']:.3f} KV {row['kv_bytes'] / 2**20:7.2f} MiB", flush=True)
        mem = memory_table(model, args.generated + 128, args.memory_budget, 64)
    summary = []
    keys = sorted({(r["type_k"], r["cache"], r["policy"]) for r in rows})
    for t, cache, pol in keys:
        sel = [r for r in rows if (r["type_k"], r["cache"], r["policy"]) == (t, cache, pol)]
        d = bootstrap_ci([r["delta_nll"] for r in sel])
        a = bootstrap_ci([r["top1_agreement"] for r in sel])
        summary.append({"type": t, "cache": cache, "policy": pol, "n_traces": len(sel), "delta_nll": d[0],
                        "delta_nll_ci": d[1:], "top1_agreement": a[0], "top1_ci": a[1:],
                        "kv_bytes": sel[0]["kv_bytes"]})
    for r in mem:
        print(f"memory: {r['cache']:<12} {r['type']:<5} n_ctx {r['n_ctx']:>6}  {r['kv_mib_llama_cpp']} MiB")
    save_json(args.out, {
        **provenance("bench_quant_kv.py", argv), "model": Path(model_path).name, "settings": vars(args),
        "note": "fidelity of every pass against the full f16 cache of the same trace; evicting passes at positions "
                ">= their budget, full-cache rows in q8_0/q4_0 (the quantization alone) from the smallest budget",
        "summary": summary, "memory": mem, "rows": rows})
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
