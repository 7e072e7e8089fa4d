#!/usr/bin/env python3
"""What calibration costs, side by side in one run: today's procedure (``calibrate``) vs ``calibrate --fast``.

Part 1, unit costs on one model (default: a 0.5B-shaped random-weight GGUF made by make_random_model.py):
  * counterfactual labels, seconds per labelled position: today's settings (horizon 32, one branch per
    decode) vs one batch of 8 branches per decode at horizon 32, and the fast profile's (horizon 8, batch 8),
    over the same checkpoints of one dev trace;
  * one teacher-forced evicted pass of 768 and of 512 tokens (the grid's unit).
  Today's total is these measured units times the procedure's counts (3 traces x 768 tokens of labels,
  17 grid configurations x 3 traces x 2 budgets, 3 references): running it end to end on a 0.5B model takes
  hours on 2 cores, which is the problem being solved. Nothing else is estimated.
Part 2: ``calibrate --fast`` run end to end on the same model, wall time measured (``--no-fast-run`` skips).
Part 3 (``--agreement LABELS``, default model): do the cheaper labels rank the layers as today's do?

    python scripts/make_random_model.py --layers 24 --embd 896 --n-head 14 --n-head-kv 2 --n-ff 4864 \\
        --ftype q4_k_m --out ~/.cache/epikv-local/models/random-0.5b-q4_k_m.gguf
    python scripts/bench_calibration.py --model ~/.cache/epikv-local/models/random-0.5b-q4_k_m.gguf \\
        --threads 2 --out results/calibration_cost.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import provenance, save_json  # noqa: E402

PROG = "bench_calibration"


def label_cost(model, toks, horizon: int, batch: int, n_ckpt: int, threads) -> dict:
    from epikv_local.eval.labels import LabelSettings, label_trace

    s = LabelSettings(max_tokens=len(toks), horizon=horizon, stride=16, batch=batch)
    ck = s.checkpoints(len(toks))
    first = ck[len(ck) // 2 - n_ckpt // 2]          # checkpoints from the middle of the trace
    last = first + (n_ckpt - 1) * s.stride
    done = {p for p in range(len(toks)) if p < first - s.stride - 1 or p >= last}   # label only those
    _, sec, n = label_trace(model, "cost", toks, s, n_threads=threads, done=done)
    # label_trace also decodes the prefix up to the first checkpoint (once per trace, not per position):
    # timed alone the same way and subtracted
    from epikv_local.engine.handles import Context

    nb = max(horizon * batch, s.stride, 16)
    with Context(model, n_ctx=len(toks) + horizon * batch + nb, n_batch=nb, n_threads=threads,
                 n_seq_max=batch + 1) as ctx:
        t0 = time.perf_counter()
        ctx.prefill(toks[:first], chunk=nb, logits_from=first)  # logits_from past the end: no output rows
        prefix = time.perf_counter() - t0
    sec = max(sec - prefix, 0.0)
    return {"horizon": horizon, "batch": batch, "positions": n, "seconds": round(sec, 2),
            "prefix_seconds_subtracted": round(prefix, 2),
            "seconds_per_position": round(sec / n, 4) if n else None}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 2 places; None when either is unknown or b rounds to 0 (a tiny model's unit cost can)."""
    return round(a / b, 2) if a is not None and b else None


def pass_cost(model, toks, threads) -> float:
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.eval.fidelity import teacher_forced_pass

    bc = BudgetConfig(kv_budget=128, n_sink=4, recent_fraction=0.5, protect_prompt=False)
    t0 = time.perf_counter()
    teacher_forced_pass(model, toks, "epikv", bc, 16, True, n_threads=threads, on_chunk=lambda p, lp: None)
    return time.perf_counter() - t0


def agreement(labels_path: str, threads, doc: dict) -> None:
    """Do cheaper labels rank the layers as today's do? Today's labels file (horizon 32) against horizon-8
    batched labels of the same traces and positions, and against the fast profile's (1 trace, 512 tokens)."""
    from scipy.stats import spearmanr

    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model
    from epikv_local.eval.anatomy import rank_layers
    from epikv_local.eval.calibrate import FAST_GRID, Grid, layer_ranking
    from epikv_local.eval.labels import LabelSettings, label_trace, labels_by_trace, read_labels
    from epikv_local.eval.traces import load_traces

    header, rows = read_labels(labels_path)
    lab32 = labels_by_trace(rows)
    window = Grid().anatomy_window
    with Model(default_model_path()) as model:
        traces = load_traces(header["traces"], model, header["max_tokens"], n_traces=header["n_traces"],
                             min_tokens=header["max_tokens"], interleave_sources=True)
        traces = [(t, k) for t, k in traces if t in lab32]
        s8 = LabelSettings(max_tokens=header["max_tokens"], horizon=8, stride=header["stride"], batch=8)
        t0 = time.perf_counter()
        rows8 = []
        for tid, toks in traces:
            rows8 += label_trace(model, tid, toks, s8, n_threads=threads)[0]
        sec8 = time.perf_counter() - t0
        lab8 = labels_by_trace(rows8)
        fast = FAST_GRID
        sf = LabelSettings(max_tokens=fast.max_tokens, horizon=fast.label_horizon, stride=fast.label_stride,
                           batch=fast.label_batch)
        ftr = [(t, k[:fast.max_tokens]) for t, k in traces[:fast.label_traces]]
        labf = labels_by_trace(label_trace(model, ftr[0][0], ftr[0][1], sf, n_threads=threads)[0])
        r32, n32 = layer_ranking(model, traces, lab32, window, threads)
        r8, n8 = layer_ranking(model, traces, lab8, window, threads)
        rf, nf = layer_ranking(model, ftr, labf, window, threads)
    v = lambda r: [x["spearman"] for x in r]
    top32 = rank_layers(r32, "spearman", 3)
    out = {"labels": labels_path, "positions": {"h32": n32, "h8": n8, "fast": nf},
           "h8_label_seconds": round(sec8, 1),
           "spearman_of_layer_profiles": {"h8_vs_h32": round(float(spearmanr(v(r32), v(r8))[0]), 3),
                                          "fast_vs_h32": round(float(spearmanr(v(r32), v(rf))[0]), 3)},
           "candidates": {"h32": top32, "h8": rank_layers(r8, "spearman", 3), "fast": rank_layers(rf, "spearman", 2)},
           "per_layer_spearman": {"h32": v(r32), "h8": v(r8), "fast": v(rf)}}
    doc["agreement"] = out
    print(f"layer ranking agreement (Spearman of the per-layer correlation profiles): horizon 8 vs 32 "
          f"{out['spearman_of_layer_profiles']['h8_vs_h32']}, fast profile vs today "
          f"{out['spearman_of_layer_profiles']['fast_vs_h32']}; candidates {out['candidates']}", flush=True)


def main(argv=None) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.eval.calibrate import FAST_GRID, Grid, calibrate
    from epikv_local.eval.traces import default_dev_traces, load_traces

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--traces", default=None, help="dev traces (default: the packaged dev traces)")
    ap.add_argument("--checkpoints", type=int, default=4, help="label checkpoints measured per setting (4)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-fast-run", action="store_true", help="skip part 2")
    ap.add_argument("--agreement", metavar="LABELS", help="part 3 (on the default model): today's labels file vs "
                    "cheaper labels of the same traces, as layer rankings")
    ap.add_argument("--only-agreement", action="store_true", help="run part 3 only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model_path = check_gguf(args.model) if args.model else default_model_path()
    traces = args.traces or str(default_dev_traces())
    today = Grid()
    doc = {**provenance("bench_calibration.py", argv), "model": Path(model_path).name, "threads": args.threads}

    def save():
        save_json(args.out, doc)

    if args.agreement:
        agreement(args.agreement, args.threads, doc)
        save()
        if args.only_agreement:
            return 0
    with Model(model_path) as model:
        doc["shape"] = {"n_layer": model.info.n_layer, "n_embd": model.info.n_embd, "n_head": model.info.n_head,
                        "n_head_kv": model.info.n_head_kv, "n_vocab": model.info.n_vocab}
        (tid, toks), = load_traces(traces, model, 768, n_traces=1, min_tokens=768, interleave_sources=True)
        lab = [label_cost(model, toks, h, b, args.checkpoints, args.threads) for h, b in ((32, 1), (32, 8), (8, 8))]
        for r in lab:
            print(f"labels horizon {r['horizon']:>2} batch {r['batch']}: {r['seconds_per_position']:.3f} s/position "
                  f"({r['positions']} positions)", flush=True)
        p768 = pass_cost(model, toks, args.threads)
        p512 = pass_cost(model, toks[:512], args.threads)
        print(f"evicted pass: 768 tokens {p768:.1f} s, 512 tokens {p512:.1f} s", flush=True)
        # today's counts: labels of label_traces x max_tokens (positions per trace from the settings), 17 configs
        from epikv_local.eval.labels import LabelSettings

        s = LabelSettings(max_tokens=today.max_tokens, horizon=today.label_horizon, stride=today.label_stride)
        per_trace = sum(len(s.candidates(c)) for c in s.checkpoints(today.max_tokens))
        n_pos = per_trace * today.label_traces
        n_pass = 17 * today.n_traces * len(today.budgets) + today.n_traces
        today_s = n_pos * lab[0]["seconds_per_position"] + n_pass * p768
        doc["units"] = {"labels": lab, "pass_768_s": round(p768, 2), "pass_512_s": round(p512, 2)}
        doc["today"] = {"label_positions": n_pos, "passes_768": n_pass,
                        "labels_s": round(n_pos * lab[0]["seconds_per_position"], 1),
                        "grid_s": round(n_pass * p768, 1), "total_s": round(today_s, 1),
                        "how": "measured unit costs x the procedure's counts (17 configurations as in the "
                               "shipped SmolLM2 calibration; the query-statistics/signals step not included)"}
        doc["labels_batch_speedup"] = ratio(lab[0]["seconds_per_position"], lab[1]["seconds_per_position"])
        doc["labels_fast_speedup"] = ratio(lab[0]["seconds_per_position"], lab[2]["seconds_per_position"])
        print(f"today's procedure: {n_pos} labelled positions + {n_pass} passes = {today_s / 60:.1f} min "
              f"(from the units above); batched labels {doc['labels_batch_speedup']}x, fast labels "
              f"{doc['labels_fast_speedup']}x per position", flush=True)
        save()
    if not args.no_fast_run:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            res = calibrate(model_path, traces, FAST_GRID, n_threads=args.threads, out=Path(tmp) / "cal.json")
            fast_s = time.perf_counter() - t0
        doc["fast"] = {"total_s": round(fast_s, 1), "cost_seconds": res.extra.get("cost_seconds"),
                       "chosen": {"layers": res.layers, "window": res.window, "recent_fraction": res.recent_fraction},
                       "selected": res.selected and {k: res.selected[k] for k in ("policy", "recent_fraction")}}
        doc["speedup"] = round(doc["today"]["total_s"] / fast_s, 2)
        print(f"calibrate --fast: {fast_s / 60:.1f} min end to end; today's procedure {doc['speedup']}x longer",
              flush=True)
        save()
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
