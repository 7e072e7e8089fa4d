#!/usr/bin/env python3
"""Accuracy under a KV budget: greedy answers of GSM8K / MATH problems through ``epikv_local.Llama``, graded by
``epikv_local.eval.accuracy``, for a full cache and for each policy × budget, with paired comparisons.

Each (setting, problem) is one chat turn on a fresh conversation (``Llama.reset()``): the problem with
"Please reason step by step, and put your final answer within \\boxed{}.", temperature 0, ``--max-tokens``.
A setting is ``full`` (policy ``none``, a cache that holds everything) or ``POLICY@BUDGET``; ``--prompt
counted`` counts the prompt against the budget (the papers' setting) instead of protecting it (the product's
default). Outcomes are appended to ``--records`` (JSONL, one line per setting and problem) as they come, so a
run can be stopped, resumed (done pairs are skipped) and split over machines; ``--merge`` summarises records:
per setting accuracy, mean generated tokens, the share of empty and of looping outputs, evictions, and exact
McNemar tests with paired-bootstrap CIs against ``full`` and against ``streaming`` at the same budget, and of
``--against`` (the default policy) against each other policy there.
``--calibration FILE`` adds ``epikv_calibrated`` (EPIKV with that calibration's layers, window and recent share)
and, when it has step 3, ``calibrated`` (the policy it selected for each budget); ``--calibration-runs calibrated``
runs only the latter. On ``--split dev`` records
``--merge`` also chooses the three budgets of the reported runs (``budget_choice``: where StreamingLLM loses
nearest 75 %, 50 % and 25 % of the full cache's right answers).

    python scripts/bench_accuracy.py -m MODEL --task gsm8k --split test --limit 40 \\
        --policies streaming,epikv,keydiff --budgets 128,192 --records results/accuracy_gsm8k.jsonl
    python scripts/bench_accuracy.py --merge --records results/accuracy_gsm8k.jsonl --out results/accuracy_gsm8k.json

Data: ``../shared/data`` (``--data``): gsm8k_test.jsonl (``split`` dev / test) and math500.jsonl (``--levels``).
Tune (choose budgets) on ``--split dev`` only; ``test`` is for reported results.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (ROOT, ArgParser, add_calibration_args, append_record, calibration_record, csv_of,  # noqa: E402
                      log, provenance, read_records, records_to_merge, run_or_merge, save_json, with_calibration)

from epikv_local.errors import ConfigError  # noqa: E402
from epikv_local.eval.accuracy import INSTRUCTION  # noqa: E402  (the same turn as calibrate's accuracy objective)
from epikv_local.policies import DEFAULT_POLICY  # noqa: E402

PROG = "bench_accuracy"


def load_problems(data: Path, task: str, split: str, levels: list[int], offset: int, limit: int | None) -> list[dict]:
    """[{"id", "question", "gold", "numeric"}] of the task, in file order."""
    if task == "gsm8k":
        path = data / "gsm8k_test.jsonl"
        rows = [r for r in _jsonl(path) if r["split"] == split]
        out = [{"id": r["id"], "question": r["question"], "gold": r["answer"], "numeric": True} for r in rows]
    elif task == "math":
        if split != "test":
            raise ConfigError("MATH-500 has one split (test): give --split test")
        rows = [r for r in _jsonl(data / "math500.jsonl") if r["level"] in levels]
        out = [{"id": r["unique_id"], "question": r["problem"], "gold": r["answer"], "numeric": False} for r in rows]
    else:
        raise ConfigError(f"unknown task {task!r}: gsm8k or math")
    return out[offset:offset + limit if limit else None]


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise ConfigError(f"{path} not found (--data names the folder of the shared evaluation data)")
    return [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]


def settings_of(policies: list[str], budgets: list[int], with_full: bool,
                recent_fraction: float | None = None) -> list[tuple[str, str, int | None]]:
    """[(name, policy, budget)]: ``full`` first, then each policy at each budget; a recent share given with
    ``--recent-fraction`` is part of a policy's name (``said_prompt@192~recent0.25``), so its records never mix
    with those of the policy's own share."""
    out = [("full", "none", None)] if with_full else []
    tail = "" if recent_fraction is None else f"~recent{recent_fraction:g}"
    return out + [(f"{p}@{b}{tail}", p, b) for b in budgets for p in policies]


def check_same_run(rows: list[dict], config: dict, records: Path) -> None:
    """ConfigError when ``records`` holds outcomes of another configuration (model, task, max_tokens, ...):
    a resumed run must not mix them."""
    for r in rows:
        other = {k: r.get(k) for k in config}
        if other != config:
            diff = {k: (other[k], config[k]) for k in config if other[k] != config[k]}
            raise ConfigError(f"{records} holds outcomes of another configuration {diff} (records, this run): "
                              "use another --records file")


def run(args) -> int:
    from epikv_local.api.llama import Llama
    from epikv_local.policies import policy_spec
    from epikv_local.eval.accuracy import grade
    from epikv_local.eval.specs import check_policies, llama_policy_args

    from epikv_local.api.models import default_model_path

    model = args.model or str(default_model_path())
    problems = load_problems(Path(args.data), args.task, args.split, args.levels, args.offset, args.limit)
    if not problems:
        raise ConfigError("no problems selected (check --task, --split, --levels, --offset, --limit)")
    check_policies(args.policies)  # a typo is refused before any file or answer
    if args.recent_fraction is not None:
        if not 0.0 <= args.recent_fraction < 1.0:
            raise ConfigError(f"--recent-fraction must be in [0, 1), got {args.recent_fraction}")
        if args.calibration:
            raise ConfigError("--recent-fraction with --calibration: a calibration brings its own recent share")
    records = Path(args.records)
    append_record(records, None)
    config = {"model": Path(model).name, "task": args.task, "split": args.split, "max_tokens": args.max_tokens}
    rows = read_records(records)
    check_same_run(rows, config, records)
    done = {(r["setting"], r["id"]) for r in rows}
    protect = args.prompt == "protected"
    policies, cal, cal_name = with_calibration(args, model, rows, records)
    for name, policy, budget in settings_of(policies, args.budgets, not args.no_full, args.recent_fraction):
        todo = [p for p in problems if (f"{name}/{args.prompt}", p["id"]) not in done]
        if not todo:
            continue
        kv_budget = budget if budget is not None else args.full_budget
        log(f"{name} ({args.prompt} prompt): {len(todo)} problems")
        how = llama_policy_args(policy, budget, cal)
        recent = args.recent_fraction if budget is not None else None  # the full cache evicts nothing
        if recent is not None:
            how["recent_fraction"] = recent
        with Llama(model_path=model, kv_budget=kv_budget, protect_prompt=protect, n_threads=args.threads, seed=0,
                   verbose=False, flash_attn=not policy_spec(how["kv_policy"]).cls.needs_attention, **how) as llm:
            for p in todo:
                llm.reset()
                t0 = time.perf_counter()
                out = llm.create_chat_completion(
                    messages=[{"role": "user", "content": f"{p['question']}\n{INSTRUCTION}"}],
                    temperature=0, max_tokens=args.max_tokens)
                msg, finish = out["choices"][0]["message"], out["choices"][0]["finish_reason"]
                # the reasoning split off again at its tag: a box inside the reasoning is not the answer
                text = (msg.get("reasoning_content") or "") + "\n</think>\n" + (msg.get("content") or "") \
                    if msg.get("reasoning_content") else (msg.get("content") or "")
                g = grade(text, p["gold"], p["numeric"], truncated=finish == "length")
                ext = out["epikv"]
                if budget is None and ext["n_evicted"]:
                    raise ConfigError(f"the full cache evicted {ext['n_evicted']} cells: raise --full-budget")
                rec = {**config, "setting": f"{name}/{args.prompt}", "policy": policy, "budget": budget,
                       "prompt": args.prompt, "id": p["id"], "answer": g.answer,  # no gold: the data stays in ../shared
                       "correct": g.correct, "empty": g.empty, "looping": g.looping,
                       "n_prompt": out["usage"]["prompt_tokens"], "n_generated": out["usage"]["completion_tokens"],
                       "finish_reason": finish, "n_evicted": ext["n_evicted"],
                       "max_live_cells": ext["max_live_cells"], "seconds": round(time.perf_counter() - t0, 2),
                       "text": text if args.keep_text else None}
                rec.update(calibration_record(how, cal_name))
                if recent is not None:
                    rec["recent_fraction"] = recent
                append_record(records, rec)  # one whole line per outcome: resumable
                log(f"  {p['id']}: {'right' if g.correct else 'wrong'} ({g.answer!r:.30} vs {p['gold']!r:.30}), "
                    f"{rec['n_generated']} tokens, {rec['n_evicted']} evicted, {rec['seconds']} s")
    return merge(args) if args.out else 0


def merge(args) -> int:
    from epikv_local.eval.accuracy import mcnemar, paired_bootstrap

    records = Path(args.records)
    rows = records_to_merge(records)
    check_same_run(rows, {k: rows[0].get(k) for k in ("model", "task", "split", "max_tokens")}, records)
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["setting"], {})[r["id"]] = r
    against = DEFAULT_POLICY if args.against is None else args.against
    if args.against is not None and not any(r["policy"] == against for r in rows):  # a misspelt name must not compare nothing
        raise ConfigError(f"--against {against}: no outcomes of that policy in {records}")
    summary = {}
    for name, recs in sorted(by.items()):
        n = len(recs)
        rs = list(recs.values())
        summary[name] = {"n": n, "accuracy": sum(r["correct"] for r in rs) / n,
                         "mean_generated": sum(r["n_generated"] for r in rs) / n,
                         "empty_share": sum(r["empty"] for r in rs) / n,
                         "looping_share": sum(r["looping"] for r in rs) / n,
                         "mean_evicted": sum(r["n_evicted"] for r in rs) / n,
                         "cut_off_share": sum(r["finish_reason"] == "length" for r in rs) / n,
                         "policy": rs[0]["policy"], "budget": rs[0]["budget"], "prompt": rs[0]["prompt"],
                         **({"calibration": rs[0]["calibration"]} if rs[0].get("calibration") else {})}

    def compare(a: str, b: str) -> dict | None:
        ids = sorted(set(by.get(a, {})) & set(by.get(b, {})))
        if not ids:
            return None
        x = [by[a][i]["correct"] for i in ids]
        y = [by[b][i]["correct"] for i in ids]
        d, lo, hi = paired_bootstrap(x, y)
        return {"n": len(ids), **mcnemar(x, y), "difference": d, "ci95": [lo, hi]}

    full = next((k for k in by if k.startswith("full/")), None)  # one full-cache run serves both prompt modes
    for name, s in summary.items():
        s["vs_full"] = compare(name, full) if full and name != full else None
        ref = f"streaming@{s['budget']}/{s['prompt']}"
        s["vs_streaming"] = compare(name, ref) if s["budget"] is not None and name != ref and ref in by else None
        s["recovered"] = recovered(by, name, ref, full) if s["vs_streaming"] and full else None
        # the default policy head to head with each other policy at the same budget and prompt mode
        # (one more paired test per setting, on the problems both answered)
        mine = f"{against}@{s['budget']}/{s['prompt']}"
        s["vs_against"] = (compare(mine, name) if s["budget"] is not None and name != mine and mine in by
                           else None)
    where = records.resolve()
    doc = {**provenance("bench_accuracy.py", None),
           **{k: rows[0].get(k) for k in ("model", "task", "split", "max_tokens")},
           "records": str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else records.name,
           "against": against, "settings": summary}
    if doc.get("split") == "dev":  # budgets are chosen on dev only; test records report them
        doc["budget_choice"] = {prompt: choose_budgets(streaming_losses(by, by.get(full, {}), prompt))
                                for prompt in sorted({s["prompt"] for s in summary.values()})}
    save_json(args.out, doc)
    def cell(c: dict | None) -> str:
        return f"{c['difference']:+.1%} ({c['p']:.2f})" if c else "-"

    def share(r: dict | None) -> str:
        if not r:
            return "-"
        if r["share"] != r["share"]:  # NaN: StreamingLLM lost nothing
            return "none lost"
        return f"{r['share']:+.0%} [{r['ci95'][0]:+.0%}, {r['ci95'][1]:+.0%}]"

    print(f"{'setting':32} {'n':>4} {'acc':>6} {'gen':>6} {'loop':>5} {'vs full (p)':>16} {'vs streaming (p)':>18} "
          f"{'loss recovered':>22} {against + ' vs it (p)':>22}")
    for name, s in summary.items():
        print(f"{name:32} {s['n']:4d} {s['accuracy']:6.1%} {s['mean_generated']:6.0f} {s['looping_share']:5.0%} "
              f"{cell(s['vs_full']):>16} {cell(s['vs_streaming']):>18} {share(s['recovered']):>22} "
              f"{cell(s['vs_against']):>22}")
    for prompt, c in doc.get("budget_choice", {}).items():
        if c["chosen"]:
            print(f"budgets chosen on dev ({prompt} prompt): " + ", ".join(
                f"{b} ({label}: StreamingLLM loses {c['loss_share'][str(b)]:.0%})"
                for b, label in zip(c["chosen"], ("most", "middle", "a little"))))
        else:
            print(f"budgets chosen on dev ({prompt} prompt): none ({c['why']})")
    return 0


def recovered(by: dict[str, dict[str, dict]], name: str, streaming: str, full: str) -> dict:
    """Issue 21's goal figure for one setting: :func:`~epikv_local.eval.accuracy.recovered_share` of StreamingLLM's
    loss at the same budget and prompt mode, on the problems all three answered (with its ``goal_met``)."""
    from epikv_local.eval.accuracy import recovered_share

    ids = sorted(set(by[name]) & set(by[streaming]) & set(by[full]))
    return recovered_share(*([by[k][i]["correct"] for i in ids] for k in (name, streaming, full)))


#: StreamingLLM's share of the full cache's right answers lost at the smallest, middle and largest chosen budget
#: ("between a little and most of the full-cache accuracy", issue 21)
LOSS_TARGETS = (0.75, 0.5, 0.25)


def streaming_losses(by: dict[str, dict[str, dict]], full: dict[str, dict], prompt: str) -> dict[int, float]:
    """{budget: share of the full cache's right answers (``full``: its records by id) that StreamingLLM at that
    budget gets wrong}, for one prompt mode, on the problems the full cache and every StreamingLLM budget
    answered: a budget run on more problems (to compare a policy there) must not move the choice by its sample."""
    runs = {int(name.split("@")[1].split("/")[0]): recs for name, recs in by.items()
            if name.startswith("streaming@") and name.endswith(f"/{prompt}") and "~" not in name}
    common = set(full).intersection(*runs.values()) if runs else set()
    right = sorted(i for i in common if full[i]["correct"])
    return {b: sum(not recs[i]["correct"] for i in right) / len(right) for b, recs in runs.items()} if right else {}


def choose_budgets(losses: dict[int, float]) -> dict:
    """The three budgets whose StreamingLLM losses lie nearest :data:`LOSS_TARGETS` (smallest budget ~ most lost),
    by least squares over every ascending triple of the budgets run (ties: the first triple in ascending order).

    Returns {"chosen": [b1, b2, b3] ascending or [], "loss_share": {str(budget): share}, "targets", "why"}.
    """
    budgets = sorted(losses)
    best, why = None, ""
    if len(budgets) < 3:
        why = f"StreamingLLM ran at {len(budgets)} budget(s) with a full-cache run beside it; 3 are needed"
    else:
        from itertools import combinations
        best = min(combinations(budgets, 3),
                   key=lambda t: sum((losses[b] - goal) ** 2 for b, goal in zip(t, LOSS_TARGETS)))
    return {"chosen": list(best) if best else [], "loss_share": {str(b): losses[b] for b in budgets},
            "targets": list(LOSS_TARGETS), "why": why}


def parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model (default: the default model; for results, the path "
                   "../shared/models/fetch.sh qwen2.5-coder-0.5b prints)")
    p.add_argument("--task", choices=["gsm8k", "math"], default="gsm8k")
    p.add_argument("--split", choices=["dev", "test"], default="dev", help="GSM8K split (MATH-500: test)")
    p.add_argument("--levels", type=csv_of(int, "--levels"), default=[1, 2, 3],
                   help="MATH levels (default 1,2,3)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N problems of the split")
    p.add_argument("--limit", type=int, default=None, help="at most N problems")
    p.add_argument("--policies", type=csv_of(str, "--policies"), default=["streaming", "epikv"])
    add_calibration_args(p)
    p.add_argument("--budgets", type=csv_of(int, "--budgets"), default=[192])
    p.add_argument("--prompt", choices=["protected", "counted"], default="protected",
                   help="protected: the prompt is kept outside the eviction (the product's default); counted: it "
                        "counts against the budget (the papers' setting)")
    p.add_argument("--recent-fraction", type=float, default=None,
                   help="the recent window's share of each budget (default: what the product gives the policy: its "
                        "registered share, e.g. said_facts' 0.25, else 0.5); part of the setting's name")
    p.add_argument("--no-full", action="store_true", help="skip the full-cache setting")
    p.add_argument("--full-budget", type=int, default=4096, help="the full cache's cells (nothing evicted)")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-text", action="store_true", help="store each output's text in the records")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--records", required=True, help="JSONL of outcomes (appended; resumable)")
    p.add_argument("--out", help="the summary JSON (also written after a run)")
    p.add_argument("--merge", action="store_true", help="summarise --records only")
    p.add_argument("--against", help="the merge also compares this policy with every other one at the same budget "
                                      f"and prompt mode, paired (vs_against; default: the product's default, "
                                      f"{DEFAULT_POLICY}, where it ran)")
    return p


def main(argv=None) -> int:
    return run_or_merge(PROG, parser(), run, merge, argv)


if __name__ == "__main__":
    sys.exit(main())
