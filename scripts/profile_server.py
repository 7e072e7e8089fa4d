"""Where the server's time goes per generated token: N concurrent streamed chats against ``epikv-local serve
--parallel N`` (bench_parallel.py's client and server), sampled by py-spy (``pip install py-spy``), plus each
server thread's CPU seconds from /proc.

With ``--engine``, first the same number of sequences without the server (``ek.generate_batch``, one
process), against one sequence: what batching the decode itself buys on this machine.

Reported: the share of py-spy's samples per thread (the decode thread, the generation threads, the event
loop), the share of the decode thread inside ``llama_decode``, the Python frames that take the most samples
outside it, and the CPU seconds of the event loop's thread and of the rest of the server (llama.cpp's
threads) against the wall time. py-spy pauses the process for each sample (``--native`` needs it), so the
profiled run is slower than a benchmark run: read the shares, not its speed.

    python scripts/profile_server.py --model qwen2.5-coder-0.5b --n 4 --tokens 384 --engine \
        --out results/profile_server_qwen05b.json
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from bench_parallel import eog_bias, model_path, serve, streams
from benchlib import log, provenance, save_json


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of ``pid``: "main" (the event loop) and the others
    summed as "other" (llama.cpp's decode and worker threads; generation threads that already ended are gone
    from /proc and not counted)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"main": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out["main" if int(tid) == pid else "other"] += (int(fields[11]) + int(fields[12])) / tick
    return out


#: Python frames where a thread waits (py-spy's --native mode samples waiting threads too)
WAITS = ("Condition.wait", "Condition.__enter__", "EpollSelector.select", "Event.wait", "Semaphore.acquire",
         "SimpleQueue.get", "Queue.get", "Thread.join", "_DecodeThread._loop", "time.sleep")


def summarize(raw: str, top: int) -> dict:
    """py-spy's raw output (one ``thread (tid): name;frame;frame… count`` line per stack) -> per thread, the
    share of the wall time it was busy (inside llama_decode or in Python, not waiting), the decode thread's
    share inside llama_decode, and the Python frames busy the longest. Shares are of the decode thread's
    samples (it is sampled at every tick: decoding or waiting), so the frames of several threads may sum
    past 1 (they run at once)."""
    samples: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    in_decode = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        parts = stack.split(";")
        name = re.sub(r"^Thread-\d+.*", "Thread-N", re.sub(r"^thread \(\d+\):?\s*", "", parts[0])) or "unnamed"
        samples[name] += n
        if any(p.startswith("llama_decode ") for p in parts):
            busy[name] += n
            in_decode += n if name == "epikv-decode" else 0
            continue
        python = [re.sub(r":\d+\)", ")", p) for p in parts[1:] if ".py:" in p]
        if python and not python[-1].startswith(WAITS):
            busy[name] += n
            frames[f"{name}: {python[-1]}"] += n
    ticks = samples["epikv-decode"] or max(samples.values(), default=0) or 1
    return {"samples": sum(samples.values()), "ticks": ticks,
            "thread_busy": {k: round(busy[k] / ticks, 4) for k, _ in samples.most_common()},
            "decode_thread_in_llama_decode": round(in_decode / ticks, 4),
            "top_python_frames": [{"frame": f, "share": round(v / ticks, 4)} for f, v in frames.most_common(top)]}


def engine_rounds(path: str, n: int, tokens: int, budget: int, threads: int, bias: dict) -> dict:
    """No server: ``n`` completions decoded together by ``ek.generate_batch`` (``n_parallel=n``), greedy,
    exactly ``tokens`` each. Returns tokens/s, rounds, the share of the wall inside llama_decode and the
    milliseconds one round's llama_decode takes (one token of each sequence)."""
    import epikv_local as ek

    with ek.Llama(path, n_parallel=n, kv_budget=budget, n_threads=threads) as llm:
        prompts = [f"Tell a long story about the number {i}." for i in range(n)]
        pool = llm._slots.pool if llm._slots is not None else llm._session.pool
        ek.generate_batch(llm, prompts, max_tokens=8, temperature=0)  # warm-up
        r0, s0, t0 = pool.rounds.n_rounds, pool.rounds.seconds, time.perf_counter()
        out = ek.generate_batch(llm, prompts, max_tokens=tokens, temperature=0,
                                logit_bias={int(k): v for k, v in bias.items()})
        wall = time.perf_counter() - t0
        rounds, decode_s = pool.rounds.n_rounds - r0, pool.rounds.seconds - s0
    generated = sum(o["usage"]["completion_tokens"] for o in out)
    return {"n": n, "tokens_per_s": round(generated / wall, 2), "rounds": rounds,
            "decode_share": round(decode_s / wall, 4), "ms_per_round": round(1000 * decode_s / max(1, rounds), 2)}


def run(args) -> dict:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).is_file():
        raise benchlib.ConfigError("py-spy is not installed: pip install py-spy")
    path = model_path(args.model)
    bias = eog_bias(path)
    doc = provenance("profile_server.py", args.argv)
    doc.update({"model": args.model, "n": args.n, "tokens": args.tokens, "kv_budget": args.kv_budget,
                "threads": args.threads, "rate_hz": args.rate, "native": args.native})
    if args.engine:  # the batching ceiling of the decode itself: n sequences per round against one
        one, many = (engine_rounds(path, k, args.tokens, args.kv_budget, args.threads, bias) for k in (1, args.n))
        doc["engine"] = {"one": one, "many": many,
                         "round_cost_ratio": round(many["ms_per_round"] / one["ms_per_round"], 3),
                         "tokens_per_s_ratio": round(many["tokens_per_s"] / one["tokens_per_s"], 3)}
        log(f"engine: {args.n} sequences {many['tokens_per_s']} tok/s vs one {one['tokens_per_s']} "
            f"({doc['engine']['tokens_per_s_ratio']}x); a round of {args.n} tokens costs "
            f"{doc['engine']['round_cost_ratio']}x one token's")
    with serve(path, args.n, args.kv_budget, args.threads) as s, tempfile.TemporaryDirectory() as tmp:
        streams(s.base, "m", args.n, 8, bias)  # warm-up
        # 1) unprofiled: CPU seconds per thread against the wall time
        before = thread_cpu(s.proc.pid)
        plain = streams(s.base, "m", args.n, args.tokens, bias)
        after = thread_cpu(s.proc.pid)
        doc["unprofiled"] = {"aggregate_tokens_per_s": round(plain["aggregate_tokens_per_s"], 2),
                             "wall_s": round(plain["wall_s"], 2),
                             "cpu_s": {k: round(after[k] - before[k], 2) for k in after}}
        # 2) profiled
        raw = Path(tmp) / "stacks.txt"
        cmd = [spy, "record", "--pid", str(s.proc.pid), "--rate", str(args.rate), "--format", "raw", "--threads",
               "-o", str(raw)] + (["--native"] if args.native else ["--nonblocking"])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)  # py-spy attached
            profiled = streams(s.base, "m", args.n, args.tokens, bias)
        finally:
            proc.send_signal(signal.SIGINT)
            err = proc.communicate(timeout=120)[1]
        if not raw.is_file():
            raise benchlib.ConfigError(f"py-spy wrote no profile: {err.strip()[-300:]}")
        doc["profiled"] = {"aggregate_tokens_per_s": round(profiled["aggregate_tokens_per_s"], 2),
                           **summarize(raw.read_text(), args.top)}
    u = doc["unprofiled"]
    log(f"unprofiled: {u['aggregate_tokens_per_s']} tok/s, event loop {u['cpu_s']['main']} CPU s and the rest "
        f"{u['cpu_s']['other']} CPU s in {u['wall_s']} s wall")
    p = doc["profiled"]
    log(f"profiled: decode thread inside llama_decode {100 * p['decode_thread_in_llama_decode']:.1f} %")
    for name, share in p["thread_busy"].items():
        log(f"  busy {100 * share:5.1f} % of the wall: {name}")
    for row in p["top_python_frames"][:10]:
        log(f"  {100 * row['share']:5.1f} %  {row['frame']}")
    if args.out:
        save_json(args.out, doc)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="profile_server.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--kv-budget", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--no-native", dest="native", action="store_false",
                   help="Python frames only (py-spy does not pause the process)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--engine", action="store_true",
                   help="also decode n and 1 sequences without the server (the batching ceiling)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    for name in ("n", "tokens", "kv_budget", "threads", "rate", "top"):
        if getattr(args, name) < 1:
            raise benchlib.ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(benchlib.run_main("profile_server.py", main))
