"""The measurements: per variant (plain, epikv, streaming, h2o) a growing sequence on the benchmark model with a
greedy decode at each checkpoint (speed, eviction rounds, cells, KV bytes, memory), the longest context each
reaches within its time cap, and the tables built from them (per context, longest context, console summary)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from epikv_local.errors import EpikvError

from .common import log, mib
from .facts import memory_now, proc_kib
from .presets import VARIANTS, Preset

if TYPE_CHECKING:
    from .run import Run


def checkpoints(contexts: list[int], max_context: int) -> list[int]:
    """The contexts, then doubling lengths up to max_context (the longest-context search)."""
    pts = sorted(set(contexts))
    while pts[-1] * 2 <= max_context:
        pts.append(pts[-1] * 2)
    if pts[-1] < max_context:
        pts.append(max_context)
    return pts


def measure_decode(session, n: int, on_gpu: bool) -> dict:
    """Greedy-decode n tokens (eviction on) and time them, up to the last decode's completion."""
    import numpy as np

    st0 = session.stats()
    t0 = time.perf_counter()
    for _ in range(n):
        session.decode_chunk([int(np.argmax(session.logits()))])
    session.logits()  # waits for the last decode
    dt = time.perf_counter() - t0
    st1 = session.stats()
    rounds = st1.n_rounds - st0.n_rounds
    evict_s = st1.evict_seconds - st0.evict_seconds
    cells = session.ctx.cell_positions()
    return {"context": st0.n_past, "decode_tokens": n, "decode_seconds": round(dt, 4),
            "decode_tokens_per_s": n / dt if dt > 0 else None, "eviction_rounds": rounds,
            "mean_eviction_round_ms": 1000 * evict_s / rounds if rounds else None, "live_cells": st1.n_live,
            "cells_in_cache": int((cells >= 0).sum()), "max_live": st1.max_live, "kv_bytes": st1.kv_bytes,
            **memory_now(on_gpu)}


def grow(model, p: Preset, name: str, n_ctx: int, targets: list[int], stop_at: float, on_gpu: bool,
         t_start: float, progress=None, seed: int = 0) -> dict:
    """One session, one growing sequence: prefill (random tokens, ``p.n_batch`` at a time) to each target and
    decode ``p.decode_tokens`` there; stop at the first of the time cap (``stop_at``, wall clock), a full cache
    (plain) or the last target. Returns its checkpoints, counters and why it stopped."""
    import numpy as np

    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    policy, fa = VARIANTS[name]
    evicts = policy != "none"
    out: dict = {"n_ctx_requested": n_ctx, "checkpoints": [], "error": None}
    try:
        session = Session(model, make_policy(policy),
                          BudgetConfig(kv_budget=p.budget if evicts else n_ctx, protect_prompt=False),
                          SessionConfig(n_batch=p.n_batch, flash_attn=fa, verify_flash_attn=True, n_ctx=n_ctx,
                                        n_threads=p.threads))
    except EpikvError as e:  # e.g. a plain cache that does not fit
        out.update(error=f"{type(e).__name__}: {e}", tokens=0, stop_reason="allocation_failed")
        return out
    vocab = model.info.n_vocab
    lo = min(1000, vocab // 4)  # random ordinary tokens, clear of the special tokens at either end
    hi = max(lo + 1, min(vocab - 1000, 100000))
    rng = np.random.default_rng(seed)
    prefill_s, prefill_tokens, reason = 0.0, 0, "max_context"
    with session as s:
        try:
            for target in targets:
                while s.n_past < target:
                    if time.time() >= stop_at:
                        reason = "time_cap"
                        break
                    n = min(p.n_batch, target - s.n_past)
                    if not evicts and s.n_past + n + p.decode_tokens > s.ctx.n_ctx:
                        reason = "cache_full"
                        break
                    t0 = time.perf_counter()
                    s.feed(rng.integers(lo, hi, size=n).tolist())
                    prefill_s += time.perf_counter() - t0
                    prefill_tokens += n
                if s.n_past < target:
                    break
                cp = measure_decode(s, p.decode_tokens, on_gpu)
                cp.update(phase="context" if target in p.contexts else "search",
                          elapsed_s=round(time.perf_counter() - t_start, 2))
                out["checkpoints"].append(cp)
                if progress:
                    progress(name, cp)
            last = out["checkpoints"][-1]["context"] if out["checkpoints"] else -1
            if reason != "max_context" and s.n_past > last + p.decode_tokens:
                cp = measure_decode(s, p.decode_tokens, on_gpu)  # the speed where the sequence stopped
                cp.update(phase="stop", elapsed_s=round(time.perf_counter() - t_start, 2))
                out["checkpoints"].append(cp)
        except EpikvError as e:
            out["error"] = f"{type(e).__name__}: {e}"
            reason = "error"
        st = s.stats()
        out.update(n_ctx=st.n_ctx, kv_bytes=st.kv_bytes, flash_attn_ran=s.flash_attn, capture_layers=list(s.layers),
                   max_live=st.max_live, n_evicted=st.n_evicted, eviction_rounds=st.n_rounds,
                   evict_seconds=st.evict_seconds, prefill_tokens=prefill_tokens, prefill_seconds=prefill_s,
                   tokens=st.n_past, stop_reason=reason)
    return out


def run_variant(model, name: str, p: Preset, stop_at: float, on_gpu: bool, progress=None) -> dict:
    """A variant's checkpoints and longest context.

    Evicting variants: one session (a cache of budget + one ubatch) whose sequence grows through every context,
    then through the search checkpoints. Plain: one session per context with a cache of exactly that context
    (+ the decoded tokens + one ubatch), so that its memory is what that context needs, then one session with
    a cache for ``max_context`` for the search (its sequence starts again from 0)."""
    policy, fa = VARIANTS[name]
    evicts = policy != "none"
    pts = checkpoints(p.contexts, p.max_context)
    t_start = time.perf_counter()
    if evicts:
        sessions = [grow(model, p, name, p.budget + p.n_batch, pts, stop_at, on_gpu, t_start, progress)]
    else:
        sessions = []
        for c in p.contexts:
            sessions.append(grow(model, p, name, c + p.decode_tokens + p.n_batch, [c], stop_at, on_gpu, t_start,
                                 progress))
            if sessions[-1]["stop_reason"] != "max_context":
                break
        else:
            search = [t for t in pts if t > max(p.contexts)]
            if search:
                n_ctx = p.max_context + p.decode_tokens * (len(search) + 1) + p.n_batch
                sessions.append(grow(model, p, name, n_ctx, search, stop_at, on_gpu, t_start, progress, seed=1))
    last = sessions[-1]
    done = [x for x in sessions if "n_ctx" in x]
    rounds = sum(x["eviction_rounds"] for x in done)
    prefill_s = sum(x["prefill_seconds"] for x in done)
    prefill_tokens = sum(x["prefill_tokens"] for x in done)
    errors = [x["error"] for x in sessions if x["error"]]
    rec = {
        "variant": name, "policy": policy, "flash_attn_requested": fa, "kv_budget": p.budget if evicts else None,
        "sessions": [{k: x.get(k) for k in ("n_ctx_requested", "n_ctx", "kv_bytes", "tokens", "stop_reason")}
                     for x in sessions],
        "checkpoints": [cp for x in sessions for cp in x["checkpoints"]],
        "error": "; ".join(errors) if errors else None,
        "n_ctx": max((x["n_ctx"] for x in done), default=None),
        "kv_bytes": max((x["kv_bytes"] for x in done), default=None),
        "kv_bytes_per_cell": done[0]["kv_bytes"] / done[0]["n_ctx"] if done else None,
        "flash_attn_ran": all(x["flash_attn_ran"] for x in done) if done else None,
        "capture_layers": done[0]["capture_layers"] if done else [],
        "max_live": max((x["max_live"] for x in done), default=0),
        "n_evicted": sum(x["n_evicted"] for x in done), "eviction_rounds": rounds,
        "mean_eviction_round_ms": 1000 * sum(x["evict_seconds"] for x in done) / rounds if rounds else None,
        "budget_respected": all(x["max_live"] <= (p.budget if evicts else x["n_ctx"]) for x in done),
        "prefill_tokens": prefill_tokens, "prefill_seconds": round(prefill_s, 3),
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
        "longest_context": {"tokens": max((x.get("tokens", 0) for x in sessions), default=0),
                            "stop_reason": last["stop_reason"], "seconds": round(time.perf_counter() - t_start, 2)},
    }
    return rec


def context_table(variants: dict, p: Preset) -> dict:
    """context -> variant -> the figures at that context (``reached`` false, with why, when it was not)."""
    table = {}
    for c in p.contexts:
        row = {}
        for name in VARIANTS:
            v = variants.get(name) or {}
            cp = next((x for x in v.get("checkpoints", []) if x["context"] == c), None)
            if cp is None:
                row[name] = {"reached": False, "why": "not run" if not v else
                             (v.get("error") or v.get("longest_context", {}).get("stop_reason"))}
                continue
            ms = cp["mean_eviction_round_ms"]
            row[name] = {"reached": True, "decode_tokens_per_s": cp["decode_tokens_per_s"],
                         "mean_eviction_round_ms": ms if ms is not None else v.get("mean_eviction_round_ms"),
                         "live_cells": cp["live_cells"], "max_live": cp["max_live"], "kv_bytes": cp["kv_bytes"],
                         "vram_used_mib": cp["vram_used_mib"], "rss_mib": cp["rss_mib"],
                         "flash_attn_requested": v.get("flash_attn_requested"),
                         "flash_attn_ran": v.get("flash_attn_ran"), "kv_budget": v.get("kv_budget")}
        table[str(c)] = row
    return table


def longest_summary(variants: dict, on_gpu: bool, gpu_total_mib: float | None) -> dict:
    """variant -> the longest context it reached and why it stopped; plain adds the context its KV cache could
    reach in the memory (computed, and labelled so)."""
    out = {}
    for name, v in variants.items():
        lc = {**v.get("longest_context", {}), "variant_cap_s": v.get("cap_s")}
        last = (v.get("checkpoints") or [{}])[-1]
        if v.get("policy") == "none" and v.get("kv_bytes_per_cell"):
            # computed, not measured: the cells of this model's KV cache that the memory would hold
            if on_gpu and gpu_total_mib and last.get("vram_used_mib") is not None:
                other = last["vram_used_mib"] - v["kv_bytes"] / 2**20  # model, compute buffers, CUDA context
                lc["computed_max_context_by_memory"] = int((gpu_total_mib - other) * 2**20 / v["kv_bytes_per_cell"])
                lc["computed_from"] = "(GPU memory total - memory used besides this KV cache) / KV bytes per cell"
            elif not on_gpu and proc_kib("/proc/meminfo", "MemAvailable"):
                avail = proc_kib("/proc/meminfo", "MemAvailable")
                lc["computed_max_context_by_memory"] = int(avail * 2**20 / v["kv_bytes_per_cell"])
                lc["computed_from"] = "host MemAvailable / KV bytes per cell"
        elif v.get("kv_budget"):
            lc["kv_memory"] = f"fixed: {v['kv_budget']} live cells, {mib(v.get('kv_bytes', 0))} MiB allocated"
        out[name] = lc
    return out


def measure(run: Run, p: Preset, bench_path: Path, on_gpu: bool) -> None:
    """The four variants on the benchmark model, each capped so that the rest still fit before the deadline;
    the report is saved after each."""
    from epikv_local.engine.handles import Model

    report = run.report
    gpu_total = (report["machine"].get("gpu") or {}).get("memory_total_mib")
    report["memory_before_model_load"] = memory_now(on_gpu)
    with Model(bench_path, n_gpu_layers=-1 if on_gpu else 0) as model:
        info = model.info
        report["bench_model"].update({"desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd,
                                      "n_head": info.n_head, "n_head_kv": info.n_head_kv, "n_vocab": info.n_vocab})
        report["memory_after_model_load"] = memory_now(on_gpu)
        names = list(VARIANTS)
        for i, name in enumerate(names):
            cap = min(p.variant_cap_s, (run.left() - 5) / (len(names) - i))
            if cap < 1.0:
                report["variants"][name] = {"variant": name, "policy": VARIANTS[name][0], "checkpoints": [],
                                            "error": "skipped: the run's deadline", "cap_s": round(cap, 1)}
                report["errors"].append(f"{name}: skipped, deadline")
                run.failed = True
                continue
            log(f"variant {name}: cap {cap:.1f} s")

            def progress(v, cp):
                mem = f", VRAM {cp['vram_used_mib']:.0f} MiB" if cp["vram_used_mib"] is not None else ""
                log(f"  {v} @ {cp['context']}: {cp['decode_tokens_per_s']:.1f} tok/s, live {cp['live_cells']}{mem}")

            try:
                rec = run_variant(model, name, p, time.time() + cap, on_gpu, progress)
            except Exception as e:  # noqa: BLE001 -- recorded; the other variants still run
                rec = {"variant": name, "policy": VARIANTS[name][0], "checkpoints": [],
                       "error": f"{type(e).__name__}: {e}", "longest_context": {"tokens": 0, "stop_reason": "error"}}
            rec["cap_s"] = round(cap, 1)
            report["variants"][name] = rec
            if rec.get("error"):
                report["errors"].append(f"{name}: {rec['error']}")
                run.failed = True
            lc = rec["longest_context"]
            log(f"  {name}: {lc['tokens']} tokens ({lc['stop_reason']}), flash attention ran: "
                f"{rec.get('flash_attn_ran')}, budget respected: {rec.get('budget_respected')}")
            report["contexts"] = context_table(report["variants"], p)
            report["longest_context"] = longest_summary(report["variants"], on_gpu, gpu_total)
            run.save()
    for c, row in report["contexts"].items():
        missing = [v for v, e in row.items() if not e["reached"]]
        if missing:
            report["notes"].append(f"context {c}: not reached by {', '.join(missing)} within the caps")


def print_summary(report: dict) -> None:
    """The per-context table and the longest contexts, on the console (the log beside the JSON)."""
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    gpu = report["mode"] == "gpu"
    s = report["settings"]
    print(f"\n{report['mode'].upper()} mode -- decode tokens/s at each context (budget {s['budget']}, "
          f"{s['decode_tokens']} greedy tokens per point)")
    mem = "VRAM MiB" if gpu else "RSS MiB"
    print(f"{'context':>8} {'variant':10} {'tok/s':>9} {'ms/evict':>9} {'live':>7} {'KV MiB':>9} {mem:>9}")
    for c, row in report["contexts"].items():
        for v, e in row.items():
            if not e["reached"]:
                print(f"{c:>8} {v:10} not reached ({e.get('why')})")
                continue
            print(f"{c:>8} {v:10} {f(e['decode_tokens_per_s'], '9.1f')} {f(e['mean_eviction_round_ms'], '9.3f')} "
                  f"{e['live_cells']:7d} {f(mib(e['kv_bytes']), '9.2f')} "
                  f"{f(e['vram_used_mib'] if gpu else e['rss_mib'], '9.0f')}")
    print("longest context reached:")
    for v, lc in report["longest_context"].items():
        extra = (f"; computed memory bound {lc['computed_max_context_by_memory']} tokens"
                 if lc.get("computed_max_context_by_memory") else "")
        print(f"  {v:10} {lc.get('tokens')} tokens ({lc.get('stop_reason')}, cap {lc.get('variant_cap_s')} s){extra}")
