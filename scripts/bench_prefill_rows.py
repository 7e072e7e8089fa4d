#!/usr/bin/env python3
"""Would parallel sequences speed up the evaluation harness? Teacher-forced rows per second, side by side in
one run: one sequence decoding 64-row chunks (what fidelity passes, labels and ``calibrate`` do), one
sequence decoding 256-row chunks, and four sequences each feeding 64-row chunks into one pool (so a decode
can carry up to 256 rows of four traces). Every row's logits are read, as a teacher-forced pass does.

If a decode of more rows gave more rows per second, running several traces as sequences of one decode would
shorten ``calibrate``; on a compute-bound CPU it does not (docs/parallel.md, "The evaluation harness").

    M=$(../shared/models/fetch.sh qwen2.5-coder-0.5b)
    python scripts/bench_prefill_rows.py --model "$M" --threads 2 --repeats 2 --out results/prefill_rows_qwen05b.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import dev_trace_text, provenance, save_json  # noqa: E402

PROG = "bench_prefill_rows"


def single(model, tokens: list[int], chunk: int, threads: int) -> float:
    """Rows per second of one sequence fed ``tokens`` in chunks of ``chunk`` (all-row logits)."""
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    cfg = SessionConfig(n_batch=chunk, n_threads=threads)
    with Session(model, make_policy("streaming"), BudgetConfig(kv_budget=len(tokens)), cfg) as s:
        t0 = time.perf_counter()
        for i in range(0, len(tokens), chunk):
            s.decode_chunk(tokens[i:i + chunk], logits_all=True)
        return len(tokens) / (time.perf_counter() - t0)


def pooled(model, parts: list[list[int]], chunk: int, threads: int) -> tuple[float, int, int]:
    """(rows per second, rounds, rounds that carried several sequences) of ``len(parts)`` sequences, each fed
    its part in chunks of ``chunk`` from its own thread, in one pool whose decode takes all their chunks."""
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.pool import SequencePool
    from epikv_local.engine.session import SessionConfig
    from epikv_local.policies import make_policy

    cfg = SessionConfig(n_batch=chunk * len(parts), n_threads=threads)
    pool = SequencePool(model, make_policy("streaming"), BudgetConfig(kv_budget=max(map(len, parts))), cfg,
                        n_seq=len(parts))
    try:
        sessions = [pool.open() for _ in parts]
        errors: list = []

        def feed(s, toks):
            try:
                for i in range(0, len(toks), chunk):
                    s.decode_chunk(toks[i:i + chunk], logits_all=True)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads_ = [threading.Thread(target=feed, args=(s, p)) for s, p in zip(sessions, parts)]
        r0, s0 = pool.rounds.n_rounds, pool.rounds.n_shared
        t0 = time.perf_counter()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        dt = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return sum(map(len, parts)) / dt, pool.rounds.n_rounds - r0, pool.rounds.n_shared - s0
    finally:
        for s in pool.sessions():
            s.close()
        pool.close()


def main(argv=None) -> int:
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.errors import ConfigError, DataError

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=512, help="rows per sequence")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("threads", "rows", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    path = check_gguf(args.model) if args.model else default_model_path()
    runs = []
    with Model(path) as model:
        text = dev_trace_text()
        tokens = model.tokenize(text)
        if len(tokens) < 4 * args.rows:
            raise DataError(f"the dev traces hold {len(tokens)} tokens, fewer than 4 x --rows ({4 * args.rows})")
        parts = [tokens[k * args.rows:(k + 1) * args.rows] for k in range(4)]
        for rep in range(args.repeats):
            one64 = single(model, parts[0], 64, args.threads)
            one256 = single(model, parts[0], 256, args.threads)
            four, rounds, shared = pooled(model, parts, 64, args.threads)
            runs.append({"one_seq_64_rows_per_s": round(one64, 1), "one_seq_256_rows_per_s": round(one256, 1),
                         "four_seqs_64_rows_per_s": round(four, 1), "four_seqs_rounds": rounds,
                         "four_seqs_shared_rounds": shared})
            print(f"run {rep + 1}: 1 seq x 64 rows {one64:.1f} rows/s | 1 seq x 256 rows {one256:.1f} | "
                  f"4 seqs x 64 rows in one pool {four:.1f} ({shared} of {rounds} decodes shared)", flush=True)
    save_json(args.out, {**provenance("bench_prefill_rows.py", argv), "model": Path(path).name,
                         "settings": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
