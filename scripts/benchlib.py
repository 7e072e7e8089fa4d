"""Shared pieces of the benchmark scripts: provenance (git revision, machine) and one timed decode run."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def git_rev() -> str:
    """HEAD's commit, with ``-dirty`` when tracked files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor(),
            "python": platform.python_version()}


def one_run(model, spec: dict, prompt: list[int], n_tokens: int, budget: int, n_batch: int,
            threads: int | None) -> dict:
    """Prefill ``prompt`` and decode ``n_tokens`` greedily under ``spec``; returns tokens/s and eviction stats.

    spec: ``policy`` (registry name), ``flash_attn`` (bool), ``verify`` (probe the graph for flash attention),
    optional ``route`` ("layer_out" | "callback"). Policy ``none`` uses the context's slack for the generated
    tokens (same n_ctx as the evicting runs: the plain llama.cpp baseline).
    """
    from epikv_local.eviction import BudgetConfig
    from epikv_local.generate import SamplingConfig, generate
    from epikv_local.policies import make_policy
    from epikv_local.session import Session, SessionConfig

    cfg = SessionConfig(n_batch=n_batch, n_threads=threads, flash_attn=spec["flash_attn"],
                        verify_flash_attn=spec["verify"], capture_route=spec.get("route", "layer_out"))
    bcfg = BudgetConfig(kv_budget=budget, protect_prompt=False)
    with Session(model, make_policy(spec["policy"]), bcfg, cfg) as s:
        if spec["policy"] == "none":
            s.engine.cfg = BudgetConfig(kv_budget=s.ctx.n_ctx, protect_prompt=False)
        res = generate(s, prompt, n_tokens, SamplingConfig(), ignore_eog=True)
        st = s.engine.stats
        return {"tps": res.stats.decode_tokens_per_s, "n_generated": res.stats.n_generated_tokens,
                "n_evicted": st.n_evicted, "rounds": st.n_rounds, "evict_s": st.evict_seconds,
                "max_live": st.max_live, "n_ctx": s.ctx.n_ctx,
                "flash_attn": bool(s.flash_attn) if spec["verify"] else None}


def median_ratio(a: list[dict], b: list[dict]) -> tuple[float | None, list[float]]:
    """Median of the per-round ratios a/b of tokens/s (rounds paired in order)."""
    ratios = [x["tps"] / y["tps"] for x, y in zip(a, b) if y["tps"] > 0]
    return (statistics.median(ratios) if ratios else None), ratios


def run_cli(main, prog: str, argv=None) -> int:
    """Run a script's main(argv); expected failures become one ``<prog>: error: ...`` line and exit status 2."""
    from epikv_local.native import NativeError

    try:
        return main(argv)
    except (ValueError, OSError, NativeError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
