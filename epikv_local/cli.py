"""Command line: ``epikv-local generate|demo|fetch-model|labels|calibrate``.

Every expected failure (bad path, non-GGUF file, unsupported architecture, layers beyond the model's depth,
budget too small for the protected tokens, ...) prints one line ``epikv-local: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

DEMO_PROMPT = (
    "Solve step by step, checking each step: a train travels 60 km in the first hour and 45 km in the second "
    "hour. Then it stops for 30 minutes and travels 90 km in 1.5 hours. What is its average speed over the "
    "whole trip, including the stop? Explain your reasoning in detail before giving the final answer."
)


def _layers_arg(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes one or two comma-separated integers, got {text!r}")
    if not 1 <= len(vals) <= 2:
        raise argparse.ArgumentTypeError(f"--layers takes one or two layers, got {len(vals)}")
    return vals


def _add_run_args(p: argparse.ArgumentParser, demo: bool) -> None:
    if not demo:
        p.add_argument("--model", required=True, help="path to a GGUF model file")
        p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", default=demo, help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=600 if demo else 256)
    p.add_argument("--kv-budget", type=int, default=256 if demo else 2048, help="maximum live KV cells")
    from .policies import REGISTRY

    p.add_argument("--policy", choices=sorted(REGISTRY), default="epikv")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--n-recent", type=int, default=None, help="recent tokens kept (default: half the budget)")
    p.add_argument("--evict-chunk", type=int, default=16)
    p.add_argument("--no-protect-prompt", action="store_true", help="allow evicting prompt tokens")
    p.add_argument("--layers", type=_layers_arg, default=None,
                   help="EPIKV-family layers A[,B] of this model (default: 10,21 of 32 mapped by relative depth)")
    p.add_argument("--window", type=int, default=None,
                   help="rolling z-score window (tokens; default 128, or the model's calibration)")
    p.add_argument("--capture", choices=["layer_out", "callback"], default="layer_out")
    p.add_argument("--no-flash-attn", action="store_true",
                   help="run with flash attention off (required by the attention policies: h2o, tova, snapkv)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, default=64, help="tokens per decode call (ubatch)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and stats at the end")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="epikv-local", description="EPIKV KV-cache eviction on llama.cpp")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_run_args(sub.add_parser("generate", help="generate text under a KV budget"), demo=False)
    _add_run_args(sub.add_parser("demo", help="reasoning prompt on the default model (SmolLM2-135M)"), demo=True)
    sub.add_parser("fetch-model", help="download and cache the default model; print its path")
    lp = sub.add_parser("labels", help="counterfactual importance labels of trace positions (JSONL)")
    lp.add_argument("--model", help="GGUF model (default: the cached default model)")
    lp.add_argument("--traces", required=True, help="JSONL traces with 'problem' and 'trace' fields")
    lp.add_argument("--n-traces", type=int, default=4)
    lp.add_argument("--max-tokens", type=int, default=768, help="tokens per trace (truncated; default 768)")
    lp.add_argument("--horizon", type=int, default=32, help="tokens decoded after each checkpoint (default 32)")
    lp.add_argument("--delay", type=int, default=2,
                    help="minimum tokens between a position and its checkpoint (>= 2; default 2)")
    lp.add_argument("--stride", type=int, default=16, help="checkpoint spacing = positions per checkpoint (16)")
    lp.add_argument("--min-pos", type=int, default=16, help="first labelled position (default 16)")
    lp.add_argument("--control", action="store_true", help="also re-decode the no-removal branch (control rows)")
    lp.add_argument("--out", default="results/labels.jsonl", help="output JSONL (resumed if it exists)")
    lp.add_argument("--threads", type=int, default=None)
    cp = sub.add_parser("calibrate", help="choose EPIKV layers/window/recent share for a model on dev traces")
    cp.add_argument("--model", help="GGUF model (default: the cached default model)")
    cp.add_argument("--traces", help="dev JSONL traces (default: ../shared/data/r1_traces_dev.jsonl)")
    cp.add_argument("--quick", action="store_true", help="tiny grid on one short trace (smoke test)")
    cp.add_argument("--full-grid", action="store_true", help="search the Cartesian grid, not coordinate-wise")
    cp.add_argument("--n-traces", type=int, default=None, help="dev traces for the fidelity grid (default 3)")
    cp.add_argument("--labels", help="labels JSONL to reuse (or to write, resumable) for the anatomy ranking")
    cp.add_argument("--out", help="write the calibration JSON here instead of the cache")
    cp.add_argument("--threads", type=int, default=None)
    return ap


def _run_labels(args) -> int:
    from .default_model import default_model_path
    from .labels import LabelSettings, run_labels
    from .model import Model, check_gguf

    model_path = check_gguf(args.model) if args.model else default_model_path()
    s = LabelSettings(max_tokens=args.max_tokens, horizon=args.horizon, delay=args.delay, stride=args.stride,
                      min_pos=args.min_pos)
    with Model(model_path) as model:
        stats = run_labels(model, model_path, args.traces, args.out, s, n_traces=args.n_traces,
                           n_threads=args.threads, control=args.control)
    print(json.dumps({"out": args.out, **stats}))
    return 0


def _run_calibrate(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from .calibration import QUICK_GRID, Grid, calibrate
    from .default_model import default_model_path
    from .model import check_gguf

    model_path = check_gguf(args.model) if args.model else default_model_path()
    traces = args.traces or str(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "r1_traces_dev.jsonl")
    grid = QUICK_GRID if args.quick else Grid()
    if args.n_traces:
        grid = replace(grid, n_traces=args.n_traces)
    res = calibrate(model_path, traces, grid, full_grid=args.full_grid, n_threads=args.threads,
                    labels_path=args.labels, out=args.out)
    print(json.dumps({"path": res.path, "layer_a": res.layer_a, "layer_b": res.layer_b, "window": res.window,
                      "recent_fraction": res.recent_fraction, "delta_nll": res.delta_nll,
                      "baseline_delta_nll": res.baseline_delta_nll}))
    return 0


def run(args: argparse.Namespace) -> int:
    from .default_model import default_model_path
    from .eviction import BudgetConfig
    from .generate import SamplingConfig, apply_chat_template, generate, tokenize_prompt
    from .model import Model, check_gguf
    from .native import load
    from .policies import EPIKV_POLICIES, make_policy
    from .scoring import ScoringConfig
    from .session import Session, SessionConfig

    if args.cmd == "fetch-model":
        print(default_model_path())
        return 0
    if args.cmd == "labels":
        return _run_labels(args)
    if args.cmd == "calibrate":
        return _run_calibrate(args)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    model_path = default_model_path() if args.cmd == "demo" else check_gguf(args.model)
    prompt = DEMO_PROMPT if args.cmd == "demo" else args.prompt
    recent_fraction = 0.5
    cal = None
    if args.policy in EPIKV_POLICIES and not args.layers and args.window is None:
        from .calibration import load_for_model

        cal = load_for_model(model_path)
        if cal is not None:
            recent_fraction = cal.recent_fraction
    budget = BudgetConfig(kv_budget=args.kv_budget, n_sink=args.n_sink, n_recent=args.n_recent,
                          recent_fraction=recent_fraction, protect_prompt=not args.no_protect_prompt,
                          evict_chunk=args.evict_chunk)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    nat = load(verbose=args.verbose)
    with Model(model_path, native=nat) as model:
        kwargs = {}
        if args.policy in EPIKV_POLICIES:
            n_layer = model.info.n_layer
            if args.layers:
                for il in args.layers:
                    if not 0 <= il < n_layer - 1:
                        raise ValueError(f"--layers {il} is beyond this {n_layer}-layer model "
                                         f"(capturable: 0..{n_layer - 2})")
                cfg = ScoringConfig(layer_a=args.layers[0], layer_b=args.layers[1] if len(args.layers) > 1 else None,
                                    ref_depth=n_layer, window=args.window or 128)
            elif cal is not None:
                cfg = cal.scoring_config()
            else:
                cfg = ScoringConfig(window=args.window or 128)
            kwargs["cfg"] = cfg
        policy = make_policy(args.policy, **kwargs)
        scfg = SessionConfig(n_batch=args.batch, n_threads=args.threads, capture_route=args.capture,
                             flash_attn=not args.no_flash_attn)
        text = apply_chat_template(model, prompt) if args.chat else prompt
        tokens = tokenize_prompt(model, text)
        stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        with Session(model, policy, budget, scfg) as session:
            session.engine.check_prompt(len(tokens))
            if cal is not None:  # said once the settings are known to work, so an error stays one line
                print(f"epikv-local: using calibration {cal.path}", file=sys.stderr)
            result = generate(session, tokens, args.max_tokens, sampling, tuple(args.stop), on_text=stream,
                              ignore_eog=args.ignore_eos)
    stats = result.stats.as_dict()
    if args.json:
        stats["text"] = result.text
        stats["model"] = str(model_path)
        print(json.dumps(stats))
    else:
        sys.stdout.write("\n\n")
        keys = ["policy", "kv_budget", "n_prompt_tokens", "n_generated_tokens", "n_evicted", "max_live_cells",
                "decode_tokens_per_s", "prefill_tokens_per_s", "kv_bytes", "flash_attn", "capture_route", "layers",
                "stop_reason"]
        print("  ".join(f"{k}={stats[k]}" for k in keys))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .default_model import DefaultModelError
    from .native import NativeError

    try:
        return run(args)
    except (ValueError, NativeError, DefaultModelError, RuntimeError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"epikv-local: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
