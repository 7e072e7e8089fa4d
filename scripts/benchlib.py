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
    optional ``route`` ("layer_out" | "callback"). Every run allocates the same context,
    ``context_cells(budget, n_batch)`` = budget + n_batch cells; policy ``none`` (the plain llama.cpp
    baseline) gets that whole context as its budget, so the generated tokens fill the slack beyond ``budget``.
    """
    from epikv_local.api.generation import generate
    from epikv_local.api.sampling import SamplingConfig
    from epikv_local.engine.budget import BudgetConfig, context_cells
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    n_ctx = context_cells(budget, n_batch)
    cfg = SessionConfig(n_batch=n_batch, n_threads=threads, flash_attn=spec["flash_attn"],
                        verify_flash_attn=spec["verify"], capture_route=spec.get("route", "layer_out"), n_ctx=n_ctx)
    bcfg = BudgetConfig(kv_budget=n_ctx if spec["policy"] == "none" else budget, protect_prompt=False)
    with Session(model, make_policy(spec["policy"]), bcfg, cfg) as s:
        res = generate(s, prompt, n_tokens, SamplingConfig(), ignore_eog=True)
        st = s.stats()
        return {"tps": res.stats.decode_tokens_per_s, "n_generated": res.stats.n_generated_tokens,
                "n_evicted": st.n_evicted, "rounds": st.n_rounds, "evict_s": st.evict_seconds,
                "max_live": st.max_live, "n_ctx": st.n_ctx,
                "flash_attn": st.flash_attn if spec["verify"] else None}


def median_ratio(a: list[dict], b: list[dict]) -> tuple[float | None, list[float]]:
    """Median of the per-round ratios a/b of tokens/s (rounds paired in order)."""
    ratios = [x["tps"] / y["tps"] for x, y in zip(a, b) if y["tps"] > 0]
    return (statistics.median(ratios) if ratios else None), ratios
