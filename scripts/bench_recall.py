#!/usr/bin/env python3
"""Recall of what was said, under a KV budget, through ``epikv_local.Llama`` (greedy): where recency must lose.

Two tasks, each over ``--policies`` × ``--budgets`` (and a full cache):

- ``passkey``: a fact ("The secret code is 48213.") placed at a relative ``--depths`` inside a long context of
  reasoning text (R1 traces of the dev split, ``../shared/data/r1_traces_dev.jsonl``) of ``--context`` tokens,
  then the question; the prompt is *not* protected (it counts against the budget, so a context of several
  budgets forces evictions inside it). Right when the answer contains the code.
- ``multiturn``: a conversation whose turns 2-4 give facts (a code, a name, a city), then user turns that ask
  for long answers (``--filler-tokens`` each) until turn 8 asks for one fact; the first prompt only is
  protected (the product's default). Right when the answer contains the fact. ``--notes-tokens K`` makes
  that first prompt long: K tokens of dev-trace text pasted as the user's notes (a protected prompt takes its
  share of the budget, and of a tier that holds the starting prompt's words too). ``--paste-tokens K`` makes
  the chat long in the caller's own words: each of the turns 5-7 pastes K tokens of dev-trace text (other
  notes of the user's, not protected) before its request, so that the caller's words outnumber what a tier
  of the ``said`` policies holds and the facts compete with them.

Records (JSONL, one line per case) are appended as they come, resumable; the summary (``--out``) gives per
setting the accuracy, per depth for passkey, and exact McNemar tests against the full cache and against
StreamingLLM at the same budget (``epikv_local.eval.accuracy``).

    python scripts/bench_recall.py -m MODEL --task passkey --context 1024 --budgets 256 \\
        --policies streaming,epikv --records results/recall_passkey.jsonl --out results/recall_passkey.json
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from epikv_local.errors import DataError  # noqa: E402
from benchlib import (ROOT, ArgParser, add_calibration_args, append_record, calibration_record, csv_of,  # noqa: E402
                      log, provenance, read_records, records_to_merge, run_or_merge, save_json, with_calibration)

PROG = "bench_recall"
FACTS = [("code", "My locker code is {v}.", "What is my locker code? Answer with the code only.",
          lambda r: str(r.randrange(1000, 9999))),
         ("name", "My dog's name is {v}.", "What is my dog's name? Answer with the name only.",
          lambda r: r.choice(["Bruno", "Pixel", "Maple", "Ziggy", "Nimbus", "Juniper", "Biscuit", "Tango"])),
         ("city", "I live in {v}.", "Which city do I live in? Answer with the city only.",
          lambda r: r.choice(["Tromso", "Valparaiso", "Ljubljana", "Windhoek", "Hobart", "Cusco", "Tartu"]))]
FILLERS = ["Explain in detail how a bicycle gear system works.", "Describe the water cycle step by step.",
           "Write a long story about a lighthouse keeper.", "Explain how compound interest works, with examples."]


def trace_file(data: Path) -> Path:
    """The dev traces' file in the data folder ``data``; DataError when it is missing."""
    path = Path(data) / "r1_traces_dev.jsonl"
    if not path.is_file():
        raise DataError(f"trace file not found: {path}")
    return path


def haystack(data: Path, model, n_tokens: int, seed: int, what: str = "--context") -> list[int]:
    """``n_tokens`` tokens of reasoning text (the dev traces, from a seeded start)."""
    rows = [json.loads(line) for line in trace_file(data).open(encoding="utf-8")]
    text = "\n\n".join(r["trace"] for r in random.Random(seed).sample(rows, len(rows)))
    tokens = model.tokenize(text.encode("utf-8"), add_bos=False)
    if len(tokens) < n_tokens:
        raise DataError(f"the dev traces have {len(tokens)} tokens, fewer than {what} {n_tokens}")
    return tokens[:n_tokens]


def seeds_of(args) -> range:
    """The cases' seeds: the dev cases (policies were designed on) are seeds below 1000, the reported ones from
    --first-seed 1000 on."""
    return range(args.first_seed, args.first_seed + args.seeds)


def passkey_cases(args) -> list[dict]:
    return [{"id": f"d{depth:.2f}-s{seed}", "depth": depth, "seed": seed,
             "code": str(random.Random(seed * 7919 + int(depth * 100)).randrange(10000, 99999))}
            for depth in args.depths for seed in seeds_of(args)]


def passkey_messages(llm, case: dict, args) -> list[dict]:
    """The chat of one passkey case: ``--context`` tokens of dev-trace text with the fact sentence at the case's
    depth, between an instruction and the question (also read by scripts/passkey_ranks.py)."""
    hay = haystack(Path(args.data), llm, args.context, case["seed"])
    at = int(case["depth"] * len(hay))
    fact = llm.tokenize(f"\n\nThe secret code is {case['code']}. Remember it.\n\n".encode(), add_bos=False)
    context = llm.detokenize(hay[:at] + fact + hay[at:]).decode("utf-8", "replace")
    return [{"role": "user", "content": "Read the notes below; a secret code is hidden in them.\n\n" + context
             + "\n\nWhat is the secret code? Answer with the number only."}]


def run_passkey(llm, case: dict, args) -> tuple[str, dict]:
    out = llm.create_chat_completion(messages=passkey_messages(llm, case, args), temperature=0,
                                     max_tokens=args.answer_tokens)
    return out["choices"][0]["message"].get("content") or "", [out]


def multiturn_cases(args) -> list[dict]:
    out = []
    for seed in seeds_of(args):
        r = random.Random(seed)
        out.append({"id": f"c{seed}-{FACTS[seed % 3][0]}", "seed": seed, "ask": seed % 3,
                    "values": [make(r) for _, _, _, make in FACTS]})
    return out


def run_multiturn(llm, case: dict, args) -> tuple[str, dict]:
    values = case["values"]
    first = "Hi! I will tell you a few things about me; remember them."
    if args.notes_tokens:  # a long protected first prompt: the user pastes notes of theirs
        notes = llm.detokenize(haystack(Path(args.data), llm, args.notes_tokens, case["seed"], "--notes-tokens"))
        first += " First, here are some notes I am working on:\n\n" + notes.decode("utf-8", "replace")
    messages = [{"role": "user", "content": first}]
    turns = [FACTS[i][1].format(v=values[i]) for i in range(3)] + [FILLERS[(case["seed"] + k) % 4] for k in range(3)]
    if args.paste_tokens:  # long turns of the caller's own words, unprotected: notes pasted before each request
        for k in range(3):  # another stretch of the traces per turn (seeded by case and turn)
            pasted = haystack(Path(args.data), llm, args.paste_tokens, case["seed"] * 10 + k + 1, "--paste-tokens")
            turns[3 + k] = ("Here are more of my notes:\n\n" + llm.detokenize(pasted).decode("utf-8", "replace")
                            + "\n\n" + turns[3 + k])
    outs = []
    for text in turns:  # turn 1 is above; turns 2-4 give facts, 5-7 ask for long answers
        outs.append(llm.create_chat_completion(messages=messages, temperature=0, max_tokens=args.filler_tokens))
        messages += [{"role": "assistant", "content": outs[-1]["choices"][0]["message"].get("content") or ""},
                     {"role": "user", "content": text}]
    outs.append(llm.create_chat_completion(messages=messages, temperature=0, max_tokens=args.filler_tokens))
    messages += [{"role": "assistant", "content": outs[-1]["choices"][0]["message"].get("content") or ""},
                 {"role": "user", "content": FACTS[case["ask"]][2]}]
    outs.append(llm.create_chat_completion(messages=messages, temperature=0, max_tokens=args.answer_tokens))
    return outs[-1]["choices"][0]["message"].get("content") or "", outs


def run(args) -> int:
    from epikv_local.api.llama import Llama
    from epikv_local.errors import ConfigError
    from epikv_local.api.models import default_model_path
    from epikv_local.eval.specs import check_policies, llama_policy_args

    model = args.model or str(default_model_path())
    check_policies(args.policies)  # a typo is refused before any file or answer
    notes = {k: getattr(args, k) for k in ("notes_tokens", "paste_tokens")}  # the multi-turn chat's pasted notes
    for k, n in notes.items():
        if n < 0 or (n and args.task != "multiturn"):
            raise ConfigError(f"--{k.replace('_', '-')} must be 0 or more, for --task multiturn only; got {n} "
                              f"with --task {args.task}")
    if args.task == "passkey" or any(notes.values()):
        trace_file(args.data)  # so is a missing trace file
    records = Path(args.records)
    append_record(records, None)
    rows = read_records(records)
    config = {"model": Path(model).name, "task": args.task, "context": args.context if args.task == "passkey" else None,
              "filler_tokens": args.filler_tokens if args.task == "multiturn" else None,
              **{k: n or None for k, n in notes.items()}}  # (refused above outside the multi-turn task)
    for r in rows:
        if {k: r.get(k) for k in config} != config:
            raise ConfigError(f"{records} holds outcomes of another configuration ({r.get('task')}, "
                              f"{r.get('model')}): use another --records file")
    done = {(r["setting"], r["id"]) for r in rows}
    cases = passkey_cases(args) if args.task == "passkey" else multiturn_cases(args)
    policies, cal, cal_name = with_calibration(args, model, rows, records)
    settings = [("full", "none", args.full_budget)] + [(f"{p}@{b}", p, b) for b in args.budgets for p in policies]
    for name, policy, budget in settings:
        todo = [c for c in cases if (name, c["id"]) not in done]
        if not todo:
            continue
        log(f"{args.task} {name}: {len(todo)} cases")
        how = llama_policy_args(policy, budget, cal)
        with Llama(model_path=model, kv_budget=budget, n_threads=args.threads, seed=0, verbose=False,
                   protect_prompt=args.task == "multiturn", **how) as llm:
            for case in todo:
                llm.reset()
                t0 = time.perf_counter()
                answer, outs = (run_passkey if args.task == "passkey" else run_multiturn)(llm, case, args)
                want = case["code"] if args.task == "passkey" else case["values"][case["ask"]]
                # over the whole case: every call of a conversation evicts (each reports its own count)
                rec = {**config, "setting": name, "policy": policy, "budget": None if name == "full" else budget,
                       **case, "want": want, "answer": answer[:200],
                       "correct": want.lower() in answer.lower(),
                       "n_evicted": sum(o["epikv"]["n_evicted"] for o in outs),
                       "max_live_cells": max(o["epikv"]["max_live_cells"] for o in outs),
                       "tokens": outs[-1]["usage"]["prompt_tokens"] + outs[-1]["usage"]["completion_tokens"],
                       "seconds": round(time.perf_counter() - t0, 2), **calibration_record(how, cal_name)}
                append_record(records, rec)
                log(f"  {case['id']}: {'right' if rec['correct'] else 'wrong'} ({answer[:40]!r} vs {want!r}), "
                    f"{rec['n_evicted']} evicted of {rec['tokens']} tokens, {rec['seconds']} s")
    return merge(args) if args.out else 0


def merge(args) -> int:
    from epikv_local.errors import ConfigError
    from epikv_local.eval.accuracy import mcnemar, paired_bootstrap, recovered_share

    rows = records_to_merge(args.records)
    if len({r.get("task") for r in rows}) > 1:
        raise ConfigError(f"{args.records} holds outcomes of both tasks: merge one task's records at a time")
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["setting"], {})[r["id"]] = r
    summary = {}
    for name, recs in sorted(by.items()):
        rs = list(recs.values())
        s = {"n": len(rs), "accuracy": sum(r["correct"] for r in rs) / len(rs), "budget": rs[0]["budget"],
             "policy": rs[0]["policy"], "mean_evicted": sum(r["n_evicted"] for r in rs) / len(rs),
             **({"calibration": rs[0]["calibration"]} if rs[0].get("calibration") else {})}
        if rs[0]["task"] == "passkey":
            depths = sorted({r["depth"] for r in rs})
            s["by_depth"] = {f"{d:.2f}": sum(r["correct"] for r in rs if r["depth"] == d) /
                             sum(1 for r in rs if r["depth"] == d) for d in depths}
        for key, ref in (("vs_full", "full"), ("vs_streaming", f"streaming@{s['budget']}")):
            ids = sorted(set(recs) & set(by.get(ref, {})))
            if ref != name and ids:
                x, y = [recs[i]["correct"] for i in ids], [by[ref][i]["correct"] for i in ids]
                d, lo, hi = paired_bootstrap(x, y)
                s[key] = {"n": len(ids), **mcnemar(x, y), "difference": d, "ci95": [lo, hi]}
        ref = f"streaming@{s['budget']}"
        ids = sorted(set(recs) & set(by.get(ref, {})) & set(by.get("full", {})))
        if "vs_streaming" in s and ids:  # issue 21's goal figure: the share of StreamingLLM's loss won back
            s["recovered"] = recovered_share(*([by[k][i]["correct"] for i in ids] for k in (name, ref, "full")))
        summary[name] = s
    save_json(args.out, {**provenance("bench_recall.py", None), "settings": summary})
    for name, s in summary.items():
        vs = s.get("vs_streaming")
        print(f"{name:24} n={s['n']:3d} recall {s['accuracy']:6.1%}  evicted {s['mean_evicted']:7.0f}"
              + (f"  vs streaming {vs['difference']:+.1%} (p={vs['p']:.2f})" if vs else "")
              + (f"  loss recovered {r['share']:+.0%} [{r['ci95'][0]:+.0%}, {r['ci95'][1]:+.0%}]"
                 if (r := s.get("recovered")) and r["share"] == r["share"] else "")  # NaN: nothing lost
              + (f"  by depth {s['by_depth']}" if "by_depth" in s else ""))
    return 0


def parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model (default: the default model)")
    p.add_argument("--task", choices=["passkey", "multiturn"], default="passkey")
    p.add_argument("--policies", type=csv_of(str, "--policies"), default=["streaming", "epikv"])
    add_calibration_args(p)
    p.add_argument("--budgets", type=csv_of(int, "--budgets"), default=[256])
    p.add_argument("--context", type=int, default=1024, help="passkey: tokens of context (>= 4 x the budget)")
    p.add_argument("--depths", type=csv_of(float, "--depths"), default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, default=4, help="cases per depth (passkey) or conversations (multiturn)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="first case seed: below 1000 for development (dev), 1000 and up for reported results")
    p.add_argument("--filler-tokens", type=int, default=200, help="multiturn: tokens of each long answer")
    p.add_argument("--notes-tokens", type=int, default=0,
                   help="multiturn: tokens of notes pasted into the (protected) first prompt (0: none)")
    p.add_argument("--paste-tokens", type=int, default=0,
                   help="multiturn: tokens of notes pasted into each of the turns 5-7 (not protected; 0: none)")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--full-budget", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--records", required=True)
    p.add_argument("--out")
    p.add_argument("--merge", action="store_true")
    return p


def main(argv=None) -> int:
    return run_or_merge(PROG, parser(), run, merge, argv)


if __name__ == "__main__":
    sys.exit(main())
