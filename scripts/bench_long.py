#!/usr/bin/env python3
"""Long generation: decode speed and memory stay flat under eviction (or grow without it).

Generates ``--tokens`` greedy tokens (``ignore_eog``) with ``stream_generate`` from a short prompt (text from
the shared R1 traces) and samples every ``--every`` tokens: tokens/s over the last interval (wall clock of
the loop, and decode time alone), resident memory of the process (VmRSS from /proc/self/status on Linux,
``resource.getrusage`` max RSS elsewhere), live KV cells, KV bytes allocated and the eviction
counters (all from ``Session.stats()``).

* ``--policy epikv`` (default; any registered policy): the context holds ``--kv-budget`` cells + one batch.
* ``--full-cache``: policy none with kv_budget = prompt + tokens (the context is sized to hold everything;
  llama.cpp allocates it when the context is created). It runs as far as it can: it stops at
  ``--max-seconds`` or when allocation/decoding fails, and records how far it got.

Output: one JSON row per sample in ``results/long_<label>.jsonl`` (flushed as it goes, so an interrupted run
keeps its rows) and a summary ``results/long_<label>.summary.json`` (command, git revision, machine, final
numbers, eviction-round cost, stop reason).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, git_rev, machine  # noqa: E402

from epikv_local.errors import EpikvError, run_main  # noqa: E402


def rss_bytes() -> tuple[int, str]:
    """Current resident set size (VmRSS) in bytes, or the peak (ru_maxrss) where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, "VmRSS"
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), "ru_maxrss"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--policy", default="epikv")
    ap.add_argument("--full-cache", action="store_true",
                    help="policy none, context sized for prompt + tokens (no eviction), as far as it can go")
    ap.add_argument("--kv-budget", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--every", type=int, default=1024, help="sample every this many generated tokens")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (capped at kv_budget // 2)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-seconds", type=float, default=900.0,
                    help="stop after this long (full-cache mode only; 0 = no limit)")
    ap.add_argument("--label", default=None, help="output label (default: the policy, or full_cache)")
    ap.add_argument("--out-dir", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.every < 1:
        ap.error("--tokens and --every must be >= 1")

    from epikv_local.api.generation import GenerationStats, stream_generate
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.sampling import SamplingConfig
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.eval.traces import default_dev_traces
    from epikv_local.policies import REGISTRY, make_policy

    policy_name = "none" if args.full_cache else args.policy
    if policy_name not in REGISTRY:
        ap.error(f"unknown policy {policy_name!r}; choose from {', '.join(REGISTRY)}")
    if policy_name == "none" and not args.full_cache:
        ap.error("policy none cannot hold a budget: use --full-cache")
    label = args.label or ("full_cache" if args.full_cache else policy_name)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / f"long_{label}.jsonl"
    summary_path = out_dir / f"long_{label}.summary.json"
    max_seconds = args.max_seconds if args.full_cache and args.max_seconds > 0 else None

    path = check_gguf(args.model) if args.model else default_model_path()
    traces = default_dev_traces()  # ../shared/data/r1_traces_dev.jsonl, else the packaged dev traces
    rss0, rss_src = rss_bytes()
    summary: dict = {
        "benchmark": "long generation: tokens/s and memory sampled along the run",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "git": git_rev(), "model": str(path), "policy": policy_name, "full_cache": args.full_cache,
        "requested_tokens": args.tokens, "every": args.every, "n_batch": args.batch,
        "threads": args.threads or os.cpu_count(), "max_seconds": max_seconds,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rss_source": rss_src, "rss_before_model_bytes": rss0,
        "rows": str(rows_path),
    }
    n = 0
    stop_reason = "max_tokens"
    t_start = time.perf_counter()
    with Model(path) as model, open(rows_path, "w") as rows_f:
        text = "\n".join(json.loads(line)["trace"] for line in traces.read_text().splitlines()[:2])
        prompt_len = args.prompt_tokens if args.full_cache else min(args.prompt_tokens, args.kv_budget // 2)
        prompt = model.tokenize(text)[:prompt_len]
        budget = len(prompt) + args.tokens if args.full_cache else args.kv_budget
        summary.update(kv_budget=budget, prompt_tokens=len(prompt), model_desc=model.info.desc,
                       rss_after_model_bytes=rss_bytes()[0])
        cfg = SessionConfig(n_batch=args.batch, n_threads=args.threads,
                            flash_attn=not REGISTRY[policy_name].cls.needs_attention)
        bcfg = BudgetConfig(kv_budget=budget, protect_prompt=False)
        session = None
        try:
            session = Session(model, make_policy(policy_name), bcfg, cfg)
        except (MemoryError, EpikvError) as e:  # allocation of a huge full-cache context fails here
            stop_reason = f"context allocation failed: {type(e).__name__}: {e}"
        if session is not None:
            with session:
                # replaced by each item's statistics; this empty one stands until the first token
                stats = GenerationStats(policy=policy_name, kv_budget=budget, n_prompt_tokens=len(prompt))

                def sample(elapsed: float, d_tokens: int, d_wall: float, d_decode: float, final: bool = False):
                    st = session.stats()
                    rss, _ = rss_bytes()
                    row = {
                        "tokens": n, "elapsed_s": round(elapsed, 3),
                        "interval_tokens": d_tokens,
                        "interval_tokens_per_s": round(d_tokens / d_wall, 3) if d_tokens and d_wall > 0 else None,
                        "interval_decode_tokens_per_s": (round(d_tokens / d_decode, 3)
                                                         if d_tokens and d_decode > 0 else None),
                        "rss_bytes": rss, "live_cells": st.n_live, "kv_bytes": st.kv_bytes,
                        "n_ctx": st.n_ctx, "n_evicted": st.n_evicted, "eviction_rounds": st.n_rounds,
                        "evict_seconds": round(st.evict_seconds, 4), "final": final,
                    }
                    rows_f.write(json.dumps(row) + "\n")
                    rows_f.flush()
                    return row

                gen = stream_generate(session, prompt, args.tokens, SamplingConfig(), ignore_eog=True)
                t_last = t_loop = None
                dec_last = 0.0
                n_last = 0
                last_row = None
                try:
                    for response in gen:  # each item carries the statistics as of its token
                        stats = response.stats
                        now = time.perf_counter()
                        if t_loop is None:  # first token: the prompt has been prefilled
                            t_loop = t_last = now
                            summary["prefill_seconds"] = round(stats.prefill_seconds, 3)
                            sample(now - t_start, 0, 0.0, 0.0)
                        n += 1
                        if n % args.every == 0:
                            last_row = sample(now - t_start, n - n_last, now - t_last, stats.decode_seconds - dec_last)
                            print(f"{n:7d} tokens  {last_row['interval_tokens_per_s'] or 0:8.1f} tok/s  "
                                  f"rss {last_row['rss_bytes'] / 2**20:8.1f} MiB  live {last_row['live_cells']}",
                                  file=sys.stderr, flush=True)
                            t_last, dec_last, n_last = now, stats.decode_seconds, n
                        if max_seconds is not None and now - t_loop > max_seconds:
                            stop_reason = "max_seconds"
                            break
                except (MemoryError, EpikvError) as e:  # KVFullError/NativeError/BudgetError
                    stop_reason = f"failed: {type(e).__name__}: {e}"
                finally:
                    gen.close()
                now = time.perf_counter()
                if t_loop is not None and n != n_last:
                    last_row = sample(now - t_start, n - n_last, now - t_last, stats.decode_seconds - dec_last,
                                      final=True)
                st = session.stats()
                summary.update(
                    generated_tokens=n,
                    decode_seconds=round(stats.decode_seconds, 3),
                    mean_decode_tokens_per_s=round(n / stats.decode_seconds, 3) if stats.decode_seconds > 0 else None,
                    last_interval_tokens_per_s=last_row["interval_tokens_per_s"] if last_row else None,
                    final_rss_bytes=rss_bytes()[0],
                    final_live_cells=st.n_live, max_live_cells=st.max_live,
                    kv_bytes=st.kv_bytes, n_ctx=st.n_ctx,
                    n_evicted=st.n_evicted, eviction_rounds=st.n_rounds,
                    mean_eviction_round_ms=(round(1000 * st.evict_seconds / st.n_rounds, 4)
                                            if st.n_rounds else None),
                    eviction_seconds_total=round(st.evict_seconds, 3),
                )
    summary.setdefault("generated_tokens", n)
    summary["stop_reason"] = stop_reason
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    summary["peak_rss_bytes"] = max(_peak_rss(), summary.get("final_rss_bytes", 0))
    from epikv_local.eval.provenance import portable

    summary_path.write_text(json.dumps(portable(summary), indent=1) + "\n")
    print(f"{label}: {n} tokens, stop: {stop_reason}; mean {summary.get('mean_decode_tokens_per_s')} tok/s, "
          f"last interval {summary.get('last_interval_tokens_per_s')} tok/s, "
          f"rss {summary.get('final_rss_bytes', 0) / 2**20:.1f} MiB, kv {summary.get('kv_bytes', 0) / 2**20:.1f} MiB, "
          f"max live {summary.get('max_live_cells')}, eviction round {summary.get('mean_eviction_round_ms')} ms")
    print(f"written {rows_path} and {summary_path}")
    return 0


def _peak_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


if __name__ == "__main__":
    sys.exit(run_main("bench_long", main))
