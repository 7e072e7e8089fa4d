#!/usr/bin/env python
"""Teacher-forced fidelity benchmark: evicted vs full-cache next-token distributions on reasoning traces.

For every trace x policy x budget it runs a teacher-forced pass with the KV budget enforced and compares each
position t >= budget with a full-cache pass (ΔNLL of the true next token, top-1 agreement, KL(full || evicted)).
See ``epikv_local/eval/fidelity.py`` for the definitions.

Long-range metrics (``epikv_local/eval/longrange.py``, docs/longrange.md) beside the all-token ones: key-token
ΔNLL/top-1/KL (positions a fresh local window of ``--key-window`` tokens predicts worse than the full cache by
more than ``--key-threshold`` nats; one extra pass per trace; ``--key-window 0`` turns it off), answer-span
ΔNLL/top-1/KL (the record's gold ``answer`` appended after the truncated trace; on by default when the records
have answers, ``--no-answer-span`` turns it off), and for every metric the paired per-trace difference of each
policy to ``--paired-baseline`` (streaming) with a bootstrap CI over traces.

Writes ``<out>/<prefix>_<name>.jsonl`` (one row per trace x policy x budget; prefix ``fidelity`` by default) and
``<out>/<prefix>_<name>_summary.json`` (per policy x budget: means with bootstrap 95% CIs over traces, plus
provenance), and prints tables. ``--grid-windows``/``--grid-thresholds`` also evaluate every (window,
threshold) pair of the key-token definition from the same passes and write ``<out>/<prefix>_<name>_keygrid.json``
with the selection rule's choice (used on the dev split only). Progress goes to stderr. Bad input (any
``EpikvError``): one line ``bench_fidelity: error: ...``, exit 2 (``epikv_local.errors.run_main``).

Examples:
  .venv/bin/python scripts/bench_fidelity.py --quick
  .venv/bin/python scripts/bench_fidelity.py --n-traces 8 --budgets 128,256,512,1024 --max-tokens 1536
  .venv/bin/python scripts/bench_fidelity.py --text-file notes.txt --budgets 256 --policies streaming,epikv
  .venv/bin/python scripts/bench_fidelity.py --n-traces 4 --max-tokens 768 --budgets 128,256 \
      --policies streaming,random,epikv --grid-windows 32,64,128 --grid-thresholds 0.5,1,2 \
      --prefix longrange --name dev
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from benchlib import ArgParser, log, run_or_merge  # noqa: E402  (benchlib puts the source tree on sys.path)

from epikv_local.errors import ConfigError, DataError  # noqa: E402
from epikv_local.eval.io import nan_to_none  # noqa: E402
from epikv_local.eval.longrange import KEY_THRESHOLD, KEY_WINDOW  # noqa: E402
from epikv_local.eval.specs import (CALIBRATED, SELECTED, calibrated_spec, check_policies,  # noqa: E402
                                    load_calibration_arg, selected_by_budget, selected_spec)

PROG = "bench_fidelity"
DEFAULT_TRACES = REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"
QUICK_TOKENS = 300
QUICK_BUDGETS = [128]
QUICK_POLICIES = ["streaming", "epikv"]


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog=PROG, description="Teacher-forced fidelity of KV-cache eviction policies (ΔNLL, top-1, KL).")
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--traces", default=str(DEFAULT_TRACES),
                    help="JSONL traces with 'problem' and 'trace' fields (default: ../shared/data/r1_traces_dev.jsonl)")
    ap.add_argument("--text-file", help="evaluate one plain text file as a single trace instead of --traces")
    ap.add_argument("--n-traces", type=int, default=8, help="traces to evaluate (default 8)")
    ap.add_argument("--skip-traces", type=int, default=0,
                    help="skip the first N of the selected traces (to run a benchmark in parts; see --merge)")
    ap.add_argument("--max-tokens", type=int, default=1536, help="tokens per trace (truncated; default 1536)")
    ap.add_argument("--budgets", default="128,256,512,1024", help="comma-separated KV budgets (default 128,256,512,1024)")
    ap.add_argument("--policies", help="comma-separated policies (default: every registered policy except none)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens per decode (default 16)")
    ap.add_argument("--n-sink", type=int, default=4, help="protected first tokens (default 4)")
    ap.add_argument("--recent-fraction", type=float, default=0.5, help="protected recent share of the budget (0.5)")
    ap.add_argument("--no-flash-attn", action="store_true",
                    help="run every pass with flash attention off (attention policies always run with it off)")
    ap.add_argument("--file-order", action="store_true",
                    help="take traces in file order (default: round-robin over the trace generators)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: one {QUICK_TOKENS}-token trace, budget {QUICK_BUDGETS[0]}, "
                         f"policies {','.join(QUICK_POLICIES)}")
    ap.add_argument("--name", help="run name in the output file names (default: quick / the data file's stem)")
    ap.add_argument("--out", default="results", help="output directory (default results/)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    ap.add_argument("--parallel", type=int, default=1, metavar="N",
                    help="a policy's budgets decoded together as N sequences of one context (default 1: one pass at "
                         "a time; docs/calibration.md, 'Parallel passes')")
    ap.add_argument("--calibration", help="also run 'epikv_calibrated': EPIKV with the layers/window/recent share of "
                                          "this calibration JSON ('auto': the model's cached calibration)")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    ap.add_argument("--key-window", type=int, default=KEY_WINDOW,
                    help=f"local window (tokens) of the key-token definition (default {KEY_WINDOW}, chosen on dev; "
                         "0: no key-token metrics)")
    ap.add_argument("--key-threshold", type=float, default=KEY_THRESHOLD,
                    help=f"key token: window NLL - full NLL > this many nats (default {KEY_THRESHOLD}, chosen on dev)")
    ap.add_argument("--answer-span", action=argparse.BooleanOptionalAction, default=None,
                    help="append the record's gold answer after each trace and score it (default: on when the "
                         "records have an 'answer')")
    ap.add_argument("--paired-baseline", default="streaming",
                    help="policy every other one is paired with, per trace and budget (default streaming)")
    ap.add_argument("--grid-windows", help="key-token grid: comma-separated local windows (with --grid-thresholds)")
    ap.add_argument("--grid-thresholds", help="key-token grid: comma-separated thresholds in nats")
    ap.add_argument("--grid-budget", type=int, help="budget at which the grid's selection rule compares "
                                                    "random and streaming (default: the largest budget, where the "
                                                    "windows are smallest next to what streaming keeps)")
    ap.add_argument("--prefix", default="fidelity", help="output file prefix (default fidelity)")
    ap.add_argument("--merge", help="comma-separated row files (JSONL) of runs made in parts: merge them into one "
                                    "result named --name (no model is run)")
    return ap


def _int_list(text: str, what: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what} list is empty")
    try:
        vals = [int(t) for t in items]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise ConfigError(f"{what} must be >= 1, got {text!r}")
    return sorted(set(vals))


def _fmt_ci(m: dict, spec: str) -> str:
    return f"{m['mean']:{spec}} [{m['ci_low']:{spec}},{m['ci_high']:{spec}}]"


TABLES = (("delta_nll", "mean ΔNLL (nats/token, lower is better)", "+.4f"),
          ("top1_agreement", "top-1 agreement with the full cache", ".3f"),
          ("kl", "mean KL(full || evicted) (nats)", ".4f"),
          ("key_delta_nll", "key-token ΔNLL (nats/token, lower is better)", "+.4f"),
          ("key_top1_agreement", "key-token top-1 agreement", ".3f"),
          ("key_kl", "key-token KL(full || evicted) (nats)", ".4f"),
          ("answer_delta_nll", "answer-span ΔNLL (nats/token, lower is better)", "+.4f"),
          ("answer_top1_agreement", "answer-span top-1 agreement", ".3f"),
          ("answer_kl", "answer-span KL(full || evicted) (nats)", ".4f"))
#: paired differences printed (all of longrange.PAIRED_METRICS are in the summary JSON; the nll_ref ones are
#: zero within a reference and nll's equal delta_nll's, so they are not printed)
PAIRED_PRINTED = tuple(m for m, _, _ in TABLES)


def _table(summary, budgets, policies, get, title, spec, file) -> None:
    by = {(s["policy"], s["kv_budget"]): s for s in summary}
    cells = {k: get(s) for k, s in by.items()}
    if not any(c is not None for c in cells.values()):
        return
    print(f"\n{title}", file=file)
    text = {k: (_fmt_ci(c, spec) if c is not None else "-") for k, c in cells.items()}
    w = max(26, max(len(t) for t in text.values()) + 2)
    print(f"{'policy':<14}" + "".join(f"{'budget ' + str(b):>{w}}" for b in budgets), file=file)
    for p in policies:
        row = [text.get((p, b), "-") for b in budgets]
        print(f"{p:<14}" + "".join(f"{c:>{w}}" for c in row), file=file)


def print_table(summary: list[dict], file=sys.stdout, baseline: str = "streaming") -> None:
    budgets = sorted({s["kv_budget"] for s in summary})
    policies = list(dict.fromkeys(s["policy"] for s in summary))
    by = {(s["policy"], s["kv_budget"]): s for s in summary}
    for metric, title, spec in TABLES:
        _table(summary, budgets, policies, lambda s, m=metric: s.get(m), f"{title}; mean [95% CI over traces]",
               spec, file)
    key = f"paired_vs_{baseline}"
    if any(key in s for s in summary):
        others = [p for p in policies if p != baseline]
        for metric, title, spec in TABLES:
            _table([s for s in summary if s["policy"] != baseline], budgets, others,
                   lambda s, m=metric: s.get(key, {}).get(m),
                   f"paired difference to {baseline} (policy - {baseline}, same trace and budget): {title}; "
                   "mean [95% paired bootstrap CI over traces]", spec, file)
    n = max(s["n_traces"] for s in summary)
    print(f"\n(n_traces = {n}; seconds per pass: "
          + ", ".join(f"{p} {sum(by[(p, b)]['seconds_per_pass'] for b in budgets if (p, b) in by) / sum(1 for b in budgets if (p, b) in by):.1f}"
                      for p in policies) + ")", file=file)
    if any("n_key_positions" in s for s in summary):
        print("(key / answer positions per budget, all traces: "
              + ", ".join(f"{b}: {next((s.get('n_key_positions', 0) for s in summary if s['kv_budget'] == b), 0)}"
                          f" / {next((s.get('n_answer_positions', 0) for s in summary if s['kv_budget'] == b), 0)}"
                          for b in budgets) + ")", file=file)


def print_grid(grid: list[dict], choice: dict, file=sys.stdout) -> None:
    print("\nkey-token grid: key share of evaluated positions, key ΔNLL random - streaming "
          "[95% paired CI], d_z", file=file)
    for g in grid:
        pr = g.get("paired", {})
        print(f"  W={g['window']:<4} thr={g['threshold']:<4} budget {g['kv_budget']:<5} share {g['key_share']:.3f} "
              f"({g['n_key']}/{g['n_eval']})  diff {pr.get('mean', float('nan')):+.4f} "
              f"[{pr.get('ci_low', float('nan')):+.4f},{pr.get('ci_high', float('nan')):+.4f}] "
              f"d_z {pr.get('d_z', float('nan')):+.2f}", file=file)
    print(f"choice: window {choice['window']}, threshold {choice['threshold']} ({choice['reason']})", file=file)


def read_answers(path: Path) -> dict[str, str]:
    """id -> gold answer of the records of a trace file (records without an id or an answer are left out)."""
    from epikv_local.eval.io import read_jsonl

    out = {}
    for _, rec in read_jsonl(path, "trace file"):
        ans = rec.get("answer")
        if "id" in rec and ans is not None and str(ans).strip():
            out[str(rec["id"])] = str(ans)
    return out


def run(args) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    import numpy as np

    from epikv_local.eval.fidelity import evaluate_trace, local_window_nll, summarize
    from epikv_local.eval.longrange import WINDOW_STRIDE_FRACTION, key_grid, select_key_setting
    from epikv_local.eval.provenance import run_header
    from epikv_local.eval.traces import load_traces
    from epikv_local.policies import REGISTRY

    if args.quick:
        max_tokens, budgets, n_traces = QUICK_TOKENS, list(QUICK_BUDGETS), 1
        policies = list(QUICK_POLICIES) if args.policies is None else None
    else:
        max_tokens, n_traces = args.max_tokens, args.n_traces
        budgets = _int_list(args.budgets, "budgets")
        policies = None
    if policies is None:
        if args.policies is None:
            policies = [p for p in REGISTRY if p != "none" and not REGISTRY[p].from_calibration]
        else:
            policies = list(dict.fromkeys(t.strip() for t in args.policies.split(",") if t.strip()))
    cal = None
    if args.calibration:
        cal = load_calibration_arg(args.calibration,
                                   Path(args.model).expanduser() if args.model else default_model_path())
        policies = [p for p in policies if p not in (CALIBRATED, SELECTED)]
        log(f"epikv_calibrated: layers {cal.layer_a},{cal.layer_b} window {cal.window} recent share "
            f"{cal.recent_fraction} ({cal.path})")
        if cal.selected is not None:
            log(f"calibrated: {cal.selected['policy']} {cal.selected['options']} recent share "
                f"{cal.selected['recent_fraction']}")
    if not policies and cal is None:
        raise ConfigError("policy list is empty")
    check_policies(policies, allow_none=False)
    if n_traces < 1:
        raise ConfigError(f"--n-traces must be >= 1, got {n_traces}")
    if args.skip_traces < 0:
        raise ConfigError(f"--skip-traces must be >= 0, got {args.skip_traces}")
    if max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {max_tokens}")
    if args.chunk < 1:
        raise ConfigError(f"--chunk must be >= 1, got {args.chunk}")
    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {args.parallel}")
    if not 0.0 <= args.recent_fraction < 1.0:
        raise ConfigError(f"--recent-fraction must be in [0, 1), got {args.recent_fraction}")
    if args.key_window < 0:
        raise ConfigError(f"--key-window must be >= 0, got {args.key_window}")
    grid_windows = grid_thresholds = None
    if bool(args.grid_windows) != bool(args.grid_thresholds):
        raise ConfigError("--grid-windows and --grid-thresholds go together")
    if args.grid_windows:
        grid_windows = _int_list(args.grid_windows, "grid windows")
        try:
            grid_thresholds = sorted({float(t) for t in args.grid_thresholds.split(",") if t.strip()})
        except ValueError:
            raise ConfigError(f"--grid-thresholds must be comma-separated numbers, got {args.grid_thresholds!r}") from None
        if not grid_thresholds:
            raise ConfigError("grid thresholds list is empty")
        if args.grid_budget is not None and args.grid_budget not in budgets:
            raise ConfigError(f"--grid-budget {args.grid_budget} is not one of the budgets {budgets}")
    kept = [b for b in budgets if b < max_tokens - 1]
    if not kept:
        raise ConfigError(f"no budget below --max-tokens {max_tokens}: nothing to evaluate")
    for b in budgets:
        if b not in kept:
            log(f"skipping budget {b}: not below the {max_tokens}-token trace length, nothing would be evaluated")
    budgets = kept

    model_path = Path(args.model).expanduser() if args.model else default_model_path()
    check_gguf(model_path)
    source = Path(args.text_file) if args.text_file else Path(args.traces)
    if not source.is_file():
        raise DataError(f"{'text' if args.text_file else 'trace'} file not found: {source}")
    answers = {} if args.text_file or args.answer_span is False else read_answers(source)
    answer_span = bool(answers) if args.answer_span is None else args.answer_span
    if answer_span and not answers:
        raise DataError(f"--answer-span: no record of {source} has an id and an 'answer'")
    name = args.name or ("quick" if args.quick else source.stem)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    with Model(model_path) as model:
        if args.text_file:
            text = source.read_text(encoding="utf-8", errors="replace")
            toks = model.tokenize(text)[:max_tokens]
            if len(toks) < min(budgets) + 2:
                raise DataError(f"{source} has {len(toks)} tokens, too few for the smallest budget {min(budgets)}")
            traces = [(source.name, toks)]
            for b in budgets:
                if b >= len(toks) - 1:
                    log(f"skipping budget {b}: not below the text's {len(toks)} tokens")
        else:
            traces = load_traces(source, model, max_tokens, n_traces=n_traces + args.skip_traces,
                                 min_tokens=max_tokens, interleave_sources=not args.file_order)[args.skip_traces:]
            if not traces:
                raise DataError(f"no trace in {source} has {max_tokens} tokens")
            if len(traces) < n_traces:
                log(f"only {len(traces)} traces of {source} have {max_tokens} tokens (asked for {n_traces})")
        log(f"model {model_path.name}; {len(traces)} trace(s) x {len(policies)} policies x budgets "
            f"{','.join(map(str, budgets))}; chunk {args.chunk}")
        rows = []
        grid_traces = []
        jsonl = out_dir / f"{args.prefix}_{name}.jsonl"
        fa = not args.no_flash_attn
        with open(jsonl, "w") as f:
            for i, (tid, toks) in enumerate(traces):
                log(f"trace {i + 1}/{len(traces)} {tid} ({len(toks)} tokens)")
                answer = answers.get(tid) if answer_span else None
                if answer_span and answer is None:
                    log(f"  {tid}: no gold answer, no answer span")
                window_nll, grid_nll = None, {}
                start = min(b for b in budgets if b < len(toks) - 1) if any(b < len(toks) - 1 for b in budgets) else None
                if grid_windows and start is not None:
                    for w in grid_windows:
                        t0 = time.perf_counter()
                        grid_nll[w] = local_window_nll(model, toks, w, start, len(toks) - 1, flash_attn=fa,
                                                       n_threads=args.threads)
                        log(f"  grid: local window {w} ({time.perf_counter() - t0:.1f}s)")
                    window_nll = grid_nll.get(args.key_window)
                if window_nll is None and args.key_window and start is not None and cal is not None:
                    # computed once here: the calibrated policies' evaluate_trace calls reuse it
                    window_nll = local_window_nll(model, toks, args.key_window, start, len(toks) - 1, flash_attn=fa,
                                                  n_threads=args.threads)
                common = dict(chunk=args.chunk, n_sink=args.n_sink, flash_attn=fa, n_threads=args.threads,
                              n_parallel=args.parallel,
                              progress=lambda m: log("  " + m), answer=answer, key_window=args.key_window or None,
                              key_threshold=args.key_threshold, keep_positions=bool(grid_windows))
                trace_rows = evaluate_trace(model, toks, policies, budgets, recent_fraction=args.recent_fraction,
                                            window_nll=window_nll, **common)
                if cal is not None:  # its own recent share, so its own evaluate_trace call
                    trace_rows += evaluate_trace(model, toks, [calibrated_spec(cal)], budgets,
                                                 recent_fraction=cal.recent_fraction, window_nll=window_nll, **common)
                    if cal.selected is not None:  # its choice (and recent share) may differ per budget
                        plan = [(selected_spec(cal, b), b, cal.selected_for(b)["recent_fraction"]) for b in budgets]
                        trace_rows += evaluate_trace(model, toks, [], budgets, runs=plan, window_nll=window_nll,
                                                     **common)
                passes = {}
                for r in trace_rows:
                    pp = r.pop("_per_position", None)
                    if pp is not None:
                        passes[(r["policy"], r["kv_budget"])] = pp
                    r = {"trace_id": tid, **r, "model": model_path.name}
                    rows.append(r)
                    f.write(json.dumps(nan_to_none(r)) + "\n")
                f.flush()
                if grid_nll:
                    grid_traces.append({"positions": np.arange(start, len(toks) - 1), "window_nll": grid_nll,
                                        "passes": passes})

    summary = summarize(rows, n_resamples=args.bootstrap, seed=args.seed, baseline=args.paired_baseline)
    wall = time.perf_counter() - t_start
    doc = {
        **run_header(model_path, args.threads or os.cpu_count()),
        "settings": {"source": str(source), "traces": [t for t, _ in traces], "n_traces": len(traces),
                     "max_tokens": max_tokens, "budgets": budgets, "policies": policies, "chunk": args.chunk,
                     "n_sink": args.n_sink, "recent_fraction": args.recent_fraction,
                     "flash_attn": not args.no_flash_attn, "protect_prompt": False,
                     "trace_order": "file" if args.file_order else "interleave_sources",
                     "calibration": (None if cal is None else
                                     {"path": cal.path, "layer_a": cal.layer_a, "layer_b": cal.layer_b,
                                      "window": cal.window, "recent_fraction": cal.recent_fraction,
                                      "selected": cal.selected,
                                      "selected_by_budget": selected_by_budget(cal, budgets)}),
                     "bootstrap_resamples": args.bootstrap, "seed": args.seed, "quick": bool(args.quick),
                     "metrics_at": "positions t >= kv_budget (prediction of token t+1)",
                     "key_window": args.key_window or None, "key_threshold": args.key_threshold if args.key_window else None,
                     "key_window_stride_fraction": WINDOW_STRIDE_FRACTION,
                     "key_definition": "nll(fresh local window of >= key_window tokens) - nll(full cache) > "
                                       "key_threshold, positions t >= kv_budget of the trace",
                     "answer_span": answer_span,
                     "answer_definition": ("gold 'answer' appended as '\\n\\n**Final Answer**\\n\\[ \\boxed{' + answer "
                                           "+ '} \\]'; the answer's own tokens are scored") if answer_span else None,
                     "paired_baseline": args.paired_baseline},
        "wall_seconds": round(wall, 1),
        "results": summary,
    }
    from epikv_local.eval.io import write_atomic
    from epikv_local.eval.provenance import portable

    doc = portable(doc)
    summary_path = write_atomic(out_dir / f"{args.prefix}_{name}_summary.json", json.dumps(nan_to_none(doc), indent=2) + "\n")
    print_table(summary, baseline=args.paired_baseline)
    if grid_traces:
        grid = key_grid(grid_traces, grid_windows, grid_thresholds, n_resamples=args.bootstrap, seed=args.seed)
        gb = args.grid_budget or max(budgets)
        choice = select_key_setting(grid, gb)
        grid_path = out_dir / f"{args.prefix}_{name}_keygrid.json"
        write_atomic(grid_path, json.dumps({"command": doc["command"], "git_revision": doc["git_revision"],
                                            "date": doc["date"], "settings": doc["settings"],
                                            "rule": select_key_setting.__doc__.strip(), "choice": choice,
                                            "grid": nan_to_none(grid)}, indent=2) + "\n")
        print_grid(grid, choice)
        log(f"wrote {grid_path}")
    log(f"wrote {jsonl} and {summary_path} ({wall:.0f}s)")
    return 0


def merge(args) -> int:
    """``--merge A.jsonl,B.jsonl``: one result from runs made in parts (e.g. the registered policies, then the
    calibrated ones once the calibration exists): the rows concatenated, the summary (paired comparisons
    included) recomputed over all of them; settings from the parts' summary files, which must agree."""
    from epikv_local.eval.fidelity import summarize
    from epikv_local.eval.io import read_jsonl, write_atomic
    from epikv_local.eval.provenance import (merged_header, merged_settings, merged_wall_seconds, portable,
                                             read_result_doc, settings_mismatch)

    parts = [Path(x) for x in args.merge.split(",") if x.strip()]
    rows, docs = [], []
    for part in parts:
        part_rows = [r for _, r in read_jsonl(part, "fidelity rows")]
        if not all({"trace_id", "policy", "kv_budget"} <= set(r) for r in part_rows):
            raise DataError(f"--merge: {part} is not bench_fidelity rows (trace_id, policy, kv_budget)")
        rows += part_rows
        sp = part.with_name(part.stem + "_summary.json")
        if not sp.is_file():
            raise DataError(f"--merge: {part} has no summary file {sp.name} beside it")
        docs.append(read_result_doc(sp, "a bench_fidelity summary"))
    keys = ("source", "max_tokens", "budgets", "chunk", "n_sink", "key_window", "key_threshold", "answer_span")
    mismatch = settings_mismatch(docs, keys)
    if mismatch:
        raise DataError(f"--merge: the parts differ in {', '.join(mismatch[1])}")
    seen = set()
    for r in rows:
        k = (r["trace_id"], r["policy"], r["kv_budget"])
        if k in seen:
            raise DataError(f"--merge: {k} appears twice")
        seen.add(k)
    summary = summarize(rows, n_resamples=args.bootstrap, seed=args.seed, baseline=args.paired_baseline)
    settings = merged_settings(docs)
    settings["traces"] = list(dict.fromkeys(t for d in docs for t in d["settings"]["traces"]))
    settings["n_traces"] = len(settings["traces"])
    doc = {**merged_header(docs), "settings": settings, "wall_seconds": merged_wall_seconds(docs),
           "results": summary}
    out_dir = Path(args.out)
    name = args.name or "merged"
    jsonl = out_dir / f"{args.prefix}_{name}.jsonl"
    write_atomic(jsonl, "".join(json.dumps(nan_to_none(r)) + "\n" for r in rows))
    doc = portable(doc)
    summary_path = write_atomic(out_dir / f"{args.prefix}_{name}_summary.json", json.dumps(nan_to_none(doc), indent=2) + "\n")
    print_table(summary, baseline=args.paired_baseline)
    log(f"wrote {jsonl} and {summary_path} ({len(rows)} rows from {len(parts)} parts)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_or_merge(PROG, build_parser(), run, merge, argv)


if __name__ == "__main__":
    sys.exit(main())
