"""The shapes and settings of the two modes (``PRESETS``), the four variants, and the options that override
them (``preset_from_args``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .common import CheckError

VARIANTS = {  # name -> (registered policy, flash attention)
    "plain": ("none", True),
    "epikv": ("epikv", True),
    "streaming": ("streaming", True),
    "h2o": ("h2o", False),
}


@dataclass
class Shape:
    layers: int
    embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    ftype: str


@dataclass
class Preset:
    bench: Shape
    check: Shape | None  # None: the native checks use the benchmark model
    contexts: list[int]
    budget: int
    n_batch: int
    decode_tokens: int
    max_context: int
    variant_cap_s: float
    deadline_s: float
    pytest_native: bool
    threads: int | None  # llama.cpp CPU threads; None: the package's default (engine.handles.resolve_threads)


PRESETS = {
    # Llama-3-8B: 32 layers, n_embd 4096, 32 heads / 8 KV heads (head_dim 128), n_ff 14336, vocab 128256
    # (tied embeddings: the output matrix is the embedding); the check model has SmolLM2-135M's shape
    "gpu": Preset(bench=Shape(32, 4096, 32, 8, 14336, "q4_k_m"), check=Shape(30, 576, 9, 3, 1536, "q4_0"),
                  contexts=[4096, 16384, 32768], budget=2048, n_batch=512, decode_tokens=32, max_context=262144,
                  variant_cap_s=40.0, deadline_s=480.0, pytest_native=True, threads=None),
    # one thread: ggml's spinning thread pool slows down badly when a 2-core machine is shared
    "cpu": Preset(bench=Shape(4, 256, 4, 2, 768, "q4_k_m"), check=None, contexts=[256, 512, 1024], budget=128,
                  n_batch=32, decode_tokens=16, max_context=4096, variant_cap_s=4.0, deadline_s=240.0,
                  pytest_native=False, threads=1),
}


def preset_from_args(args) -> Preset:
    """The mode's preset (a copy) with the options given on the command line."""
    base = PRESETS[args.mode]
    p = Preset(**{**asdict(base), "bench": Shape(**asdict(base.bench)),
                  "check": Shape(**asdict(base.check)) if base.check else None})
    if args.contexts:
        p.contexts = sorted(int(x) for x in args.contexts.split(",") if x.strip())
    for k in ("budget", "decode_tokens", "max_context", "variant_cap_s", "deadline_s", "threads"):
        if getattr(args, k) is not None:
            setattr(p, k, getattr(args, k))
    if args.batch is not None:
        p.n_batch = args.batch
    if args.ftype:
        p.bench.ftype = args.ftype
    if args.no_native_pytest:
        p.pytest_native = False
    if not p.contexts or min(p.contexts) <= p.budget:
        raise CheckError(f"every context must exceed the budget {p.budget}: {p.contexts}")
    if p.budget <= p.n_batch or p.decode_tokens < 1 or p.max_context < max(p.contexts):
        raise CheckError("need --budget > --batch, --decode-tokens >= 1 and --max-context >= the largest context")
    return p
