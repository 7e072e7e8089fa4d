#!/usr/bin/env python3
"""The experimental patch patches/experimental/0005-cpu-flash-attn-f32-accumulator.patch (the CPU
flash-attention kernel accumulates an f16 V in f32) against upstream's f16 accumulator, side by side in one
run: does a sequence's output depend on where its cells lie, and what does the f32 accumulator cost?

The patch is not shipped (docs/parallel.md, "Batch invariance"): build it in first (append its name,
``experimental/0005-cpu-flash-attn-f32-accumulator.patch``, to patches/series and
``.venv/bin/python -m pip install .``). Both accumulators are then in the one library: ``EPIKV_FA_F16_ACC=1``
restores upstream's, so each mode runs in its own worker process (the kernel reads the variable once), in the
order f32, f16, f32, f16, ... Without the patch both modes are the same kernel: the script says so and stops.
Each worker measures, on the default model unless ``--model``:

- **layout**: per prompt, a greedy generation in a fresh pool (cells in position order) against the same
  prompt whose generated tokens land in the holes *before* its prompt's cells (another sequence filled them
  first and left); the second run is teacher-forced with the first one's tokens, so every step is compared:
  the share of steps with bit-identical logits, max |d logit|, and whether the free-running greedy tokens agree;
- **eviction**: four streams at a budget smaller than their text (StreamingLLM) decoded together and each
  alone: how many give the same greedy tokens (holes refilled by other sequences move the cells);
- **speed**: one sequence's decode tokens/s after a prefill of ``--ctx`` tokens of dev-trace text
  (attention over many cells is where the accumulator's cost shows).

    python scripts/bench_fa_accumulator.py --threads 2 --repeats 2 --ctx 2048 --speed-tokens 64 --tokens 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import dev_trace_text, provenance, save_json  # noqa: E402

PROG = "bench_fa_accumulator"
PROMPTS = ["Here are some notes about rivers, mountains and the weather in the north of the country:",
           "The capital of France is", "Once upon a time, a dragon", "def fibonacci(n):", "Water boils at",
           "A short history of the printing press begins", "To solve 3x + 7 = 22, first", "My favourite recipe is"]
FILLER = "one two three four five six seven eight nine ten " * 3


def greedy(s, prompt: list[int], n: int, forced: list[int] | None = None, after_prompt=None):
    """(tokens, (n, n_vocab) logits before each) of a greedy run; ``forced``: feed these tokens instead;
    ``after_prompt()`` is called once the prompt is decoded."""
    import numpy as np
    from epikv_local.engine.sampling import SamplingConfig

    rows, toks = [], []
    with s.generation(), s.sampling(SamplingConfig(temperature=0)) as smp:
        s.feed(prompt, is_prompt=True)
        if after_prompt is not None:
            after_prompt()
        for i in range(n):
            rows.append(s.logits().copy())
            t = s.sample(smp) if forced is None else forced[i]
            toks.append(t)
            s.decode_chunk([t])
    return toks, np.stack(rows)


def layout(model, cfg, n: int) -> dict:
    import numpy as np
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.pool import SequencePool
    from epikv_local.policies import make_policy

    steps = same_rows = agree = 0
    worst = 0.0
    for text in PROMPTS:
        prompt = model.tokenize(text)
        outs = []
        for holes, forced in ((False, None), (True, "plain"), (True, None)):
            pool = SequencePool(model, make_policy("streaming"), BudgetConfig(kv_budget=256), cfg, n_seq=2)
            other = pool.open()
            if holes:
                other.feed(model.tokenize(FILLER), is_prompt=False)
            s = pool.open()
            # ``other`` leaves once the prompt is decoded: its cells, before the prompt's, take the new tokens
            outs.append(greedy(s, prompt, n, outs[0][0] if forced else None, after_prompt=other.close))
            s.close()
            pool.close()
        (t0, r0), (_, r1), (t2, _) = outs
        d = np.abs(r0 - r1).max(axis=1)
        steps += len(d)
        same_rows += int((d == 0).sum())
        worst = max(worst, float(d.max()))
        agree += int(t0 == t2)
    return {"prompts": len(PROMPTS), "steps": steps, "bit_identical_steps": same_rows,
            "max_abs_dlogit": round(worst, 5), "greedy_runs_agreeing": agree}


def eviction(model, cfg, n: int) -> dict:
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.pool import SequencePool
    from epikv_local.engine.session import Session
    from epikv_local.policies import make_policy

    prompts = [model.tokenize(t) for t in PROMPTS[1:5]]
    budget = BudgetConfig(kv_budget=24)
    alone = []
    for p in prompts:
        with Session(model, make_policy("streaming"), budget, cfg) as s:
            alone.append(greedy(s, p, n)[0])
    pool = SequencePool(model, make_policy("streaming"), budget, cfg, n_seq=len(prompts))
    sessions = [pool.open() for _ in prompts]
    together: list = [None] * len(prompts)

    def one(i):
        together[i] = greedy(sessions[i], prompts[i], n)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sessions:
        s.close()
    pool.close()
    return {"streams": len(prompts), "budget": 24, "same_tokens_as_alone": sum(a == b for a, b in zip(alone, together))}


def speed(model, threads: int | None, ctx: int, n: int) -> dict:
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    text = dev_trace_text()
    tokens = model.tokenize(text)[:ctx + n]
    cfg = SessionConfig(n_batch=512, n_threads=threads)
    with Session(model, make_policy("streaming"), BudgetConfig(kv_budget=ctx + n), cfg) as s:
        s.feed(tokens[:ctx])
        t0 = time.perf_counter()
        for t in tokens[ctx:]:
            s.decode_chunk([t])
        dt = time.perf_counter() - t0
    return {"ctx": ctx, "tokens": n, "decode_tokens_per_s": round(n / dt, 2)}


def worker(args) -> dict:
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.engine.session import SessionConfig

    cfg = SessionConfig(n_batch=64, n_threads=args.threads)
    path = check_gguf(args.model) if args.model else default_model_path()
    with Model(path) as model:
        out = {"speed": speed(model, args.threads, args.ctx, args.speed_tokens)}
        if args.correctness:
            out["layout"] = layout(model, cfg, args.tokens)
            out["eviction"] = eviction(model, cfg, args.tokens)
    return out


def main(argv=None) -> int:
    from epikv_local.errors import ConfigError, NativeError

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=40, help="greedy tokens per layout / eviction run")
    ap.add_argument("--ctx", type=int, default=2048, help="cells attended to in the speed runs")
    ap.add_argument("--speed-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="worker pairs (f32, f16) for the speed figures")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=["f32", "f16"], help=argparse.SUPPRESS)
    ap.add_argument("--correctness", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("threads", "tokens", "ctx", "speed_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    runs: dict = {"f32": [], "f16": []}
    base = [sys.executable, str(Path(__file__).resolve()), "--threads", str(args.threads), "--tokens",
            str(args.tokens), "--ctx", str(args.ctx), "--speed-tokens", str(args.speed_tokens)]
    base += ["--model", args.model] if args.model else []
    for rep in range(args.repeats):
        for mode in ("f32", "f16"):
            env = {k: v for k, v in os.environ.items() if k != "EPIKV_FA_F16_ACC"}
            if mode == "f16":
                env["EPIKV_FA_F16_ACC"] = "1"
            cmd = base + ["--worker", mode] + (["--correctness"] if rep == 0 else [])
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise NativeError(f"the {mode} worker failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            runs[mode].append(r)
            print(f"{mode} run {rep + 1}: {json.dumps(r)}", flush=True)
        if rep == 0 and runs["f32"][0]["layout"] == runs["f16"][0]["layout"]:
            raise ConfigError("both accumulators gave the same logits: the library was built without "
                              "patches/experimental/0005-cpu-flash-attn-f32-accumulator.patch (see this script's doc)")
    tps = {m: [r["speed"]["decode_tokens_per_s"] for r in runs[m]] for m in runs}
    ratio = [a / b for a, b in zip(tps["f32"], tps["f16"])]
    summary = {"decode_tokens_per_s": tps, "f32_over_f16_speed": [round(x, 3) for x in ratio],
               "layout": {m: runs[m][0]["layout"] for m in runs}, "eviction": {m: runs[m][0]["eviction"] for m in runs}}
    print(json.dumps(summary, indent=1))
    save_json(args.out, {**provenance("bench_fa_accumulator.py", argv), "settings": vars(args), "runs": runs,
                         "summary": summary})
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
