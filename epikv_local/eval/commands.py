"""The evaluation harness's subcommands of ``epikv-local``: ``labels`` and ``calibrate``."""

from __future__ import annotations

import argparse
import json


def add_commands(sub) -> dict:
    """Add ``labels`` and ``calibrate`` to ``sub``; returns {command name: runner(args) -> exit status}."""
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
    lp.add_argument("--batch", type=int, default=1, help="counterfactual branches decoded together in one batch "
                    "(default 1)")
    lp.add_argument("--out", default="results/labels.jsonl", help="output JSONL (resumed if it exists)")
    lp.add_argument("--threads", type=int, default=None)
    cp = sub.add_parser("calibrate", help="choose EPIKV layers/window/recent share, then the policy among the "
                                          "signals ('--policy calibrated'), for a model on dev traces")
    cp.add_argument("--model", help="GGUF model (default: the cached default model)")
    cp.add_argument("--traces", help="dev JSONL traces (default: ../shared/data/r1_traces_dev.jsonl beside a source checkout, "
                         "else the dev traces shipped with the package)")
    cp.add_argument("--quick", action="store_true", help="tiny grid on one short trace (smoke test)")
    cp.add_argument("--fast", action="store_true", help="the affordable profile for larger models: cheaper labels, "
                    "smaller grid (about 15 minutes for a 0.5B model on 2 cores; docs/calibration.md)")
    cp.add_argument("--full-grid", action="store_true", help="search the Cartesian grid, not coordinate-wise")
    cp.add_argument("--n-traces", type=int, default=None, help="dev traces for the fidelity grid (default 3)")
    cp.add_argument("--labels", help="labels JSONL to reuse (or to write, resumable) for the anatomy ranking")
    cp.add_argument("--out", help="write the calibration JSON here instead of the cache")
    cp.add_argument("--no-signals", action="store_true", help="skip step 3 (query statistics and the choice "
                    "among the signals): EPIKV's settings only")
    cp.add_argument("--threads", type=int, default=None)
    return {"labels": run_labels_cmd, "calibrate": run_calibrate_cmd}


def _model_path(arg: str | None):
    from ..api.models import default_model_path
    from ..engine.handles import check_gguf

    return check_gguf(arg) if arg else default_model_path()


def run_labels_cmd(args: argparse.Namespace) -> int:
    from ..engine.handles import Model
    from .labels import LabelSettings, run_labels

    model_path = _model_path(args.model)
    s = LabelSettings(max_tokens=args.max_tokens, horizon=args.horizon, delay=args.delay, stride=args.stride,
                      min_pos=args.min_pos, batch=args.batch)
    with Model(model_path) as model:
        stats = run_labels(model, model_path, args.traces, args.out, s, n_traces=args.n_traces,
                           n_threads=args.threads, control=args.control)
    print(json.dumps({"out": args.out, **stats}))
    return 0


def run_calibrate_cmd(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ..errors import ConfigError
    from .calibrate import FAST_GRID, QUICK_GRID, Grid, calibrate
    from .traces import default_dev_traces

    model_path = _model_path(args.model)
    traces = args.traces or str(default_dev_traces())
    if args.quick and args.fast:
        raise ConfigError("--quick and --fast are exclusive")
    grid = QUICK_GRID if args.quick else FAST_GRID if args.fast else Grid()
    if args.n_traces:
        grid = replace(grid, n_traces=args.n_traces)
    res = calibrate(model_path, traces, grid, full_grid=args.full_grid, n_threads=args.threads,
                    labels_path=args.labels, out=args.out, signals=not args.no_signals)
    print(json.dumps({"path": res.path, "layer_a": res.layer_a, "layer_b": res.layer_b, "window": res.window,
                      "recent_fraction": res.recent_fraction, "delta_nll": res.delta_nll,
                      "baseline_delta_nll": res.baseline_delta_nll,
                      "selected": None if res.selected is None else _brief(res.selected),
                      "selected_by_budget": {str(b): _brief(sel) for b, sel in res.selected_by_budget}},
                     default=str))
    return 0


def _brief(sel: dict) -> dict:
    """A step-3 choice as the command prints it."""
    return {k: sel.get(k) for k in ("policy", "options", "recent_fraction", "objective")}
