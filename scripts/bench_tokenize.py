#!/usr/bin/env python3
"""How tokenizing with special-token parsing scales with the number of special tokens in the text, stock vs patched.

``Model.tokenize(text, add_special=False, parse_special=True)`` (llama_tokenize, as a chat prompt is tokenized)
on a chat-like text of N turns ``<|im_start|>user\\nhi<|im_end|>\\n`` (2N special-token occurrences), for each N,
``--reps`` times. Each library runs in its own subprocess (a process loads one libllama): the installed one
(``stock``, the package's lib/ with $EPIKV_LIB_DIR unset) and, with ``--lib-dir``, another build (``patched``,
e.g. one with patches/0004-tokenizer-st-partition-linear.patch). Prints per-N seconds (median of the reps) and
the growth ratio per doubling of N (2 = linear, 4 = quadratic), checks that both libraries produce the same
tokens, and writes ``--out``.

    python scripts/bench_tokenize.py --ns 1000,2000,4000,8000,16000 --reps 3 --lib-dir DIR --out results/tokenize.json

The recorded command names paths outside the repository by placeholder (``PATCHED_LIB_DIR``); the libraries
are identified by the sha256 of their libllama.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, log, machine, git_rev, save_json  # noqa: E402

PROG = "bench_tokenize"
TURN = "<|im_start|>user\nhi<|im_end|>\n"


def chat_text(n_turns: int) -> str:
    return TURN * n_turns


def worker(args) -> int:
    """One library (the one EPIKV_LIB_DIR / the installed package names): time each N, print one JSON line."""
    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.engine.native import load

    nat = load()
    lib = next(p for p in (nat.lib_dir / "libllama.so", nat.lib_dir / "libllama.dylib") if p.exists())
    rows = []
    with Model(check_gguf(args.model) if args.model else default_model_path(), native=nat) as model:
        model.tokenize(chat_text(10), add_special=False, parse_special=True)  # warm-up
        for n in args.ns:
            text = chat_text(n)
            secs, toks = [], None
            for _ in range(args.reps):
                t0 = time.perf_counter()
                toks = model.tokenize(text, add_special=False, parse_special=True)
                secs.append(time.perf_counter() - t0)
            rows.append({"n_turns": n, "n_special": 2 * n, "text_bytes": len(text.encode()), "n_tokens": len(toks),
                         "tokens_sha256": hashlib.sha256(json.dumps(toks).encode()).hexdigest(),
                         "seconds": [round(s, 5) for s in secs], "median_s": round(statistics.median(secs), 5)})
    print(json.dumps({"libllama_sha256": hashlib.sha256(lib.read_bytes()).hexdigest(), "rows": rows}), flush=True)
    return 0


def run_library(label: str, lib_dir: str | None, args) -> dict:
    env = dict(os.environ)
    env.pop("EPIKV_LIB_DIR", None)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if lib_dir:
        env["EPIKV_LIB_DIR"] = str(Path(lib_dir).resolve())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--ns", ",".join(map(str, args.ns)),
           "--reps", str(args.reps)] + (["--model", args.model] if args.model else [])
    log(f"{label}: {'installed library' if not lib_dir else lib_dir}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{PROG}: the {label} worker failed (exit {proc.returncode})")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    prev = None
    for r in res["rows"]:
        r["growth_per_doubling"] = None
        if prev is not None and r["n_turns"] == 2 * prev["n_turns"] and prev["median_s"] > 0:
            r["growth_per_doubling"] = round(r["median_s"] / prev["median_s"], 2)
        prev = r
        log(f"{label}: N={r['n_turns']:>6} turns ({r['n_special']} special)  {r['median_s']:.4f} s"
            + (f"  x{r['growth_per_doubling']}" if r["growth_per_doubling"] else ""))
    return {"library": "installed" if not lib_dir else "PATCHED_LIB_DIR", **res}


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
    return "python scripts/bench_tokenize.py " + " ".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="1000,2000,4000,8000,16000", help="chat turns (2 special tokens each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lib-dir", default=None, help="the patched library directory (as EPIKV_LIB_DIR)")
    ap.add_argument("--model", default=None, help="GGUF model (default: the cached default model)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.ns = [int(x) for x in args.ns.split(",")]
    except ValueError:
        ap.error(f"--ns takes comma-separated integers, got {args.ns!r}")
    if args.reps < 1 or any(n < 1 for n in args.ns):
        ap.error("--ns and --reps must be positive")
    if args.worker:
        return worker(args)

    libs = {"stock": run_library("stock", None, args)}
    if args.lib_dir:
        libs["patched"] = run_library("patched", args.lib_dir, args)
    table = []
    for i, n in enumerate(args.ns):
        row = {"n_turns": n, "n_special": 2 * n}
        for k, v in libs.items():
            row[f"{k}_s"] = v["rows"][i]["median_s"]
            row[f"{k}_growth"] = v["rows"][i]["growth_per_doubling"]
        if "patched" in libs:
            row["identical_tokens"] = libs["stock"]["rows"][i]["tokens_sha256"] == libs["patched"]["rows"][i]["tokens_sha256"]
            row["speedup"] = round(row["stock_s"] / row["patched_s"], 1) if row["patched_s"] > 0 else None
        table.append(row)
    print(f"{'N turns':>8} {'special':>8} " + " ".join(f"{k + ' s':>10} {'x/2N':>6}" for k in libs)
          + ("  identical" if "patched" in libs else ""))
    for r in table:
        print(f"{r['n_turns']:>8} {r['n_special']:>8} "
              + " ".join(f"{r[k + '_s']:>10.4f} {(r[k + '_growth'] or 0):>6.2f}" for k in libs)
              + (f"  {r['identical_tokens']}" if "patched" in libs else ""))
    from epikv_local.api.models import default_model_path

    doc = {"command": recorded_command(argv), "git_rev": git_rev(), "machine": machine(),
           "model": Path(args.model).name if args.model else default_model_path(fetch=False).name,
           "text": f"N x {TURN!r} (2N special-token occurrences), "
                   "Model.tokenize(text, add_special=False, parse_special=True)",
           "settings": {"ns": args.ns, "reps": args.reps}, "table": table, "libraries": libs}
    save_json(args.out, doc)
    if "patched" in libs and not all(r["identical_tokens"] for r in table):
        print(f"{PROG}: the libraries produced different tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
