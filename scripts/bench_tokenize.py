#!/usr/bin/env python3
"""How tokenizing with special-token parsing scales with the number of special tokens in the text, stock vs patched.

``Model.tokenize(text, add_special=False, parse_special=True)`` (llama_tokenize, as a chat prompt is tokenized)
on two texts, for each N: ``chat``, N chat turns ``<|im_start|>user\nhi<|im_end|>\n`` (2N special-token
occurrences with text between them), and ``dense``, N x ``<|im_start|><|im_end|>`` (2N special tokens and no text:
the special-token partition alone). Each library runs in its own subprocess (a process loads one libllama): the
installed one (``stock``, the package's lib/ with $EPIKV_LIB_DIR unset) and, with ``--lib-dir``, another build
(``patched``, e.g. one with patches/0004-tokenizer-st-partition-linear.patch), ``--rounds`` times alternately,
``--reps`` timings per N each time. Prints per-N seconds (the best timing) and the growth ratio per doubling of
N (2 = linear, 4 = quadratic), checks that both libraries produce the same tokens, and writes ``--out``.

    python scripts/bench_tokenize.py --ns 1000,2000,4000,8000,16000 --reps 3 --rounds 2 --lib-dir DIR \
        --out results/tokenize.json

The recorded command names paths outside the repository by placeholder (``PATCHED_LIB_DIR``); the libraries
are identified by the sha256 of their libllama.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, log, machine, git_rev, save_json  # noqa: E402

PROG = "bench_tokenize"
TURN = "<|im_start|>user\nhi<|im_end|>\n"
#: chat: N chat turns (2N special tokens, 2N text pieces); dense: N x "<|im_start|><|im_end|>" (2N special tokens,
#: no text between them: the partition alone, without the tokenizer's per-piece cost)
UNITS = {"chat": TURN, "dense": "<|im_start|><|im_end|>"}


def worker(args) -> int:
    """One library (the one EPIKV_LIB_DIR / the installed package names): time each N, print one JSON line."""
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.engine.native import load

    nat = load()
    lib = next(p for p in (nat.lib_dir / "libllama.so", nat.lib_dir / "libllama.dylib") if p.exists())
    rows = []
    with Model(check_gguf(args.model) if args.model else default_model_path(), native=nat) as model:
        model.tokenize(TURN * 10, add_special=False, parse_special=True)  # warm-up
        for kind, n in [(k, n) for k in args.texts for n in args.ns]:
            text = UNITS[kind] * n
            secs, toks = [], None
            for _ in range(args.reps):
                t0 = time.perf_counter()
                toks = model.tokenize(text, add_special=False, parse_special=True)
                secs.append(time.perf_counter() - t0)
            rows.append({"text": kind, "n": n, "n_special": 2 * n, "text_bytes": len(text.encode()),
                         "n_tokens": len(toks),
                         "tokens_sha256": hashlib.sha256(json.dumps(toks).encode()).hexdigest(),
                         "seconds": [round(s, 5) for s in secs]})
    print(json.dumps({"libllama_sha256": hashlib.sha256(lib.read_bytes()).hexdigest(), "rows": rows}), flush=True)
    return 0


def run_worker(label: str, lib_dir: str | None, args) -> dict:
    env = dict(os.environ)
    env.pop("EPIKV_LIB_DIR", None)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if lib_dir:
        env["EPIKV_LIB_DIR"] = str(Path(lib_dir).resolve())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--ns", ",".join(map(str, args.ns)),
           "--texts", ",".join(args.texts), "--reps", str(args.reps)] + (["--model", args.model] if args.model else [])
    log(f"{label}: {'installed library' if not lib_dir else lib_dir}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{PROG}: the {label} worker failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(label: str, runs: list[dict]) -> dict:
    """The rounds of one library merged: every rep's seconds, their best and median; growth per doubling of N
    from the best (the least disturbed by other load on the machine)."""
    rows = []
    for i, r in enumerate(runs[0]["rows"]):
        secs = [s for run in runs for s in run["rows"][i]["seconds"]]
        hashes = {run["rows"][i]["tokens_sha256"] for run in runs}
        assert len(hashes) == 1, f"{label}: the rounds disagree on the tokens of {r['text']} N={r['n']}"
        rows.append({**r, "seconds": secs, "best_s": min(secs), "median_s": round(statistics.median(secs), 5)})
    prev = None
    for r in rows:
        r["growth_per_doubling"] = None
        if prev is not None and prev["text"] == r["text"] and r["n"] == 2 * prev["n"] and prev["best_s"] > 0:
            r["growth_per_doubling"] = round(r["best_s"] / prev["best_s"], 2)
        prev = r
        log(f"{label}: {r['text']:>5} N={r['n']:>6} ({r['n_special']} special)  best {r['best_s']:.4f} s"
            + (f"  x{r['growth_per_doubling']}" if r["growth_per_doubling"] else ""))
    return {"library": "installed" if label == "stock" else "PATCHED_LIB_DIR",
            "libllama_sha256": runs[0]["libllama_sha256"], "rows": rows}


def recorded_command(argv: list[str]) -> str:
    """The command line with repository paths made relative and other paths replaced by a placeholder."""
    out, it = [], iter(argv)
    for a in it:
        if a in ("--lib-dir", "--out", "--model"):
            v = next(it, "")
            p = Path(v).resolve()
            try:
                v = p.relative_to(ROOT).as_posix()
            except ValueError:
                v = {"--lib-dir": "PATCHED_LIB_DIR", "--model": "MODEL", "--out": "OUT"}[a]
            out += [a, v]
        else:
            out.append(a)
    return "python scripts/bench_tokenize.py " + shlex.join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="1000,2000,4000,8000,16000", help="N: chat turns / token pairs")
    ap.add_argument("--texts", default="chat,dense", help="comma-separated: chat, dense")
    ap.add_argument("--reps", type=int, default=3, help="timings per N in each round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="worker runs per library, alternating stock and patched (their timings are merged)")
    ap.add_argument("--lib-dir", default=None, help="the patched library directory (as EPIKV_LIB_DIR)")
    ap.add_argument("--model", default=None, help="GGUF model (default: the cached default model)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default=None, help="recorded in the result (e.g. what else loaded the machine)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.ns = [int(x) for x in args.ns.split(",")]
    except ValueError:
        ap.error(f"--ns takes comma-separated integers, got {args.ns!r}")
    args.texts = args.texts.split(",")
    if set(args.texts) - set(UNITS):
        ap.error(f"--texts takes {', '.join(UNITS)}, got {','.join(args.texts)!r}")
    if args.reps < 1 or args.rounds < 1 or any(n < 1 for n in args.ns):
        ap.error("--ns, --reps and --rounds must be positive")
    if args.worker:
        return worker(args)

    labels = {"stock": None, **({"patched": args.lib_dir} if args.lib_dir else {})}
    runs: dict[str, list[dict]] = {k: [] for k in labels}
    for _ in range(args.rounds):
        for k, d in labels.items():
            runs[k].append(run_worker(k, d, args))
    libs = {k: summarize(k, v) for k, v in runs.items()}
    table = []
    for i, r in enumerate(libs["stock"]["rows"]):
        row = {"text": r["text"], "n": r["n"], "n_special": r["n_special"]}
        for k, v in libs.items():
            row[f"{k}_s"] = v["rows"][i]["best_s"]
            row[f"{k}_growth"] = v["rows"][i]["growth_per_doubling"]
        if "patched" in libs:
            row["identical_tokens"] = r["tokens_sha256"] == libs["patched"]["rows"][i]["tokens_sha256"]
            row["speedup"] = round(row["stock_s"] / row["patched_s"], 1) if row["patched_s"] > 0 else None
        table.append(row)
    print(f"{'text':>5} {'N':>6} {'special':>8} " + " ".join(f"{k + ' s':>10} {'x/2N':>6}" for k in libs)
          + ("  identical" if "patched" in libs else ""))
    for r in table:
        print(f"{r['text']:>5} {r['n']:>6} {r['n_special']:>8} "
              + " ".join(f"{r[k + '_s']:>10.4f} {(r[k + '_growth'] or 0):>6.2f}" for k in libs)
              + (f"  {r['identical_tokens']}" if "patched" in libs else ""))
    from epikv_local.api.models import default_model_path

    doc = {"command": recorded_command(argv), "git_rev": git_rev(), "machine": machine(),
           "model": Path(args.model).name if args.model else default_model_path(fetch=False).name,
           "texts": {k: f"N x {u!r}" for k, u in UNITS.items() if k in args.texts},
           "call": "Model.tokenize(text, add_special=False, parse_special=True)",
           "seconds": "best of reps x rounds (alternating stock and patched workers); the libraries' rows list all",
           "settings": {"ns": args.ns, "texts": args.texts, "reps": args.reps, "rounds": args.rounds},
           "load_average": [round(x, 2) for x in os.getloadavg()],
           **({"note": args.note} if args.note else {}), "table": table, "libraries": libs}
    save_json(args.out, doc)
    if "patched" in libs and not all(r["identical_tokens"] for r in table):
        print(f"{PROG}: the libraries produced different tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
