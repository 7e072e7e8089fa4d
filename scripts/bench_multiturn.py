#!/usr/bin/env python3
"""Turn-two prefill of a chat on one budgeted cache vs the same turn on a fresh cache, side by side.

A two-turn conversation through ``epikv_local.Llama`` (greedy, the default model): turn one generates
``--turn1-tokens`` tokens; turn two's prompt (the whole conversation) is then decoded (a) on the same
``Llama``, which keeps the common prefix in its evicted cache and decodes only the new tokens, and (b) on a
fresh ``Llama`` (the whole prompt decoded). Prints and writes the tokens decoded and the prefill seconds of
each, and their ratio, per round.

    python scripts/bench_multiturn.py --rounds 3 --threads 1 --out results/multiturn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import git_rev, machine  # noqa: E402

PROG = "bench_multiturn"


def _stats_of(llm, msgs):
    """The statistics of a one-token chat turn, read from the last step of its stream."""
    *_, last = llm.chat_completion_steps(msgs, max_tokens=1, temperature=0)
    return last.stats


def one_round(model_path: str, args) -> dict:
    from epikv_local import Llama

    kw = dict(model_path=model_path, kv_budget=args.kv_budget, n_threads=args.threads, seed=1)
    msgs = [{"role": "user", "content": "Write a long story about a dragon who learns to count."}]
    with Llama(**kw) as chat:
        first = chat.create_chat_completion(messages=msgs, max_tokens=args.turn1_tokens, temperature=0)
        msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Now tell the same story in three sentences."}]
        reuse = _stats_of(chat, msgs)
    with Llama(**kw, protect_prompt=False) as fresh:  # a whole conversation as a first prompt exceeds the budget
        full = _stats_of(fresh, msgs)
    return {"turn1_generated": first["usage"]["completion_tokens"], "turn1_evicted": first["epikv"]["n_evicted"],
            "turn2_prompt_tokens": reuse.n_prompt_tokens,
            "reuse": {"decoded": reuse.n_prompt_decoded, "reused": reuse.n_prompt_reused,
                      "prefill_s": reuse.prefill_seconds, "max_live": reuse.max_live_cells},
            "fresh": {"decoded": full.n_prompt_decoded, "prefill_s": full.prefill_seconds,
                      "max_live": full.max_live_cells},
            "prefill_time_ratio_fresh_over_reuse": full.prefill_seconds / reuse.prefill_seconds}


def main(argv=None) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.errors import ConfigError
    from epikv_local.eval.io import write_atomic

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--kv-budget", type=int, default=256)
    ap.add_argument("--turn1-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    model_path = str(Path(args.model).expanduser() if args.model else default_model_path())
    rows = [one_round(model_path, args) for _ in range(args.rounds)]
    for r in rows:
        print(f"turn 2: {r['turn2_prompt_tokens']} prompt tokens; same cache decoded {r['reuse']['decoded']} "
              f"({r['reuse']['prefill_s'] * 1e3:.0f} ms), fresh cache {r['fresh']['decoded']} "
              f"({r['fresh']['prefill_s'] * 1e3:.0f} ms): {r['prefill_time_ratio_fresh_over_reuse']:.1f}x")
    doc = {"command": "python scripts/bench_multiturn.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "git_rev": git_rev(), "machine": machine(), "settings": vars(args), "model": Path(model_path).name,
           "rounds": rows, "median_prefill_time_ratio": statistics.median(
               r["prefill_time_ratio_fresh_over_reuse"] for r in rows)}
    if args.out:
        from epikv_local.eval.provenance import portable

        write_atomic(args.out, json.dumps(portable(doc), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
