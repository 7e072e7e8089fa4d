#!/usr/bin/env python3
"""Soak: a long generation at a small KV budget, RSS and live cells sampled; fails if RSS grows.

Generates ``--tokens`` tokens (default 65,536) with ``--policy`` under ``--kv-budget`` (ignoring
end-of-generation), samples the process's resident set size (VmRSS) and the live KV cells every
``--every`` tokens, and exits 1 when RSS after the warm-up (``--warmup`` tokens) ever exceeds the RSS at the
end of the warm-up by more than ``--max-growth`` (5 %), or when live cells ever exceed the budget. Too long
for CI at the default size: its committed result (results/soak.json) is the evidence.

    python scripts/soak.py --tokens 65536 --kv-budget 256 --threads 1 --out results/soak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import git_rev, machine  # noqa: E402

PROG = "soak"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv=None) -> int:
    from epikv_local.api.calibration import resolve_policy
    from epikv_local.api.chat import apply_chat_template, tokenize_prompt
    from epikv_local.api.generation import stream_generate
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.sampling import SamplingConfig
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.errors import ConfigError
    from epikv_local.eval.io import write_atomic

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--kv-budget", type=int, default=256)
    ap.add_argument("--policy", default="epikv")
    ap.add_argument("--every", type=int, default=1024, help="tokens between samples")
    ap.add_argument("--warmup", type=int, default=4096, help="tokens before the RSS reference is taken")
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampled, so the text does not loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.every < 1 or not 0 <= args.warmup < args.tokens:
        raise ConfigError("need --tokens >= 1, --every >= 1 and 0 <= --warmup < --tokens")
    model_path = check_gguf(args.model) if args.model else default_model_path()
    resolved = resolve_policy(args.policy, model_path, kv_budget=args.kv_budget)
    budget = BudgetConfig(kv_budget=args.kv_budget, recent_fraction=resolved.recent_fraction)
    samples, t0 = [], time.perf_counter()
    with Model(model_path) as model:
        prompt = tokenize_prompt(model, apply_chat_template(model, "Tell a very long story, chapter after chapter."))
        with Session(model, resolved.policy, budget, SessionConfig(n_threads=args.threads)) as s:
            for response in stream_generate(s, prompt, args.tokens,
                                            SamplingConfig(temperature=args.temperature, seed=1), ignore_eog=True):
                stats = response.stats
                n = stats.n_generated_tokens
                if n % args.every == 0 or n == args.warmup:
                    st = s.stats()
                    samples.append({"tokens": n, "rss_bytes": rss_bytes(), "live_cells": st.n_live,
                                    "n_evicted": st.n_evicted, "seconds": round(time.perf_counter() - t0, 1)})
                    print(f"{n:>7} tokens  RSS {samples[-1]['rss_bytes'] / 2**20:7.1f} MiB  live {st.n_live}",
                          flush=True)
            final = s.stats()
    ref = next(x["rss_bytes"] for x in samples if x["tokens"] >= args.warmup)
    after = [x["rss_bytes"] for x in samples if x["tokens"] > args.warmup]
    growth = (max(after) / ref - 1.0) if after else 0.0
    max_live = max(x["live_cells"] for x in samples)
    ok = growth <= args.max_growth and final.max_live <= args.kv_budget
    doc = {"command": "python scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "git_rev": git_rev(), "machine": machine(), "settings": vars(args), "model": Path(model_path).name,
           "rss_reference_bytes": ref, "rss_growth_after_warmup": round(growth, 4), "max_live_cells_sampled": max_live,
           "max_live_cells": final.max_live, "n_evicted": final.n_evicted, "passed": ok,
           "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2), "samples": samples}
    if args.out:
        from epikv_local.eval.provenance import portable

        write_atomic(args.out, json.dumps(portable(doc), indent=2) + "\n")
    print(f"RSS growth after warm-up {growth * 100:+.2f} % (limit {args.max_growth * 100:.0f} %), max live cells "
          f"{final.max_live} / {args.kv_budget}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
