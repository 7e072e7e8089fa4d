#!/usr/bin/env python3
"""Write a Llama-3.2-1B-shaped GGUF with random weights (decode speed does not depend on weight values).

Architecture ``llama`` (default shape of Llama-3.2-1B: 16 layers, n_embd 2048, 32 query heads, 8 KV heads,
head_dim 64, n_ff 8192, tied input/output embeddings, RoPE base 500000; the llama3 RoPE frequency scaling is
left out, it does not change the cost). The vocabulary is SmolLM2's: its tokenizer metadata is copied from the
SmolLM2 GGUF (``gguf.GGUFReader``), so tokenization works and the vocab size is 49152 (Llama-3.2 has 128256:
the embedding and output matrices here are 2.6x smaller than the real model's, the transformer blocks are
the same size).

Random F16 weights (F32 norms) are streamed to a temporary GGUF with ``gguf.GGUFWriter`` (next to the output,
deleted afterwards), then quantized with the patched build's quantizer (``llama_model_quantize``, Q4_0 by
default) to ``--out``. The result is checked: it loads with ``epikv_local.engine.handles.Model`` and
greedy-decodes a few tokens. Prints the output path on the last line.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from epikv_local.errors import ConfigError, run_main  # noqa: E402

FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "f16": None}


def default_out() -> Path:
    from epikv_local.api.models import cache_dir

    return cache_dir() / "models" / "random-llama-1b-q4_0.gguf"


def tokenizer_fields(src: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, sub_type) of every ``tokenizer.*`` field of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def tensor_shapes(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int):
    """(name, numpy shape [rows=out, cols=in], is_norm) of every tensor of a llama model, in write order."""
    head_dim = n_embd // n_head
    kv = n_head_kv * head_dim
    yield "token_embd.weight", (n_vocab, n_embd), False
    for i in range(n_layer):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (n_embd,), True
        yield p + "attn_q.weight", (n_embd, n_embd), False
        yield p + "attn_k.weight", (kv, n_embd), False
        yield p + "attn_v.weight", (kv, n_embd), False
        yield p + "attn_output.weight", (n_embd, n_embd), False
        yield p + "ffn_norm.weight", (n_embd,), True
        yield p + "ffn_gate.weight", (n_ff, n_embd), False
        yield p + "ffn_up.weight", (n_ff, n_embd), False
        yield p + "ffn_down.weight", (n_embd, n_ff), False
    yield "output_norm.weight", (n_embd,), True


def write_f16(path: Path, args, tok_fields, n_vocab: int, seed: int) -> int:
    """Stream a random-weight F16 llama GGUF to path; returns the parameter count."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    head_dim = args.embd // args.n_head
    w.add_name(f"random-llama-{args.layers}L-{args.embd}")
    w.add_description("random weights (speed benchmarks only); tokenizer copied from SmolLM2-135M-Instruct")
    w.add_block_count(args.layers)
    w.add_context_length(args.context_length)
    w.add_embedding_length(args.embd)
    w.add_feed_forward_length(args.n_ff)
    w.add_head_count(args.n_head)
    w.add_head_count_kv(args.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # MOSTLY_F16
    for key, val, vtype, sub in tok_fields:
        w.add_key_value(key, val, vtype, sub_type=sub)
    shapes = list(tensor_shapes(args.layers, args.embd, args.n_head, args.n_head_kv, args.n_ff, n_vocab))
    n_params = 0
    for name, shape, is_norm in shapes:
        dt = np.float32 if is_norm else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        w.add_tensor_info(name, shape, np.dtype(dt), nbytes)
        n_params += int(np.prod(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, is_norm in shapes:
        if is_norm:
            t = np.ones(shape, dtype=np.float32)
        else:
            # uniform with std 1/sqrt(fan_in) (0.02 for the embedding): activations stay finite
            std = 0.02 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
            a = np.float32(np.sqrt(3.0) * std)
            t = (rng.random(shape, dtype=np.float32) * (2 * a) - a).astype(np.float16)
        w.write_tensor_data(t)
        del t
    w.close()
    return n_params


def quantize(src: Path, dst: Path, ftype: str, threads: int | None) -> None:
    from epikv_local.engine.native import load

    nat = load()
    ll = nat.llama
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, FTYPES[ftype])
    params.nthread = threads or 0
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise nat.error(f"llama_model_quantize failed ({rc})")


def check(path: Path, n_tokens: int = 4) -> dict:
    """Load the model and greedy-decode a few tokens; returns its shape and the tokens."""
    from epikv_local.api.generation import generate
    from epikv_local.engine.sampling import SamplingConfig
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.handles import Model
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    with Model(path) as model:
        prompt = model.tokenize("The quick brown fox jumps over the lazy dog.")
        with Session(model, make_policy("none"), BudgetConfig(kv_budget=64, protect_prompt=False),
                     SessionConfig(n_batch=32)) as s:
            res = generate(s, prompt, n_tokens, SamplingConfig(), ignore_eog=True)
        info = model.info
        return {"desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd, "n_head": info.n_head,
                "n_head_kv": info.n_head_kv, "n_vocab": info.n_vocab, "tokens": res.tokens,
                "flash_attn": res.stats.flash_attn}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output GGUF (default: <cache>/models/random-llama-1b-q4_0.gguf)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-head-kv", type=int, default=8)
    ap.add_argument("--n-ff", type=int, default=8192)
    ap.add_argument("--context-length", type=int, default=131072, help="n_ctx_train written to the GGUF")
    ap.add_argument("--ftype", choices=sorted(FTYPES), default="q4_0")
    ap.add_argument("--vocab-from", default=None, help="GGUF whose tokenizer is copied (default: SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="quantizer threads (default: all)")
    ap.add_argument("--no-check", action="store_true", help="skip the load-and-decode check")
    args = ap.parse_args(argv)
    for k in ("layers", "embd", "n_head", "n_head_kv", "n_ff"):
        if getattr(args, k) < 1:
            raise ConfigError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.embd % args.n_head or args.n_head % args.n_head_kv:
        raise ConfigError(f"--embd ({args.embd}) must divide by --n-head ({args.n_head}) and --n-head by "
                          f"--n-head-kv ({args.n_head_kv})")
    if args.embd % 32 or args.n_ff % 32:
        ap.error("n_embd and n_ff must be multiples of 32 (quantization blocks)")

    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import check_gguf

    src_vocab = check_gguf(args.vocab_from) if args.vocab_from else default_model_path()
    out = Path(args.out).expanduser() if args.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_fields(src_vocab)
    n_vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".random-model-") as tmp:
        f16 = Path(tmp) / "model-f16.gguf"
        n_params = write_f16(f16, args, tok, n_vocab, args.seed)
        t1 = time.perf_counter()
        print(f"wrote F16 GGUF: {n_params / 1e6:.1f} M parameters, vocab {n_vocab} (tokenizer of {src_vocab.name}), "
              f"{f16.stat().st_size / 2**20:.1f} MiB in {t1 - t0:.1f} s", file=sys.stderr)
        if args.ftype == "f16":
            f16.replace(out)
        else:
            quantize(f16, out, args.ftype, args.threads)
            print(f"quantized to {args.ftype}: {out.stat().st_size / 2**20:.1f} MiB in "
                  f"{time.perf_counter() - t1:.1f} s", file=sys.stderr)
    if not args.no_check:
        info = check(out)
        print(f"check: {info['desc']}, {info['n_layer']} layers, n_embd {info['n_embd']}, heads "
              f"{info['n_head']}/{info['n_head_kv']}, vocab {info['n_vocab']}; decoded {info['tokens']}",
              file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("make_random_model", main))
