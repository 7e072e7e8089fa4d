#!/usr/bin/env python3
"""Plain decode speed with one CPU core busy, for thread-count / OpenMP wait-policy settings, side by side.

A desktop always has another program running. llama.cpp's CPU backend runs its threads through OpenMP
(libgomp), whose threads spin at every barrier by default: when a neighbour holds one core, a thread that
is descheduled stalls all the others. This benchmark starts a ``yes > /dev/null`` neighbour (and stops it),
then measures plain decoding (policy ``none``, greedy, the default model) in a fresh process per setting
(libgomp reads its environment once), alternating settings over ``--rounds`` rounds, and also without the
neighbour. Settings: ``old`` (all CPUs: the previous default), ``new`` (this package's default,
``handles.resolve_threads``), and alternatives that keep every CPU but make libgomp's threads wait
differently (``OMP_WAIT_POLICY=passive``: sleep at once; ``GOMP_SPINCOUNT=10000``: spin briefly).

    python scripts/bench_busy.py --rounds 3 --tokens 64 --out results/busy_core.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import provenance, save_json  # noqa: E402

PROG = "bench_busy"
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from epikv_local.engine.native import load
from epikv_local.engine.handles import Model, resolve_threads
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.api.generation import generate
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.policies import make_policy
model_path, n_tokens, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
threads = None if threads == "default" else int(threads)
with Model(model_path) as m:
    toks = m.tokenize("The history of the printing press begins")
    cfg = SessionConfig(n_threads=threads, n_batch=32)
    with Session(m, make_policy("none"), BudgetConfig(kv_budget=512, protect_prompt=False), cfg) as s:
        generate(s, toks, 8, SamplingConfig(), ignore_eog=True)  # warm-up
    with Session(m, make_policy("none"), BudgetConfig(kv_budget=512, protect_prompt=False), cfg) as s:
        res = generate(s, toks, n_tokens, SamplingConfig(), ignore_eog=True)
print(json.dumps({"tps": res.stats.decode_tokens_per_s, "threads": s.ctx.n_threads}))
"""


def settings(n_cpu: int) -> dict[str, dict]:
    """name -> (threads argument, extra environment)."""
    return {
        "old": {"threads": str(n_cpu), "env": {}},
        "new": {"threads": "default", "env": {}},
        f"{n_cpu}t_passive": {"threads": str(n_cpu), "env": {"OMP_WAIT_POLICY": "passive"}},
        f"{n_cpu}t_spin10k": {"threads": str(n_cpu), "env": {"GOMP_SPINCOUNT": "10000"}},
    }


def run_child(model_path: str, n_tokens: int, spec: dict, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(spec["env"])
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, model_path, str(n_tokens), spec["threads"]], env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tps": n_tokens / timeout, "timed_out": True, "wall_s": timeout}
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"child exit {r.returncode}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv=None) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.errors import ConfigError

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a measurement counts as a stall")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.tokens < 1:
        raise ConfigError("--rounds and --tokens must be >= 1")
    model_path = str(Path(args.model).expanduser() if args.model else default_model_path())
    n_cpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    specs = settings(n_cpu)
    results: dict[str, dict[str, list]] = {cond: {name: [] for name in specs} for cond in ("busy", "idle")}
    for cond in ("busy", "idle"):
        for rnd in range(args.rounds):
            neighbour = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if cond == "busy" else None
            try:
                for name, spec in specs.items():
                    r = run_child(model_path, args.tokens, spec, args.timeout)
                    results[cond][name].append(r)
                    print(f"{cond} round {rnd + 1}: {name:<12} {r['tps']:8.2f} tok/s", flush=True)
            finally:
                if neighbour is not None:
                    neighbour.terminate()
                    neighbour.wait()
    summary = {cond: {name: statistics.median(x["tps"] for x in rows) for name, rows in per.items()}
               for cond, per in results.items()}
    ratio = {cond: summary[cond]["new"] / summary[cond]["old"] for cond in summary}
    print(f"median tok/s busy: old {summary['busy']['old']:.2f}, new {summary['busy']['new']:.2f} "
          f"({ratio['busy']:.1f}x); idle: old {summary['idle']['old']:.2f}, new {summary['idle']['new']:.2f} "
          f"({ratio['idle']:.2f}x)")
    save_json(args.out, {**provenance("bench_busy.py", argv), "n_cpu": n_cpu, "settings": specs,
                         "tokens": args.tokens, "median_tokens_per_s": summary, "new_over_old": ratio,
                         "rounds": results})
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
