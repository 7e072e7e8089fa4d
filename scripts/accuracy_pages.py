#!/usr/bin/env python3
"""Token-view pages of an accuracy benchmark setting: for a few problems, the full cache and two policies side by
side, token by token, each answer marked right or wrong, so a reader can see why an answer was lost.

One page per setting (task, split, budget, prompt protected or counted): each problem is one case, its three runs
(full cache, ``--policies A,B`` at ``--budget``) generated from the same chat prompt as ``bench_accuracy.py``
(greedy, ``--max-tokens``) on a recording session, graded by ``epikv_local.eval.accuracy.grade``. Which
problems: ``--ids`` (all of them); else, with ``--records`` (a ``bench_accuracy.py`` JSONL of the same
setting), those whose recorded outcomes show an answer lost (full right, a policy wrong; ``--want differ``: not
all three agree, the lost ones first); else the first such problems in order (at most ``--scan`` tried). With
``--records`` each run's answer is also checked against the one recorded for its setting and problem: a
difference is printed and shown on the page (the pages replay the benchmark, they must not tell another story).

    python scripts/accuracy_pages.py -m "$(../shared/models/fetch.sh qwen2.5-coder-0.5b)" --task gsm8k \\
        --split dev --budget 192 --prompt counted --policies streaming,said_epikv --cases 3 \\
        --out gsm8k_dev_192_counted.html

The pages hold the problems' text: write them outside the repository (the data stays in ``../shared``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import load_problems  # noqa: E402
from benchlib import ROOT, ArgParser, csv_of, log, read_records  # noqa: E402

from epikv_local.eval.accuracy import INSTRUCTION  # noqa: E402

PROG = "accuracy_pages"


def wanted(outcomes: list[bool], want: str) -> bool:
    """Whether a problem's outcomes (full cache first) are worth a case: ``lost`` = the full cache right and a
    policy wrong; ``differ`` = not all the same."""
    return outcomes[0] and not all(outcomes) if want == "lost" else len(set(outcomes)) > 1


def pick_from_records(rows: list[dict], names: list[str], problems: list[dict], n: int, want: str) -> list[dict]:
    """Up to ``n`` problems whose recorded outcomes under the settings ``names`` (full first) are ``wanted``:
    those the full cache got right and a policy got wrong first, then (``differ``) the other disagreements, in
    file order."""
    by: dict[str, dict[str, bool]] = {}
    for r in rows:
        by.setdefault(r["id"], {})[r["setting"]] = r["correct"]
    lost, other = [], []
    for p in problems:
        got = by.get(p["id"], {})
        if not all(s in got for s in names):
            continue
        outcomes = [got[s] for s in names]
        if wanted(outcomes, want):
            (lost if outcomes[0] and not all(outcomes) else other).append(p)
    return (lost + other)[:n]


def run(args) -> int:
    from epikv_local.api.chat import chat_prompt
    from epikv_local.api.models import default_model_path
    from epikv_local.api.session_spec import resolve_session
    from epikv_local.api.tokenview import Case, Mark, check_output_path, render_cases, run_tokens, write_atomic
    from epikv_local.engine.handles import Model
    from epikv_local.engine.sampling import SamplingConfig
    from epikv_local.errors import ConfigError
    from epikv_local.eval.accuracy import grade
    from epikv_local.policies import policy_spec

    if len(args.policies) != 2:
        raise ConfigError(f"--policies takes two policies (shown beside the full cache), got {len(args.policies)}")
    for name in ("budget", "cases", "scan", "max_tokens", "full_budget"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    out = check_output_path(args.out)
    model_path = args.model or str(default_model_path())
    problems = load_problems(Path(args.data), args.task, args.split, args.levels, args.offset, None)
    protect = args.prompt == "protected"
    columns = [("full", "none", args.full_budget)] + [(p, p, args.budget) for p in args.policies]
    setting = {name: (f"full/{args.prompt}" if name == "full" else f"{name}@{args.budget}/{args.prompt}")
               for name, _, _ in columns}
    specs = [resolve_session(model_path, kv_budget=budget, kv_policy=policy, protect_prompt=protect,
                             n_threads=args.threads, flash_attn=not policy_spec(policy).cls.needs_attention)
             for _, policy, budget in columns]
    recorded: dict[tuple[str, str], dict] = {}
    if args.records:
        if not Path(args.records).is_file():
            raise ConfigError(f"{args.records} not found")
        rows = [r for r in read_records(Path(args.records)) if r.get("split") == args.split]
        expect = {"model": Path(model_path).name, "task": args.task, "max_tokens": args.max_tokens}
        other = {k: r.get(k) for r in rows[:1] for k in expect if r.get(k) != expect[k]}
        if other:
            raise ConfigError(f"{args.records} records another run ({other}; this one: {expect})")
        recorded = {(r["setting"], r["id"]): r for r in rows}
    if args.ids:
        known = {p["id"]: p for p in problems}
        missing = [i for i in args.ids if i not in known]
        if missing:
            raise ConfigError(f"--ids not in {args.task} {args.split}: {', '.join(missing)}")
        chosen, scan = [known[i] for i in args.ids], False
    elif args.records:
        chosen, scan = pick_from_records(rows, [setting[c[0]] for c in columns], problems, args.cases,
                                          args.want), False
        if not chosen:
            raise ConfigError(f"{args.records} has no problem of {args.split} whose outcomes "
                              f"{'show an answer lost' if args.want == 'lost' else 'differ'} between "
                              f"{', '.join(setting.values())}")
    else:
        chosen, scan = problems[:args.scan], True
    sampling = SamplingConfig(temperature=0.0, seed=0)
    cases, same, mismatches, checked = [], [], 0, 0
    t0 = time.perf_counter()
    with Model(model_path) as model:
        for p in chosen:
            # the chat template's tokens marked, as bench_accuracy's create_chat_completion marks them
            tokens, template = chat_prompt(model, f"{p['question']}\n{INSTRUCTION}")
            runs, marks = [], []
            for (name, _, budget), spec in zip(columns, specs):
                cal = spec.calibration
                run_ = run_tokens(model, tokens, spec.policy, spec.budget, spec.config, sampling, args.max_tokens,
                                  label=name if name == "full" else f"{name} @ {budget}",
                                  calibration=cal.path if cal else None, template=template)
                if name == "full" and run_.stats.n_evicted:
                    raise ConfigError(f"the full cache evicted {run_.stats.n_evicted} cells: raise --full-budget")
                g = grade(run_.text, p["gold"], p["numeric"], truncated=run_.stats.stop_reason == "length")
                mark = (f"right: {g.answer}" if g.correct else
                        f"wrong: {g.answer if g.answer is not None else 'no answer'} (gold {p['gold']})")
                rec = recorded.get((setting[name], p["id"]))
                checked += rec is not None
                if rec is not None and (rec["correct"], rec.get("answer")) != (g.correct, g.answer):
                    mismatches += 1
                    mark += f" · the benchmark recorded {rec.get('answer')!r}"
                    log(f"  {p['id']} {name}: {g.answer!r} here, {rec.get('answer')!r} in {args.records}")
                runs.append(run_)
                marks.append(Mark(bool(g.correct), mark))
            log(f"{p['id']}: " + ", ".join(f"{c[0]} {'right' if m.ok else 'wrong'}" for c, m in zip(columns, marks))
                + f" ({time.perf_counter() - t0:.0f} s)")
            case = Case(runs, title=f"{args.task} {args.split} {p['id']}", prompt=p["question"], marks=marks)
            if not scan or wanted([bool(m.ok) for m in marks], args.want):
                cases.append(case)
            else:
                same.append(case)
            if len(cases) == args.cases and not args.ids:  # --ids: every one asked for
                break
    if args.records and not checked:
        raise ConfigError(f"{args.records} holds no outcome of {', '.join(setting.values())} for these problems: "
                          "nothing to check the pages against (check --budget, --prompt, --split)")
    which = "the full cache right and a policy wrong" if args.want == "lost" else "not all three answers agree"
    how = ("the problems asked for" if args.ids else
           f"problems where, in {Path(args.records).name}, {which}" if args.records else
           f"the first problems (of {len(cases) + len(same)} tried) where {which}")
    if not cases:  # none wanted: show what was tried rather than an empty page
        cases, how = same[:args.cases], f"the first {min(len(same), args.cases)} problems (none tried had {which})"
    note = (f"{len(cases)} {args.task} {args.split} problems ({how}): a full cache ({args.full_budget} cells, "
            f"nothing evicted) beside {args.policies[0]} and {args.policies[1]} at {args.budget} cells, the prompt "
            f"{'protected' if protect else 'counted against the budget'}; greedy, at most {args.max_tokens} tokens, "
            f"the prompt of scripts/bench_accuracy.py. Each answer graded by epikv_local.eval.accuracy.grade.")
    meta = {"model": Path(model_path).name, "budget": f"{args.budget} cells", "prompt": args.prompt,
            "sampling": "greedy"}
    write_atomic(out, render_cases(cases, title=f"{args.task} {args.split} @ {args.budget} cells ({args.prompt})",
                                   meta=meta, note=note))
    log(f"{len(cases)} cases written to {out}" + (f"; {mismatches} of {checked} answers checked differ from the "
                                                   "records" if args.records else ""))
    return 0


def parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model (default: the default model)")
    p.add_argument("--task", choices=["gsm8k", "math"], default="gsm8k")
    p.add_argument("--split", choices=["dev", "test"], default="dev")
    p.add_argument("--levels", type=csv_of(int, "--levels"), default=[1, 2, 3], help="MATH levels (default 1,2,3)")
    p.add_argument("--policies", type=csv_of(str, "--policies"), default=["streaming", "said_epikv"],
                   help="the two policies beside the full cache")
    p.add_argument("--budget", type=int, default=192, help="the policies' KV budget, cells")
    p.add_argument("--prompt", choices=["protected", "counted"], default="counted")
    p.add_argument("--full-budget", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ids", type=csv_of(str, "--ids"), default=None, help="these problems (ids of the data file)")
    p.add_argument("--records", help="bench_accuracy.py records: show problems whose recorded outcomes are "
                   "--want, and check every answer against them")
    p.add_argument("--cases", type=int, default=3, help="problems on the page")
    p.add_argument("--offset", type=int, default=0, help="skip the first N problems of the split")
    p.add_argument("--want", choices=["lost", "differ"], default="lost",
                   help="without --ids: problems whose answer a policy lost (full right, a policy wrong), or any "
                        "whose answers differ")
    p.add_argument("--scan", type=int, default=10, help="without --ids/--records: problems tried at most")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--out", required=True, help="the HTML page")
    return p


def main(argv=None) -> int:
    from epikv_local.errors import run_main

    return run_main(PROG, lambda a: run(parser().parse_args(a)), argv)


if __name__ == "__main__":
    sys.exit(main())
