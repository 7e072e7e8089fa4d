#!/usr/bin/env python3
"""Decode-speed overhead of EPIKV (capture + scoring + eviction) against plain llama.cpp decoding.

All variants use the same patched build, the same model, the same budget-sized context
(n_ctx = kv_budget + n_batch), the same prompt and greedy decoding; they run alternately, several times,
in one process, and the script reports the median of the per-round ratios to ``plain``:

* ``plain``            policy none, no eval callback, no capture (llama.cpp as it is);
* ``plain+probe``      policy none with the idle eval callback that verifies flash attention;
* ``epikv/layer_out``  EPIKV, capture through the patched llama_set_layer_capture (the default);
* ``epikv/callback``   EPIKV, capture through the C eval callback (one graph split per captured layer);
* ``streaming``        StreamingLLM through the same engine (eviction cost without capture);
* ``facts``            EPIKV plus the digit marks and the numbers' tier (``policies/facts.py``; not run by default);
* ``said_prompt``      EPIKV plus the given marks and the prompt's tier (``policies/said.py``; not run by default);
* ``said_facts``       ``said_prompt`` plus the digit marks and the numbers' tier below the prompt's (not run by default);
* ``surprise``         the model's own surprisal of each token (``policies/surprise.py``: every token's logits, so the
                       prompt pays the output layer per token; not run by default);
* ``said_prompt_surprise`` EPIKV's capture plus every token's logits, the given marks and the prompt's tier ordered
                       by surprise (``policies/said.py``; not run by default);
* ``said_words``       ``said_prompt`` with the template's tokens last in the tier (the tier is re-ranked on every
                       eviction round whether or not the prompt carries a chat template's marks; not run by default);
* ``said_words_deep``  ``said_words`` reading every token's logits for its surprise slots once the caller's words
                       could overflow two tiers (the output layer per prompt token, as ``surprise``); this
                       script's prompt (kv_budget - n_batch tokens) fits, so it measures the case with none
                       (not run by default).

Steady state at equal occupancy: the prompt fills kv_budget - n_batch cells, then ``--tokens`` tokens are
decoded; plain decoding fills the context's slack, the evicting policies hold it at the budget.
Results: ``results/overhead.json`` (with the command, git revision and machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, git_rev, machine, median_ratio, one_run  # noqa: E402

from epikv_local.errors import ConfigError, run_main  # noqa: E402
from epikv_local.eval.io import write_atomic  # noqa: E402
from epikv_local.eval.provenance import portable  # noqa: E402

VARIANTS = {
    "plain": dict(policy="none", flash_attn=True, route="layer_out", verify=False),
    "plain+probe": dict(policy="none", flash_attn=True, route="layer_out", verify=True),
    "epikv/layer_out": dict(policy="epikv", flash_attn=True, route="layer_out", verify=True),
    "epikv/callback": dict(policy="epikv", flash_attn=True, route="callback", verify=True),
    "streaming": dict(policy="streaming", flash_attn=True, route="layer_out", verify=True),
    "facts": dict(policy="facts", flash_attn=True, route="layer_out", verify=True),
    "said_prompt": dict(policy="said_prompt", flash_attn=True, route="layer_out", verify=True),
    "said_facts": dict(policy="said_facts", flash_attn=True, route="layer_out", verify=True),
    "epikv_span": dict(policy="epikv_span", flash_attn=True, route="layer_out", verify=True),
    "surprise": dict(policy="surprise", flash_attn=True, route="layer_out", verify=True),
    "said_prompt_surprise": dict(policy="said_prompt_surprise", flash_attn=True, route="layer_out", verify=True),
    "said_words": dict(policy="said_words", flash_attn=True, route="layer_out", verify=True),
    "said_words_deep": dict(policy="said_words_deep", flash_attn=True, route="layer_out", verify=True),
}
#: variants of one policy each, run when named (``--variants``), not by default
EXTRA = ("facts", "said_prompt", "said_facts", "epikv_span", "surprise", "said_prompt_surprise", "said_words",
         "said_words_deep")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--kv-budget", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per run")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds over all variants")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in EXTRA))
    ap.add_argument("--out", default=str(ROOT / "results" / "overhead.json"))
    args = ap.parse_args(argv)

    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.eval.traces import default_dev_traces

    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise ConfigError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    path = check_gguf(args.model) if args.model else default_model_path()
    traces = default_dev_traces()  # ../shared/data/r1_traces_dev.jsonl, else the packaged dev traces
    with Model(path) as model:
        text = "\n".join(json.loads(line)["trace"] for line in traces.read_text().splitlines()[:6])
        prompt = model.tokenize(text)[: args.kv_budget - args.batch]
        runs: dict[str, list[dict]] = {v: [] for v in names}
        one_run(model, VARIANTS[names[0]], prompt, 16, args.kv_budget, args.batch, args.threads)  # warm-up
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for v in order:
                runs[v].append(one_run(model, VARIANTS[v], prompt, args.tokens, args.kv_budget, args.batch,
                                       args.threads))
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{v}={runs[v][-1]['tps']:.1f}" for v in names),
                  file=sys.stderr)
    summary = {}
    for v in names:
        tps = [x["tps"] for x in runs[v]]
        ratio, ratios = median_ratio(runs[v], runs["plain"]) if "plain" in runs else (None, [])
        pre, _ = median_ratio(runs[v], runs["plain"], "prefill_tps") if "plain" in runs else (None, [])
        rounds = sum(x["rounds"] for x in runs[v])
        summary[v] = {
            "median_tokens_per_s": statistics.median(tps),
            "median_ratio_to_plain": ratio,
            "ratios": ratios,
            "median_prefill_tokens_per_s": statistics.median(x["prefill_tps"] for x in runs[v]),
            "median_prefill_ratio_to_plain": pre,
            "tokens_per_s": tps,
            "evictions_per_run": runs[v][0]["n_evicted"],
            "mean_eviction_round_ms": 1000 * sum(x["evict_s"] for x in runs[v]) / rounds if rounds else None,
            "max_live_cells": max(x["max_live"] for x in runs[v]),
            "n_ctx": runs[v][0]["n_ctx"],
            "flash_attn": all(x["flash_attn"] for x in runs[v]) if runs[v][0]["flash_attn"] is not None else None,
        }
    out = {
        "benchmark": "decode overhead, ratios to plain measured side by side in one process",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
        "git": git_rev(), "model": str(path), "kv_budget": args.kv_budget, "n_batch": args.batch,
        "prompt_tokens": len(prompt), "decoded_tokens": args.tokens, "rounds": args.rounds,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "variants": summary,
    }
    write_atomic(args.out, json.dumps(portable(out), indent=1) + "\n")
    print(f"{'variant':18} {'tok/s':>8} {'ratio':>7} {'prefill':>8} {'evicted/run':>12} {'ms/evict round':>15}")
    for v, s in summary.items():
        ratio = f"{s['median_ratio_to_plain']:.3f}" if s["median_ratio_to_plain"] is not None else "-"
        ms = f"{s['mean_eviction_round_ms']:.3f}" if s["mean_eviction_round_ms"] is not None else "-"
        pre = f"{s['median_prefill_ratio_to_plain']:.3f}" if s["median_prefill_ratio_to_plain"] is not None else "-"
        print(f"{v:18} {s['median_tokens_per_s']:8.1f} {ratio:>7} {pre:>8} {s['evictions_per_run']:12d} {ms:>15}")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench_overhead", main))
