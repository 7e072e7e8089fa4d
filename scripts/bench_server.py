#!/usr/bin/env python3
"""Streaming through ``epikv-local serve`` (openai client, HTTP, SSE) vs the same generation in-process.

Each round streams one chat completion twice, one after the other (never both at once: 2 cores): (a) through
the server, a subprocess started by this script (``epikv-local serve -t THREADS``), with the ``openai`` client;
(b) through ``epikv_local.Llama`` in this process, same model, budget, threads, prompt, greedy decoding and
``max_tokens``. End-of-generation tokens are banned (``logit_bias``) so both generate exactly ``--max-tokens``
tokens. Each round's prompt starts with its own number, so both sides decode the same fresh prompt (after the
chat template's shared system prefix, which both keep in cache from the previous round). A warm-up round on
each side is not recorded.

Measured on the client side of each: time to first token (request sent -> first chunk with text) and decode
tokens/s after it ((max_tokens - 1) / (end of stream - first text)); also the engine's own decode_tokens_per_s
from the ``epikv`` statistics. Prints the per-round values and the median ratios server / in-process.

    python scripts/bench_server.py --rounds 5 --threads 1 --out results/server.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, git_rev, machine  # noqa: E402

PROG = "bench_server"
QUESTION = "Explain step by step how a bicycle stays upright while it is moving."
ALIAS = "bench-model"


def eog_bias(model_path: str) -> dict[str, float]:
    """logit_bias banning the model's end-of-generation tokens (EOS and the chat template's end tokens)."""
    import gguf

    reader = gguf.GGUFReader(model_path)
    field = reader.fields.get("tokenizer.ggml.eos_token_id")
    ids = {int(field.parts[field.data[0]][0])} if field else set()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        names = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<end_of_turn>"}
        for i, idx in enumerate(tokens.data):
            if bytes(tokens.parts[idx]).decode("utf-8", "replace") in names:
                ids.add(i)
    return {str(i): -100.0 for i in sorted(ids)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, args, log) -> tuple[subprocess.Popen, str]:
    from epikv_local.errors import ConfigError

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "epikv_local.cli", "serve", "-m", model_path, "--kv-budget", str(args.kv_budget),
           "--port", str(port), "--model-alias", ALIAS, "-b", str(args.batch)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise ConfigError(f"the server exited with {proc.returncode}: {log.read().strip()[-500:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5):
                return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise ConfigError("the server did not come up within 180 s")


def timed(t0: float, chunks, text_of, finish_of, n_tokens: int) -> dict:
    """Client-side timings of one stream whose request was sent at ``t0`` (perf_counter): time to the first
    chunk with text, and tokens/s from it to the end of the stream (the other ``n_tokens - 1`` tokens; text
    chunks are not tokens: llama-cpp-python holds pieces back while they may begin a stop string)."""
    first, texts, last = None, [], None
    for c in chunks:
        t = text_of(c)
        if t:
            first = first or time.perf_counter()
            texts.append(t)
        last = c
    end = time.perf_counter()
    if first is None or finish_of(last) != "length":
        from epikv_local.errors import ConfigError

        raise ConfigError(f"the generation did not run to --max-tokens (finish_reason {finish_of(last)!r})")
    return {"ttft_s": first - t0, "n_tokens": n_tokens, "n_text_chunks": len(texts),
            "decode_tokens_per_s": (n_tokens - 1) / (end - first), "total_s": end - t0, "text": "".join(texts),
            "last": last}


def server_run(client, messages, args, bias) -> dict:
    def text_of(c):
        d = c.choices[0].delta
        return (d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")

    t0 = time.perf_counter()  # create() returns once the response has started: after the first token
    stream = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=args.max_tokens,
                                            temperature=0, logit_bias=bias, stream=True)
    r = timed(t0, stream, text_of, lambda c: c.choices[0].finish_reason, args.max_tokens)
    ext = (r.pop("last").model_extra or {}).get("epikv") or {}
    r["engine_decode_tokens_per_s"] = ext.get("decode_tokens_per_s")
    r["max_live_cells"] = ext.get("max_live_cells")
    return r


def api_run(llm, messages, args, bias) -> dict:
    def text_of(c):
        d = c["choices"][0]["delta"]
        return (d.get("content") or "") + (d.get("reasoning_content") or "")

    t0 = time.perf_counter()  # the call prefills and decodes the first token
    chunks = llm.create_chat_completion(messages=messages, max_tokens=args.max_tokens, temperature=0,
                                        logit_bias=bias, stream=True)
    r = timed(t0, chunks, text_of, lambda c: c["choices"][0]["finish_reason"], args.max_tokens)
    ext = r.pop("last").get("epikv") or {}
    r["engine_decode_tokens_per_s"] = ext.get("decode_tokens_per_s")
    r["max_live_cells"] = ext.get("max_live_cells")
    return r


def ratio(a, b):
    return a / b if a and b else None


def main(argv=None) -> int:
    from epikv_local import Llama
    from epikv_local.api.models import default_model_path
    from epikv_local.errors import ConfigError
    from epikv_local.eval.io import write_atomic

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--kv-budget", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 2:
        raise ConfigError("--rounds must be >= 1 and --max-tokens >= 2")
    import openai

    model_path = str(Path(args.model).expanduser() if args.model else default_model_path())
    bias = eog_bias(model_path)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryFile(mode="w+") as log, \
            Llama(model_path, kv_budget=args.kv_budget, n_threads=args.threads, n_batch=args.batch, seed=1) as llm:
        proc, base = start_server(model_path, args, log)
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
            for i in range(args.rounds + 1):  # round 0: warm-up, not recorded
                messages = [{"role": "user", "content": f"({i}) {QUESTION}"}]
                s = server_run(client, messages, args, bias)
                a = api_run(llm, messages, args, bias)
                if i == 0:
                    continue
                row = {"round": i, "server": {k: v for k, v in s.items() if k != "text"},
                       "api": {k: v for k, v in a.items() if k != "text"}, "same_text": s["text"] == a["text"],
                       "ttft_ratio_server_over_api": ratio(s["ttft_s"], a["ttft_s"]),
                       "decode_tps_ratio_server_over_api": ratio(s["decode_tokens_per_s"], a["decode_tokens_per_s"])}
                rows.append(row)
                print(f"round {i}: TTFT server {s['ttft_s'] * 1e3:.1f} ms, in-process {a['ttft_s'] * 1e3:.1f} ms "
                      f"({row['ttft_ratio_server_over_api']:.3f}x); decode server {s['decode_tokens_per_s']:.1f} "
                      f"tok/s, in-process {a['decode_tokens_per_s']:.1f} tok/s "
                      f"({row['decode_tps_ratio_server_over_api']:.3f}x; engine "
                      f"{s['engine_decode_tokens_per_s']:.1f} / {a['engine_decode_tokens_per_s']:.1f}); "
                      f"same text: {row['same_text']}", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def med(key, side=None):
        vals = [(r[side][key] if side else r[key]) for r in rows]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    summary = {"median_ttft_s": {"server": med("ttft_s", "server"), "api": med("ttft_s", "api")},
               "median_decode_tokens_per_s": {"server": med("decode_tokens_per_s", "server"),
                                              "api": med("decode_tokens_per_s", "api")},
               "median_ttft_ratio_server_over_api": med("ttft_ratio_server_over_api"),
               "median_decode_tps_ratio_server_over_api": med("decode_tps_ratio_server_over_api"),
               "all_same_text": all(r["same_text"] for r in rows)}
    print(f"median TTFT ratio server/in-process {summary['median_ttft_ratio_server_over_api']:.3f}, "
          f"median decode tokens/s ratio server/in-process {summary['median_decode_tps_ratio_server_over_api']:.3f}")
    doc = {"command": "python scripts/bench_server.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "git_rev": git_rev(), "machine": machine(), "settings": vars(args), "model": Path(model_path).name,
           "prompt": QUESTION, "banned_eog_tokens": sorted(int(k) for k in bias),
           "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()}, "rounds": rows, **summary}
    if args.out:
        from epikv_local.eval.provenance import portable

        write_atomic(args.out, json.dumps(portable(doc), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from epikv_local.errors import run_main

    sys.exit(run_main(PROG, main))
