#!/usr/bin/env python3
"""How one eviction round (score, select, remove) scales with the budget, and its share of a decode step.

For each budget the cache is filled to the budget (prefill of a real trace, chunks of 512, no protection),
then ``--tokens`` tokens are decoded one at a time with ``--evict-chunk`` positions evicted per round: the
mean wall time of a round (policy scoring + protection mask + the shared selection + llama.cpp's batched
removal) is compared with the mean decode step at that context size, side by side in one run.

    python scripts/bench_evict_scaling.py --budgets 1024,4096,16384,32768 --threads 2 --out results/evict_scaling.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import dev_trace_text, provenance, save_json  # noqa: E402

PROG = "bench_evict_scaling"


def one(model, tokens, budget: int, policy: str, n_tokens: int, evict_chunk: int, threads: int | None) -> dict:
    from epikv_local.api.calibration import resolve_policy
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.session import Session, SessionConfig

    pol = resolve_policy(policy, None).policy
    cfg = BudgetConfig(kv_budget=budget, n_sink=4, n_recent=64, protect_prompt=False, evict_chunk=evict_chunk)
    with Session(model, pol, cfg, SessionConfig(n_batch=512, n_threads=threads)) as s:
        t0 = time.perf_counter()
        s.feed(tokens[:budget])
        fill_s = time.perf_counter() - t0
        st0 = s.stats()
        step = []
        for t in tokens[budget:budget + n_tokens]:
            t1 = time.perf_counter()
            s.decode_chunk([t])
            step.append(time.perf_counter() - t1)
        st = s.stats()
    rounds = st.n_rounds - st0.n_rounds
    evict_s = st.evict_seconds - st0.evict_seconds
    mean_round = evict_s / rounds if rounds else float("nan")
    mean_step = sum(step) / len(step)
    return {"budget": budget, "policy": policy, "fill_seconds": round(fill_s, 2), "rounds": rounds,
            "mean_round_ms": round(mean_round * 1e3, 3), "mean_decode_step_ms": round(mean_step * 1e3, 3),
            "round_share_of_step": round(mean_round / mean_step, 4),
            "amortized_share": round(evict_s / sum(step), 4), "max_live": st.max_live}


def main(argv=None) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.errors import ConfigError, DataError

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--budgets", default="1024,4096,16384,32768")
    ap.add_argument("--policies", default="epikv,streaming")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps measured after the fill")
    ap.add_argument("--evict-chunk", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        budgets = [int(x) for x in args.budgets.split(",")]
    except ValueError:
        raise ConfigError(f"--budgets takes comma-separated integers, got {args.budgets!r}") from None
    model_path = check_gguf(args.model) if args.model else default_model_path()
    rows = []

    def save():  # after every row, atomically: a long run that is stopped keeps what it measured
        save_json(args.out, {**provenance("bench_evict_scaling.py", argv), "model": Path(model_path).name,
                             "settings": vars(args), "rows": rows})

    with Model(model_path) as model:
        text = dev_trace_text()
        tokens = model.tokenize(text)
        need = max(budgets) + args.tokens
        while len(tokens) < need:  # the dev traces hold ~150K tokens; repeat them if a budget asks for more
            tokens = tokens + tokens
        if not tokens:
            raise DataError("no trace text")
        for b in budgets:
            for p in args.policies.split(","):
                r = one(model, tokens, b, p, args.tokens, args.evict_chunk, args.threads)
                rows.append(r)
                save()
                print(f"budget {b:>6} {p:<10} round {r['mean_round_ms']:8.3f} ms  decode step "
                      f"{r['mean_decode_step_ms']:8.2f} ms  round/step {r['round_share_of_step'] * 100:5.1f} %  "
                      f"amortized {r['amortized_share'] * 100:5.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
