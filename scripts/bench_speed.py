#!/usr/bin/env python3
"""Decode speed (tokens/s) of every eviction policy at one fixed KV budget, side by side in one process.

Same design as ``bench_overhead.py``: one model, one budget-sized context for everyone
(n_ctx = kv_budget + n_batch), the same prompt (it fills kv_budget - n_batch cells, text from the shared
R1 traces), then ``--tokens`` greedy tokens (``ignore_eog``) with eviction active. The variants run
alternately (the order reverses every round), several rounds, and the script reports per variant the median
tokens/s and the median of the per-round ratios to ``plain``:

* ``plain``       policy none, flash attention on, no eval callback, no capture (llama.cpp as it is); the
                  slack of the context holds the generated tokens (prompt + tokens <= n_ctx);
* ``plain-noFA``  the same with flash attention off: the flash-attention loss alone;
* every policy    through the engine as the CLI runs it (flash attention verified on the first decode).
                  The attention-based policies (h2o, tova, snapkv) can only run with flash attention off and
                  the attention matrix read back (``SessionConfig(flash_attn=False)``); their ratio to
                  ``plain-noFA`` is the scoring/readback cost alone, their ratio to ``plain`` the whole cost.

It also reports the per-round speed ratio of ``epikv`` to each attention-based policy (measured, not
assumed) and the mean cost of one eviction round per policy (``evict_seconds / n_rounds`` of
``Session.stats()``).
Results: ``results/speed.json`` (with the command, git revision and machine) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, git_rev, machine, median_ratio, one_run  # noqa: E402

from epikv_local.errors import run_main  # noqa: E402
from epikv_local.eval.io import write_atomic  # noqa: E402
from epikv_local.eval.provenance import portable  # noqa: E402

BASELINES = {
    "plain": dict(policy="none", flash_attn=True, verify=False),
    "plain-noFA": dict(policy="none", flash_attn=False, verify=False),
}


def variant_spec(name: str) -> dict:
    """plain / plain-noFA, or a registered policy (attention policies get flash attention off)."""
    from epikv_local.policies import REGISTRY

    if name in BASELINES:
        return BASELINES[name]
    return dict(policy=name, flash_attn=not REGISTRY[name].cls.needs_attention, verify=True)


def main(argv=None) -> int:
    from epikv_local.policies import REGISTRY

    default_policies = [p for p in REGISTRY if p != "none"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--kv-budget", type=int, default=512)
    ap.add_argument("--batch", type=int, default=None,
                    help="n_batch (default: max(64, ceil(tokens / 2)), so that plain's slack of n_batch cells "
                         "beyond the budget holds the generated tokens: prompt = budget - n_batch)")
    ap.add_argument("--tokens", type=int, default=192, help="decoded tokens per run")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds over all variants")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--policies", default=",".join(default_policies),
                    help="comma-separated registered policies (plain and plain-noFA are always measured)")
    ap.add_argument("--out", default=str(ROOT / "results" / "speed.json"))
    args = ap.parse_args(argv)

    batch = args.batch if args.batch is not None else max(64, math.ceil(args.tokens / 2))
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be >= 1")
    if args.tokens > 2 * batch:
        ap.error(f"--tokens {args.tokens} does not fit plain's context: prompt (budget - batch) + tokens must be "
                 f"<= budget + batch, i.e. --batch >= {math.ceil(args.tokens / 2)}")
    if args.kv_budget <= batch:
        ap.error(f"--kv-budget {args.kv_budget} must exceed n_batch {batch} (the prompt fills budget - n_batch)")
    policies = [p for p in args.policies.split(",") if p and p != "none"]
    for p in policies:
        if p not in REGISTRY:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(REGISTRY)}")
    names = list(BASELINES) + [p for p in policies if p not in BASELINES]

    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.eval.traces import default_dev_traces

    path = check_gguf(args.model) if args.model else default_model_path()
    traces = default_dev_traces()  # ../shared/data/r1_traces_dev.jsonl, else the packaged dev traces
    t_start = time.time()
    with Model(path) as model:
        text = "\n".join(json.loads(line)["trace"] for line in traces.read_text().splitlines()[:12])
        prompt = model.tokenize(text)[: args.kv_budget - batch]
        if len(prompt) < args.kv_budget - batch:
            print(f"bench_speed: warning: the traces give only {len(prompt)} prompt tokens "
                  f"(wanted {args.kv_budget - batch})", file=sys.stderr)
        specs = {v: variant_spec(v) for v in names}
        runs: dict[str, list[dict]] = {v: [] for v in names}
        one_run(model, specs["plain"], prompt, 8, args.kv_budget, batch, args.threads)  # warm-up
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for v in order:
                runs[v].append(one_run(model, specs[v], prompt, args.tokens, args.kv_budget, batch, args.threads))
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{v}={runs[v][-1]['tps']:.1f}" for v in names),
                  file=sys.stderr, flush=True)
        info = model.info
    summary = {}
    for v in names:
        tps = [x["tps"] for x in runs[v]]
        r_plain, ratios = median_ratio(runs[v], runs["plain"])
        r_nofa, ratios_nofa = median_ratio(runs[v], runs["plain-noFA"])
        rounds = sum(x["rounds"] for x in runs[v])
        summary[v] = {
            "policy": specs[v]["policy"],
            "flash_attn_requested": specs[v]["flash_attn"],
            "attention_readback": REGISTRY[specs[v]["policy"]].cls.needs_attention,
            "median_tokens_per_s": statistics.median(tps),
            "median_ratio_to_plain": r_plain,
            "median_ratio_to_plain_noFA": r_nofa,
            "ratios_to_plain": ratios,
            "ratios_to_plain_noFA": ratios_nofa,
            "tokens_per_s": tps,
            "evictions_per_run": runs[v][0]["n_evicted"],
            "eviction_rounds_per_run": runs[v][0]["rounds"],
            "mean_eviction_round_ms": 1000 * sum(x["evict_s"] for x in runs[v]) / rounds if rounds else None,
            "max_live_cells": max(x["max_live"] for x in runs[v]),
            "n_ctx": runs[v][0]["n_ctx"],
            "flash_attn_ran": (all(x["flash_attn"] for x in runs[v])
                                    if runs[v][0]["flash_attn"] is not None else None),
        }
    epikv_vs = {}
    if "epikv" in runs:
        for a in names:
            if REGISTRY[specs[a]["policy"]].cls.needs_attention:
                med, ratios = median_ratio(runs["epikv"], runs[a])
                epikv_vs[a] = {"median_speed_ratio": med, "ratios": ratios}
    out = {
        "benchmark": "decode tokens/s per policy at a fixed KV budget; ratios per round, measured side by side",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "git": git_rev(), "model": str(path), "model_desc": info.desc, "n_layer": info.n_layer,
        "n_embd": info.n_embd, "kv_budget": args.kv_budget, "n_batch": batch,
        "n_ctx_requested": args.kv_budget + batch, "n_ctx": runs["plain"][0]["n_ctx"],  # llama.cpp may pad it
        "prompt_tokens": len(prompt), "decoded_tokens": args.tokens, "rounds": args.rounds,
        "threads": args.threads or os.cpu_count(), "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_seconds": round(time.time() - t_start, 1),
        "variants": summary, "epikv_speed_vs_attention_policies": epikv_vs,
    }
    write_atomic(args.out, json.dumps(portable(out), indent=1) + "\n")

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"{'variant':14} {'FA':>3} {'tok/s':>8} {'/plain':>7} {'/noFA':>7} {'evicted/run':>12} {'ms/evict round':>15}")
    for v, s in summary.items():
        print(f"{v:14} {'on' if s['flash_attn_requested'] else 'off':>3} {s['median_tokens_per_s']:8.1f} "
              f"{fmt(s['median_ratio_to_plain'], '.3f'):>7} {fmt(s['median_ratio_to_plain_noFA'], '.3f'):>7} "
              f"{s['evictions_per_run']:12d} {fmt(s['mean_eviction_round_ms'], '.3f'):>15}")
    for a, e in epikv_vs.items():
        print(f"epikv vs {a}: {fmt(e['median_speed_ratio'], '.2f')}x the tokens/s (median of per-round ratios)")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench_speed", main))
