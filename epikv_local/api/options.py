"""The command-line options that ``generate``, ``serve`` and ``chat`` share (llama.cpp's names), in one place,
and their translation into the keyword arguments of ``resolve_session`` / ``epikv_local.Llama``.

Importing this module loads nothing native (the CLI builds its parser from it).
"""

from __future__ import annotations

import argparse

from ..engine.budget import DEFAULT_KV_BUDGET
from ..policies import REGISTRY


def layers_arg(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes one or two comma-separated integers, got {text!r}")
    if not 1 <= len(vals) <= 2:
        raise argparse.ArgumentTypeError(f"--layers takes one or two layers, got {len(vals)}")
    return vals


def add_model_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """-m (unless ``model`` is False: the default model), -ngl, --rpc, -ctk/-ctv, --no-flash-attn, -t, -b,
    --verbose."""
    from ..engine.handles import KV_TYPES

    if model:
        p.add_argument("-m", "--model", required=True, help="path to a GGUF model file")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                   help="layers offloaded to the GPU on a GPU build (-1: all; CPU builds ignore it)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="offload layers to llama.cpp rpc-server processes (trusted network only; docs/rpc.md)")
    p.add_argument("-ctk", "--cache-type-k", choices=list(KV_TYPES), default="f16", help="KV cache type of K")
    p.add_argument("-ctv", "--cache-type-v", choices=list(KV_TYPES), default="f16", help="KV cache type of V")
    p.add_argument("--no-flash-attn", action="store_true", help="run with flash attention off")
    p.add_argument("-t", "--threads", type=int, default=None, help="llama.cpp threads (default: CPUs available - 1)")
    p.add_argument("-b", "--batch", type=int, default=64, help="tokens per decode call (ubatch)")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")


def add_budget_args(p: argparse.ArgumentParser, kv_budget: int = DEFAULT_KV_BUDGET) -> None:
    """--kv-budget, --policy, the budget's protection and the policy settings --layers / --window."""
    attn = sorted(n for n, s in REGISTRY.items() if s.cls.needs_attention)
    p.add_argument("--kv-budget", type=int, default=kv_budget, help="maximum live KV cells")
    p.add_argument("--policy", "--kv-policy", dest="policy", choices=sorted(REGISTRY), default="epikv",
                   help=f"eviction policy (attention-based ones need --no-flash-attn: {', '.join(attn)})")
    p.add_argument("--n-sink", type=int, default=4, help="first tokens never evicted")
    p.add_argument("--n-recent", type=int, default=None,
                   help="recent tokens kept (default: the recent share of the budget, 0.5 or the calibration's)")
    p.add_argument("--evict-chunk", type=int, default=16, help="minimum positions evicted per round")
    p.add_argument("--no-protect-prompt", action="store_true", help="allow evicting the first prompt's tokens")
    p.add_argument("--layers", type=layers_arg, default=None,
                   help="policy setting 'layers': EPIKV layers A[,B] of this model (default: 10,21 of 32 mapped "
                        "by relative depth, or the model's calibration)")
    p.add_argument("--window", type=int, default=None,
                   help="policy setting 'window': rolling z-score window in tokens (default 128, or the "
                        "model's calibration)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--temp, --top-p, --top-k, --min-p, --repeat-penalty, -s, --stop (reasoning-model defaults)."""
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.6,
                   help="sampling temperature (<= 0: greedy); 0.6 as reasoning model cards recommend")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0, help="(0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="(0: off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="(1: off)")
    p.add_argument("-s", "--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def session_kwargs(args: argparse.Namespace) -> dict:
    """``resolve_session`` keyword arguments (the names of ``Llama``'s constructor) from the options above."""
    return dict(kv_budget=args.kv_budget, kv_policy=args.policy,
                kv_policy_settings={"layers": args.layers, "window": args.window}, n_sink=args.n_sink,
                n_recent=args.n_recent, protect_prompt=not args.no_protect_prompt, evict_chunk=args.evict_chunk,
                n_batch=args.batch, n_threads=args.threads, flash_attn=not args.no_flash_attn,
                type_k=args.cache_type_k, type_v=args.cache_type_v,
                capture_route=getattr(args, "capture", "layer_out"))


def llama_kwargs(args: argparse.Namespace) -> dict:
    """``epikv_local.Llama`` keyword arguments from the options above: the model's and the session's."""
    return dict(model_path=args.model, n_gpu_layers=args.n_gpu_layers, rpc_servers=args.rpc, verbose=args.verbose,
                **session_kwargs(args))
