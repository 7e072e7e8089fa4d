#!/usr/bin/env python
"""Free-generation collapse benchmark: sampled generations from MATH-500 prompts under each policy at tight KV
budgets, against the full cache, measured for degeneration (repetition loops, repeated n-grams, distinct-2/3,
empty / unboxed / truncated answers). See ``epikv_local/eval/collapse.py`` for the definitions and
docs/longrange.md for results.

Every (policy, budget) generates from the same prompts with the same per-prompt seed (``--seed`` + prompt index)
as the full cache (policy ``none``), so differences are paired by prompt. Writes ``<out>/collapse_<name>.json``
(provenance, settings, every generation with its text and metrics, and the summary: means with bootstrap 95% CIs
over prompts and paired differences to the full cache) and prints tables. Progress goes to stderr. Bad input:
one line ``bench_collapse: error: ...``, exit 2.

Examples:
  .venv/bin/python scripts/bench_collapse.py --quick
  .venv/bin/python scripts/bench_collapse.py --n-prompts 6 --max-tokens 256 --budgets 64,128 --name dev
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from benchlib import ArgParser, log, run_or_merge  # noqa: E402  (benchlib puts the source tree on sys.path)

from epikv_local.errors import ConfigError, DataError  # noqa: E402
from epikv_local.eval.io import nan_to_none, write_atomic  # noqa: E402

PROG = "bench_collapse"
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "math500.jsonl"
DEFAULT_POLICIES = "streaming,epikv,keydiff,h2o"
QUICK = {"n_prompts": 1, "max_tokens": 48, "budgets": [64], "policies": ["streaming"]}


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog=PROG, description="Degeneration of sampled generations under KV eviction vs the full cache.")
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                    help="JSONL with 'problem' fields (default ../shared/data/math500.jsonl; the first --n-prompts)")
    ap.add_argument("--n-prompts", type=int, default=6, help="prompts (default 6)")
    ap.add_argument("--skip-prompts", type=int, default=0,
                    help="skip the file's first N problems (default 0; e.g. 6: prompts disjoint from the dev run)")
    ap.add_argument("--max-tokens", type=int, default=256, help="generated tokens at most (default 256)")
    ap.add_argument("--budgets", default="64,128", help="comma-separated KV budgets (default 64,128)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help=f"comma-separated evicting policies, or 'all' for every registered one (default "
                         f"{DEFAULT_POLICIES}); the full cache (none) always runs as the baseline")
    ap.add_argument("--calibration", help="also run 'epikv_calibrated' and 'calibrated' (step 3's choice, at its "
                                          "own recent share) from this calibration JSON ('auto': the model's)")
    ap.add_argument("--merge", help="A.json,B.json: one result from runs made in parts (same prompts, seeds and "
                                    "settings; the full-cache rows must agree), summary recomputed")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (+1 per prompt; default 0)")
    ap.add_argument("--n-sink", type=int, default=4, help="protected first tokens (default 4)")
    ap.add_argument("--recent-fraction", type=float, default=0.5, help="protected recent share of the budget (0.5)")
    ap.add_argument("--chunk", type=int, default=16, help="prefill tokens per decode (default 16)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: see handles.resolve_threads)")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 prompt x 48 tokens, budget 64, streaming")
    ap.add_argument("--name", help="run name: <out>/collapse_<name>.json (default quick / the prompt file's stem)")
    ap.add_argument("--out", default="results", help="output directory (default results/)")
    return ap


def _fmt(m: dict, spec: str) -> str:
    if m is None or m.get("mean") is None:
        return "-"
    return f"{m['mean']:{spec}} [{m['ci_low']:{spec}},{m['ci_high']:{spec}}]"


def dump(doc: dict) -> str:
    """The result document as JSON: indented, except one line per generation row (their token lists)."""
    from epikv_local.eval.provenance import portable

    rows = doc.get("rows", [])
    text = json.dumps(nan_to_none(portable({**doc, "rows": []})), indent=2)
    body = ",\n".join("    " + json.dumps(nan_to_none(r)) for r in rows)
    return text.replace('"rows": []', '"rows": [\n' + body + "\n  ]" if rows else '"rows": []') + "\n"


def print_tables(summary: list[dict], file=sys.stdout) -> None:
    from epikv_local.eval.collapse import BASELINE, COLLAPSE_METRICS

    def label(s):
        return f"{s['policy']}@{s['kv_budget']}" if s["kv_budget"] is not None else f"{s['policy']} (full)"

    order = sorted(summary, key=lambda s: (s["kv_budget"] is not None, s["kv_budget"] or 0, s["policy"]))
    w = 21
    key = f"paired_vs_{BASELINE}"
    groups = [COLLAPSE_METRICS[i:i + 5] for i in range(0, len(COLLAPSE_METRICS), 5)]
    for title, get, spec in (("per (policy, budget): mean [95% bootstrap CI over prompts]", lambda s: s, ".2f"),
                             (f"paired difference to the full cache ({BASELINE}), same prompt and seed: "
                              "mean [95% paired CI over prompts]", lambda s: s.get(key), "+.2f")):
        for cols in groups:
            print(f"\n{title}", file=file)
            print(f"{'run':<18}" + "".join(f"{m:>{w}}" for m in cols), file=file)
            for s in order:
                src = get(s)
                if src is not None:
                    print(f"{label(s):<18}" + "".join(f"{_fmt(src.get(m), spec):>{w}}" for m in cols), file=file)


def run(args) -> int:
    from epikv_local.api.chat import apply_chat_template, tokenize_prompt
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.eval.collapse import (BASELINE, PREFIX, collapse_metrics, generate_one, load_problems,
                                           math_prompt, summarize_collapse)
    from epikv_local.eval.provenance import run_header
    from epikv_local.eval.specs import (CALIBRATED, SELECTED, calibrated_spec, check_policies, load_calibration_arg,
                                        selected_by_budget, selected_spec)
    from epikv_local.policies import REGISTRY

    if args.quick:
        n_prompts, max_tokens, budgets, policies = (QUICK["n_prompts"], QUICK["max_tokens"], list(QUICK["budgets"]),
                                                    list(QUICK["policies"]))
    else:
        n_prompts, max_tokens = args.n_prompts, args.max_tokens
        try:
            budgets = sorted({int(t) for t in args.budgets.split(",") if t.strip()})
        except ValueError:
            raise ConfigError(f"budgets must be comma-separated integers, got {args.budgets!r}") from None
        policies = list(dict.fromkeys(t.strip() for t in args.policies.split(",") if t.strip()))
        if policies == ["all"]:
            policies = [p for p in REGISTRY if REGISTRY[p].cls.evicts and not REGISTRY[p].from_calibration]
    policies = [p for p in policies if p != BASELINE]
    if not budgets or any(b < 8 for b in budgets):
        raise ConfigError(f"budgets must be integers >= 8, got {args.budgets!r}")
    check_policies(policies)
    if n_prompts < 1 or max_tokens < 1 or args.skip_prompts < 0:
        raise ConfigError("--n-prompts and --max-tokens must be >= 1, --skip-prompts >= 0")
    if not 0.0 < args.temperature:
        raise ConfigError(f"--temperature must be > 0 (sampling), got {args.temperature}")
    model_path = Path(args.model).expanduser() if args.model else default_model_path()
    check_gguf(model_path)
    src = Path(args.prompts)
    if not src.is_file():
        raise DataError(f"prompt file not found: {src}")
    # (label, policy name or spec, recent share): the registered ones at --recent-fraction, a calibration's
    # policies at the recent share they were calibrated with
    specs = [(p, p, args.recent_fraction) for p in policies]
    cal_info = None
    if args.calibration:
        cal = load_calibration_arg(args.calibration, model_path)
        specs.append((CALIBRATED, calibrated_spec(cal), cal.recent_fraction))
        if cal.selected is not None:
            specs.append((SELECTED, None, None))  # resolved per budget below
        cal_info = {"path": str(cal.path), "epikv": cal.policy_options(), "recent_fraction": cal.recent_fraction,
                    "selected": cal.selected, "selected_by_budget": selected_by_budget(cal, budgets)}
    problems = load_problems(src, n_prompts, skip=args.skip_prompts)
    if not problems:
        raise DataError(f"no problem in {src}")
    name = args.name or ("quick" if args.quick else src.stem)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    runs = [(BASELINE, BASELINE, args.recent_fraction, None)]
    for b in budgets:
        for lab, sp, rf in specs:
            if lab == SELECTED:  # step 3's choice for this budget, at its own recent share
                sp, rf = selected_spec(cal, b), cal.selected_for(b)["recent_fraction"]
            runs.append((lab, sp, rf, b))
    rows = []
    t_start = time.perf_counter()
    with Model(model_path) as model:
        for i, prob in enumerate(problems):
            prompt = tokenize_prompt(model, apply_chat_template(model, math_prompt(prob["problem"])))
            seed = args.seed + i
            for policy, spec, recent, budget in runs:
                g = generate_one(model, prompt, spec, budget, max_tokens, seed, temperature=args.temperature,
                                 top_p=args.top_p, n_sink=args.n_sink, recent_fraction=recent,
                                 chunk=args.chunk, n_threads=args.threads)
                m = collapse_metrics(g["tokens"], g["text"], g["stop_reason"])
                row = {"prompt_id": prob["id"], "prompt_index": i, "seed": seed, "n_prompt_tokens": len(prompt),
                       "policy": policy, "kv_budget": budget, "recent_fraction": recent, **m,
                       **g}
                rows.append(row)
                log(f"prompt {i + 1}/{len(problems)} {policy}@{budget or 'full'}: {g['n_generated']} tokens "
                    f"({g['stop_reason']}), distinct-2 {m['distinct_2']:.2f}, loop {int(m['loop'])}, "
                    f"longest repeat {m['longest_repeat_share']:.2f} ({g['seconds']:.1f}s)")
    summary = summarize_collapse(rows, n_resamples=args.bootstrap, seed=0)
    wall = time.perf_counter() - t_start
    doc = {**run_header(model_path, args.threads),
           "settings": {"prompts": str(src), "prompt_ids": [p["id"] for p in problems], "n_prompts": len(problems),
                        "prompt_suffix": math_prompt(""), "chat_template": True, "max_tokens": max_tokens,
                        "distinct_prefix_tokens": PREFIX,
                        "budgets": budgets, "policies": [lab for lab, _, _ in specs], "baseline": BASELINE,
                        "skip_prompts": args.skip_prompts, "calibration": cal_info,
                        "temperature": args.temperature, "top_p": args.top_p,
                        "seed": "seed + prompt index, same for every policy", "seed_base": args.seed,
                        "n_sink": args.n_sink, "recent_fraction": args.recent_fraction, "protect_prompt": False,
                        "chunk": args.chunk, "bootstrap_resamples": args.bootstrap, "quick": bool(args.quick)},
           "wall_seconds": round(wall, 1), "summary": summary, "rows": rows}
    path = write_atomic(out_dir / f"collapse_{name}.json", dump(doc))
    print_tables(summary)
    log(f"wrote {path} ({wall:.0f}s)")
    return 0


#: settings that must agree between the parts of a merged result
MERGE_KEYS = ("prompts", "prompt_ids", "prompt_suffix", "max_tokens", "budgets", "temperature", "top_p",
              "seed_base", "n_sink", "chunk", "distinct_prefix_tokens")


def merge(args) -> int:
    """``--merge A.json,B.json``: one result from runs made in parts (e.g. the registered policies, then a
    calibration's). Every part ran the full cache on the same prompts with the same seeds; those rows must be
    the same generations (else the pairing would be wrong) and are kept once. The summary is recomputed."""
    from epikv_local.eval.collapse import BASELINE, summarize_collapse
    from epikv_local.eval.provenance import (merged_header, merged_settings, merged_wall_seconds,
                                             read_result_doc, settings_mismatch)

    parts = [Path(x.strip()) for x in args.merge.split(",") if x.strip()]
    if len(parts) < 2:
        raise ConfigError("--merge needs two or more result files, comma-separated")
    docs = []
    for part in parts:
        d = read_result_doc(part, "a bench_collapse result")
        if not (isinstance(d.get("rows"), list)
                and all(isinstance(r, dict) and {"prompt_id", "policy", "kv_budget", "tokens"} <= set(r)
                        for r in d["rows"])):
            raise DataError(f"--merge: {part} is not a bench_collapse result (settings and rows)")
        docs.append(d)
    mismatch = settings_mismatch(docs, MERGE_KEYS)
    if mismatch:
        raise DataError(f"--merge: {parts[mismatch[0]]} differs from {parts[0]} in {', '.join(mismatch[1])}")
    base = {r["prompt_id"]: r for r in docs[0]["rows"] if r["policy"] == BASELINE}
    rows, seen = list(docs[0]["rows"]), {(r["prompt_id"], r["policy"], r["kv_budget"]) for r in docs[0]["rows"]}
    for part, d in zip(parts[1:], docs[1:]):
        for r in d["rows"]:
            if r["policy"] == BASELINE:
                if r["prompt_id"] in base and r["tokens"] != base[r["prompt_id"]]["tokens"]:
                    raise DataError(f"--merge: the full-cache generation of {r['prompt_id']} differs in {part} "
                                    "(different machine, threads or build?): the pairs would not be paired")
                continue
            k = (r["prompt_id"], r["policy"], r["kv_budget"])
            if k in seen:
                raise DataError(f"--merge: {k} appears twice")
            seen.add(k)
            rows.append(r)
    summary = summarize_collapse(rows, n_resamples=args.bootstrap, seed=0)
    doc = {**merged_header(docs), "settings": merged_settings(docs), "wall_seconds": merged_wall_seconds(docs),
           "summary": summary, "rows": rows}
    name = args.name or "merged"
    path = write_atomic(Path(args.out) / f"collapse_{name}.json", dump(doc))
    print_tables(summary)
    log(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_or_merge(PROG, build_parser(), run, merge, argv)


if __name__ == "__main__":
    sys.exit(main())
