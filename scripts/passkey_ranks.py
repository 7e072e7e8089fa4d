"""Where a policy ranks a passkey's digits among its context: a diagnostic for ``bench_recall.py --task passkey``.

For each passkey case (the same contexts as bench_recall), the prompt is decoded with ``--policy``'s scoring (EPIKV by
default, or ``surprise``) and a cache
large enough that nothing is evicted; then, over the prompt's positions, it reports each code digit's score
percentile and how many context tokens score above the code's weakest digit, with the stored scores
(``span`` 0) and, for EPIKV, with ``span=2`` (``epikv_span``); for ``surprise`` also the digits' own surprisal and
the context's median (nats). With the prompt counted against 256 cells, half of them the
recent window, about 120 cells are left to the scores for ~1,000 older tokens: a code survives whole only if
fewer than that many tokens outrank its weakest digit, at every eviction round. The scores here are those of
an unevicted prefill, an approximation of the ones a bounded run computes (evictions change later hidden
states).

    python scripts/passkey_ranks.py -m MODEL --first-seed 0 --seeds 2 --out results/passkey_ranks_dev_qwen05b.json
    python scripts/passkey_ranks.py -m MODEL --policy surprise --out results/passkey_ranks_surprise_dev_qwen05b.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recall  # noqa: E402  the passkey contexts themselves
from benchlib import ArgParser, log, provenance, save_json  # noqa: E402

PROG = "passkey_ranks"


def code_span(tokens_text: list[str], code: str) -> list[int]:
    """Positions of the code's digit tokens: those after the second " secret" (the first is the instruction's);
    DataError when the code is not there as whole digit tokens (a tokenizer that merges it with punctuation)."""
    from epikv_local.errors import DataError

    hits = [i for i, t in enumerate(tokens_text) if "secret" in t]
    if len(hits) < 2:
        raise DataError("passkey context without its fact sentence")
    out, i, got = [], hits[1], ""
    while got != code and i < min(hits[1] + 16, len(tokens_text) - 1):
        i += 1
        if tokens_text[i].strip().isdigit():
            out.append(i)
            got += tokens_text[i].strip()
    if got != code:
        raise DataError(f"code {code} not found as digit tokens after the fact sentence")
    return out


def run(args) -> int:
    from epikv_local.api.llama import Llama
    from epikv_local.errors import ConfigError

    if args.seeds < 1 or not 64 <= args.context <= 32768 or args.first_seed < 0 or args.threads < 1:
        raise ConfigError("--seeds and --threads must be >= 1, --context in 64..32768, --first-seed >= 0")
    if args.policy not in ("epikv", "surprise"):
        raise ConfigError(f"--policy must be epikv or surprise, got {args.policy!r}")
    spans = (0, 2) if args.policy == "epikv" else (0,)  # the span setting is EPIKV's
    bench_recall.trace_file(args.data)  # a missing file is refused before the model loads
    from epikv_local.api.models import default_model_path

    args.model = args.model or str(default_model_path())
    rargs = bench_recall.parser().parse_args(["-m", args.model, "--task", "passkey", "--context", str(args.context),
                                              "--first-seed", str(args.first_seed), "--seeds", str(args.seeds),
                                              "--data", args.data, "--records", "unused.jsonl"])
    rows = []
    with Llama(model_path=args.model, kv_budget=args.context + 512, n_ctx=args.context + 512, n_threads=args.threads,
               seed=0, verbose=False, protect_prompt=False, kv_policy=args.policy) as llm:
        policy = llm._session.policy
        for case in bench_recall.passkey_cases(rargs):
            llm.reset()
            messages = bench_recall.passkey_messages(llm, case, rargs)
            out = llm.create_chat_completion(messages=messages, temperature=0, max_tokens=1)
            n = out["usage"]["prompt_tokens"]
            text = [llm.detokenize([t]).decode("utf-8", "replace") for t in llm._session.tokens[:n]]
            digits = code_span(text, case["code"])
            row = {"id": case["id"], "depth": case["depth"], "n_prompt": n, "code_start": digits[0]}
            if args.policy == "surprise":
                nll = policy._nll.get(np.arange(n))
                row["digit_surprisal"] = [round(float(nll[d]), 2) for d in digits]
                row["median_surprisal"] = round(float(np.nanmedian(nll)), 2)
            for span in spans:
                if span:
                    policy.span = span
                s = np.nan_to_num(policy.score(np.arange(n)), nan=-np.inf)
                if span:
                    policy.span = 0
                pct = [round(100.0 * float((s < s[d]).mean()), 1) for d in digits]
                row[f"span{span}"] = {"digit_percentiles": pct, "above_weakest_digit": int((s > s[digits].min()).sum())}
            rows.append(row)
            log(f"{case['id']}: digits at percentiles {row['span0']['digit_percentiles']}, "
                f"{row['span0']['above_weakest_digit']} tokens above the weakest"
                + (f" (span 2: {row['span2']['above_weakest_digit']})" if "span2" in row else ""))
    summary = {**provenance("passkey_ranks.py", args.argv), "model": Path(args.model).name, "policy": args.policy,
               "context": args.context, "first_seed": args.first_seed,
               "seeds": args.seeds, "cases": rows,
               "median_above_weakest_digit": {f"span{k}": float(np.median([r[f'span{k}']['above_weakest_digit']
                                                                            for r in rows]))
                                              for k in spans}}
    print(json.dumps(summary["median_above_weakest_digit"]))
    if args.out:
        save_json(args.out, summary)
    return 0


def parser() -> ArgParser:
    p = ArgParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model (default: the default model)")
    p.add_argument("--policy", default="epikv", help="epikv (default) or surprise")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--first-seed", type=int, default=0, help="dev: seeds below 1000")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=str(Path(__file__).resolve().parent.parent.parent / "shared" / "data"),
                   help="folder holding r1_traces_dev.jsonl")
    p.add_argument("--out", help="JSON of the ranks")
    return p


def main(argv=None) -> int:
    from epikv_local.errors import run_main

    def go(a):
        args = parser().parse_args(a)
        args.argv = a
        return run(args)

    return run_main(PROG, go, argv)


if __name__ == "__main__":
    raise SystemExit(main())
