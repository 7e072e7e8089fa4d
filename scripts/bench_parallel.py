"""Concurrent streamed chats against ``epikv-local serve``: ``--parallel N`` (one context, N sequences decoded
together, each within --kv-budget) vs ``--parallel 1`` (one sequence: requests wait in the queue), measured
side by side in one run with the same client.

For each model and each N, N clients stream a chat each at once (end-of-generation tokens banned, so each
generates exactly --tokens tokens); reported per setting: aggregate generated tokens/s (all tokens / wall time
from the first request to the last token), the slowest stream's time to first token, the median per-stream
tokens/s, and the KV bytes the context allocates. (c), with ``--stock PATH`` (``bash
scripts/build_llama_server.sh`` builds it from the same pinned llama.cpp source, unpatched): stock
llama-server ``-np N``, flash attention on, a context that holds every stream whole. Also the largest number
of concurrent 8,192-token streams whose KV fits in 256 MiB, from the measured bytes per KV cell.

    python scripts/bench_parallel.py --models default,qwen2.5-coder-0.5b --ns 1,2,4,8 --tokens 256 \
        --stock build --out results/parallel.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import benchlib
from benchlib import ROOT, csv_of, log, provenance, save_json

NO_EOG_SMOL = {"0": -100, "2": -100}


def model_path(name: str) -> str:
    if name == "default":
        from epikv_local.api.models import default_model_path

        return str(default_model_path())
    import subprocess

    out = subprocess.run(["bash", str(ROOT.parent / "shared" / "models" / "fetch.sh"), name], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def eog_bias(path: str) -> dict:
    from epikv_local.engine.handles import Model
    from epikv_local.engine.native import load

    with Model(path, native=load()) as m:
        return {str(t): -100 for t in range(m.info.n_vocab) if m.is_eog(t)}


def streams(base: str, model: str, n: int, tokens: int, bias: dict) -> dict:
    import openai

    results: list = [None] * n
    t0 = time.perf_counter()

    def run(i):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=3600)
        start = time.perf_counter()
        first, count, kv = None, 0, None
        for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell a long story about the number {i}."}],
                max_tokens=tokens, temperature=0, logit_bias=bias, stream=True,
                stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
            ext = (chunk.model_extra or {}).get("epikv")
            if ext:
                kv = ext.get("kv_bytes", kv)
        end = time.perf_counter()
        results[i] = {"ttft_s": (first or end) - t0, "tokens": count, "seconds": end - start, "kv_bytes": kv,
                      "tokens_per_s": count / max(1e-9, end - (first or start))}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in results)
    kv = [r["kv_bytes"] for r in results if r["kv_bytes"]]
    return {"aggregate_tokens_per_s": total / wall, "wall_s": wall, "tokens": total, "kv_bytes": kv[0] if kv else None,
            "slowest_ttft_s": max(r["ttft_s"] for r in results),
            "median_stream_tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "streams": results}


def serve(path: str, parallel: int, budget: int, threads: int):
    sys.path.insert(0, str(ROOT / "tests" / "api"))
    import test_server  # the tests' subprocess server: free port, stopped on every path

    test_server.BUDGET = budget
    return test_server.serving(path, "--parallel", str(parallel), "-t", str(threads), "--max-queue", "64")


class Stock:
    """Stock llama-server ``-np n`` on a free port (stopped on every path); its KV bytes read from its log."""

    def __init__(self, binary: str, path: str, n: int, ctx: int, threads: int):
        import subprocess
        import tempfile

        from test_server import free_port, wait_healthy

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([binary, "-m", path, "--port", str(self.port), "--host", "127.0.0.1",
                                      "-np", str(n), "-c", str(ctx), "-fa", "on", "-t", str(threads),
                                      "-tb", str(threads), "-b", "64", "-ub", "64", "--no-webui"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.base, self.text)
        except RuntimeError:
            self.__exit__()
            raise

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def kv_bytes(self) -> int | None:
        import re

        m = re.findall(r"llama_kv_cache: size = +([0-9.]+) MiB", self.text())
        return int(float(m[-1]) * 2**20) if m else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self.log.close()


def bytes_per_cell(path: str) -> int:
    from epikv_local.engine.handles import KV_TYPES, Model
    from epikv_local.engine.native import load

    with Model(path, native=load()) as m:
        i = m.info
        return i.n_layer * i.n_head_kv * (i.n_embd // i.n_head) * (KV_TYPES["f16"][1] + KV_TYPES["f16"][1])


def run(args) -> dict:
    doc = provenance("bench_parallel.py", args.argv)
    doc.update({"kv_budget": args.kv_budget, "tokens": args.tokens, "threads": args.threads, "rows": []})
    for name in args.models:
        path = model_path(name)
        bias = eog_bias(path)
        per_cell = bytes_per_cell(path)
        cells = (256 * 2**20) // per_cell
        doc.setdefault("capacity_256MiB_8192_tokens", {})[name] = {
            "bytes_per_cell": per_cell, "a_parallel": max(0, (cells - 64) // args.kv_budget),
            "c_stock": cells // (8192 + 64)}
        for n in args.ns:
            row = {"model": name, "n": n}
            for mode, parallel in (("a_parallel", n), ("b_queue", 1)):
                with serve(path, parallel, args.kv_budget, args.threads) as s:
                    from test_server import http

                    _, models = http("GET", s.base + "/v1/models")
                    streams(s.base, "m", 1, 8, bias)  # warm-up
                    row[mode] = streams(s.base, "m", n, args.tokens, bias)
                    _, slots = http("GET", s.base + "/slots")
                    row[mode]["n_seq"] = len(slots)
                log(f"{name} N={n} {mode}: {row[mode]['aggregate_tokens_per_s']:.1f} tok/s, slowest first token "
                    f"{row[mode]['slowest_ttft_s']:.2f} s")
            if args.stock:
                with Stock(args.stock, path, n, n * (args.tokens + 128), args.threads) as st:
                    streams(st.base, "m", 1, 8, bias)  # warm-up
                    row["c_stock"] = streams(st.base, "m", n, args.tokens, bias)
                    row["c_stock"]["kv_bytes"] = st.kv_bytes()
                log(f"{name} N={n} c_stock: {row['c_stock']['aggregate_tokens_per_s']:.1f} tok/s, slowest first "
                    f"token {row['c_stock']['slowest_ttft_s']:.2f} s")
                row["ratio_a_over_c"] = row["a_parallel"]["aggregate_tokens_per_s"] / row["c_stock"][
                    "aggregate_tokens_per_s"]
                row["ttft_ratio_a_over_c"] = row["a_parallel"]["slowest_ttft_s"] / row["c_stock"]["slowest_ttft_s"]
            row["ratio_a_over_b"] = row["a_parallel"]["aggregate_tokens_per_s"] / row["b_queue"][
                "aggregate_tokens_per_s"]
            row["ttft_ratio_a_over_b"] = row["a_parallel"]["slowest_ttft_s"] / row["b_queue"]["slowest_ttft_s"]
            doc["rows"].append(row)
            save_json(args.out, doc)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_parallel.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=csv_of(str, "--models"), default=["default"])
    p.add_argument("--ns", type=csv_of(int, "--ns"), default=[1, 2, 4])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--kv-budget", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stock", default=None,
                   help="a stock llama-server binary for (c); 'build': scripts/build_llama_server.sh's")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.stock == "build":
        import subprocess

        out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh")], capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise benchlib.ConfigError(f"scripts/build_llama_server.sh failed: {out.stderr.strip()[-300:]}")
        args.stock = out.stdout.strip().splitlines()[-1]
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(benchlib.run_main("bench_parallel.py", main))
