"""The evaluation harness's subcommands of ``epikv-local``: ``labels`` and ``calibrate``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from ..errors import ConfigError

#: calibrate's default --parallel: the passes of one setting (the default grid's 3 traces x 2 budgets) decoded 3 at
#: a time (48 rows of chunk 16 per decode). Measured side by side on 2 CPU cores (docs/calibration.md, "Parallel
#: passes"): 1.21x on Qwen2.5-Coder-0.5B, 1.04x on SmolLM2-135M; 6 at a time was slower than 3 on both
PARALLEL_DEFAULT = 3


def add_commands(sub) -> dict:
    """Add ``labels`` and ``calibrate`` to ``sub``; returns {command name: runner(args) -> exit status}."""
    lp = sub.add_parser("labels", help="counterfactual importance labels of trace positions (JSONL)")
    lp.add_argument("-m", "--model", help="GGUF model (default: the cached default model)")
    lp.add_argument("--traces", required=True, help="JSONL traces with 'problem' and 'trace' fields")
    lp.add_argument("--n-traces", type=int, default=4, metavar="N", help="traces labelled")
    lp.add_argument("--max-tokens", type=int, default=768, metavar="N", help="tokens per trace (truncated)")
    lp.add_argument("--horizon", type=int, default=32, metavar="N", help="tokens decoded after each checkpoint")
    lp.add_argument("--delay", type=int, default=2, metavar="N",
                    help="minimum tokens between a position and its checkpoint (>= 2)")
    lp.add_argument("--stride", type=int, default=16, metavar="N",
                    help="checkpoint spacing = positions per checkpoint")
    lp.add_argument("--min-pos", type=int, default=16, metavar="N", help="first labelled position")
    lp.add_argument("--control", action="store_true", help="also re-decode the no-removal branch (control rows)")
    lp.add_argument("--batch", type=int, default=1, metavar="N",
                    help="counterfactual branches decoded together in one batch")
    lp.add_argument("--out", default="results/labels.jsonl", metavar="PATH", help="output JSONL (resumed if it exists)")
    lp.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                    help="llama.cpp threads (default: CPUs available - 1, at most 8)")
    cp = sub.add_parser("calibrate", help="choose EPIKV layers/window/recent share, then the policy among the "
                                          "signals ('--policy calibrated'), for a model on dev traces")
    cp.add_argument("-m", "--model", help="GGUF model (default: the cached default model)")
    cp.add_argument("--traces", help="dev JSONL traces (default: ../shared/data/r1_traces_dev.jsonl beside a source checkout, "
                         "else the dev traces shipped with the package)")
    cp.add_argument("--quick", action="store_true", help="tiny grid on one short trace (smoke test)")
    cp.add_argument("--fast", action="store_true", help="the affordable profile for larger models: cheaper labels, "
                    "smaller grid (about 15 minutes for a 0.5B model on 2 cores; docs/calibration.md)")
    cp.add_argument("--full-grid", action="store_true", help="search the Cartesian grid, not coordinate-wise")
    cp.add_argument("--n-traces", type=int, default=None, metavar="N",
                    help="dev traces for the fidelity grid (default: 3)")
    cp.add_argument("--labels", metavar="PATH",
                    help="labels JSONL to reuse (or to write, resumable) for the anatomy ranking")
    cp.add_argument("--out", metavar="PATH", help="write the calibration JSON here instead of the cache")
    cp.add_argument("--no-signals", action="store_true", help="skip step 3 (query statistics and the choice "
                    "among the signals): EPIKV's settings only")
    cp.add_argument("--objective", choices=["delta_nll", "accuracy"], default="delta_nll",
                    help="what chooses EPIKV's settings: teacher-forced ΔNLL on the dev traces (default), or right "
                         "answers on GSM8K dev problems under a budget among the ΔNLL grid's best (step 4), and step 3's "
                         "policy for that budget among its best and StreamingLLM (3b)")
    cp.add_argument("--problems", metavar="PATH", help="--objective accuracy: a GSM8K JSONL with a split field, "
                    "dev rows only used (default: ../shared/data/gsm8k_test.jsonl beside a source checkout)")
    cp.add_argument("--accuracy-problems", type=int, metavar="N", help="dev problems answered (16)")
    cp.add_argument("--accuracy-budget", type=int, metavar="N", help="KV budget of the answers, prompt counted (192)")
    cp.add_argument("--accuracy-max-tokens", type=int, metavar="N", help="tokens per answer (400)")
    cp.add_argument("--accuracy-top-k", type=int, metavar="N", help="best ΔNLL settings tried besides the default (2)")
    cp.add_argument("--from", dest="reuse", metavar="PATH", help="--objective accuracy: re-rank this finished "
                    "calibration of the model (its JSON) on answers, without rerunning the labels, grid and signals")
    cp.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                    help="llama.cpp threads (default: CPUs available - 1, at most 8)")
    cp.add_argument("-np", "--parallel", type=int, default=PARALLEL_DEFAULT, metavar="N",
                    help="fidelity passes decoded together as sequences of one context, as serve --parallel "
                         f"(default {PARALLEL_DEFAULT}; 1: one pass at a time; docs/calibration.md)")
    return {"labels": run_labels_cmd, "calibrate": run_calibrate_cmd}


def _ancestors(path: Path) -> list[Path]:
    p = Path(os.path.abspath(path))
    return [p, *p.parents]


def check_output_path(path: str | os.PathLike, what: str) -> None:
    """ConfigError ``cannot write <path>: <reason>`` unless ``path`` can be written as a file (its missing
    folders created), found before any work is done: not a folder itself, and its nearest existing folder takes
    a new entry (tried with a temporary file, removed at once: permissions alone say nothing to root)."""
    import tempfile

    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise ConfigError(f"cannot write the {what} file {str(path)!r}: not a file path")
    if p.is_dir():
        raise ConfigError(f"cannot write the {what} file {p}: it is a directory")
    chain = _ancestors(p)
    i = next(i for i in range(1, len(chain)) if chain[i].exists())  # "/" exists
    folder = chain[i]
    if not folder.is_dir():
        raise ConfigError(f"cannot write the {what} file {p}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".epikv-probe-", dir=folder)
    except OSError as e:
        reason = e.strerror or str(e)
        if i > 1:  # a folder to create first
            reason = f"cannot create {chain[i - 1]}: {reason}"
        raise ConfigError(f"cannot write the {what} file {p}: {reason}") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def output_errors(path: str | os.PathLike | None, what: str):
    """An OSError about ``path``, one of its folders or a file beside it (a temporary one) becomes ConfigError
    ``cannot write the <what> file <path>: <reason>``; every other OSError propagates."""
    try:
        yield
    except OSError as e:
        if path is None:
            raise
        names = [Path(os.path.abspath(f)) for f in (e.filename, e.filename2) if isinstance(f, (str, os.PathLike))]
        target = _ancestors(Path(path))
        if not any(n in target or n.parent == target[1] for n in names):
            raise
        raise ConfigError(f"cannot write the {what} file {path}: {e.strerror or e}") from None


def _model_path(arg: str | None):
    from ..api.models import default_model_path
    from ..engine.handles import check_gguf

    return check_gguf(arg) if arg else default_model_path()


def run_labels_cmd(args: argparse.Namespace) -> int:
    from ..engine.handles import Model
    from .labels import LabelSettings, run_labels

    check_output_path(args.out, "labels")
    model_path = _model_path(args.model)
    s = LabelSettings(max_tokens=args.max_tokens, horizon=args.horizon, delay=args.delay, stride=args.stride,
                      min_pos=args.min_pos, batch=args.batch)
    with Model(model_path) as model, output_errors(args.out, "labels"):
        stats = run_labels(model, model_path, args.traces, args.out, s, n_traces=args.n_traces,
                           n_threads=args.threads, control=args.control)
    print(json.dumps({"out": args.out, **stats}))
    return 0


def run_calibrate_cmd(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .calibrate import FAST_GRID, QUICK_GRID, Grid, calibrate, calibrate_on_accuracy
    from .provenance import REPO
    from .traces import default_dev_traces

    for path, what in ((args.out, "calibration"), (args.labels, "labels")):
        if path is not None and not (what == "labels" and Path(path).is_file()):  # labels to reuse are read
            check_output_path(path, what)
    model_path = _model_path(args.model)
    traces = args.traces or str(default_dev_traces())
    if args.quick and args.fast:
        raise ConfigError("--quick and --fast are exclusive")
    grid = QUICK_GRID if args.quick else FAST_GRID if args.fast else Grid()
    if args.n_traces:
        grid = replace(grid, n_traces=args.n_traces)
    if not 1 <= args.parallel <= 64:
        raise ConfigError(f"--parallel must be in 1..64, got {args.parallel}")
    if args.reuse is not None:
        _check_reuse(args)
    accuracy = _accuracy_objective(args, grid, REPO.parent / "shared" / "data" / "gsm8k_test.jsonl")
    if args.reuse is not None:
        with output_errors(args.out, "calibration"):
            res = calibrate_on_accuracy(model_path, args.reuse, accuracy, out=args.out, n_threads=args.threads)
    else:
        with output_errors(args.out, "calibration"), output_errors(args.labels, "labels"):
            res = calibrate(model_path, traces, grid, full_grid=args.full_grid, n_threads=args.threads,
                            labels_path=args.labels, out=args.out, signals=not args.no_signals, accuracy=accuracy,
                            n_parallel=args.parallel)
    print(json.dumps({"path": res.path, "objective": args.objective, "layer_a": res.layer_a,
                      "layer_b": res.layer_b, "window": res.window,
                      "recent_fraction": res.recent_fraction, "delta_nll": res.delta_nll,
                      "baseline_delta_nll": res.baseline_delta_nll,
                      "selected": None if res.selected is None else _brief(res.selected),
                      "selected_by_budget": {str(b): _brief(sel) for b, sel in res.selected_by_budget}},
                     default=str))
    return 0


def _check_reuse(args: argparse.Namespace) -> None:
    """``--from``: only with ``--objective accuracy`` and without the options of the steps it does not rerun."""
    if args.objective != "accuracy":
        raise ConfigError("--from re-ranks a calibration on answers: only with --objective accuracy")
    rerun = [opt for opt, given in (("--traces", args.traces), ("--quick", args.quick), ("--fast", args.fast),
                                    ("--full-grid", args.full_grid), ("--n-traces", args.n_traces),
                                    ("--labels", args.labels), ("--no-signals", args.no_signals)) if given]
    if rerun:
        raise ConfigError(f"{', '.join(rerun)}: not with --from (the labels, grid and signals are not rerun)")
    if not Path(args.reuse).is_file():
        raise ConfigError(f"--from {args.reuse}: not a file" if Path(args.reuse).exists() else
                          f"--from {args.reuse}: no such file")


#: calibrate's options of the accuracy objective: (option, AccuracyObjective field, default)
ACCURACY_OPTIONS = (("--accuracy-problems", "n_problems", 16), ("--accuracy-budget", "kv_budget", 192),
                    ("--accuracy-max-tokens", "max_tokens", 400), ("--accuracy-top-k", "top_k", 2))


def _accuracy_objective(args: argparse.Namespace, grid, default_problems: Path):
    """The AccuracyObjective of ``--objective accuracy`` (None for ``delta_nll``), everything it will read
    checked now (the problems file, every dev problem it answers, the budget), not after the grid's minutes."""
    from ..engine.budget import DEFAULT_RECENT_FRACTION, BudgetConfig
    from .calibrate_accuracy import AccuracyObjective, dev_problems

    given = {opt: getattr(args, opt[2:].replace("-", "_")) for opt, _, _ in ACCURACY_OPTIONS}
    if args.objective != "accuracy":
        extra = [opt for opt, v in given.items() if v is not None] + (["--problems"] if args.problems else [])
        if extra:
            raise ConfigError(f"{', '.join(extra)}: only with --objective accuracy")
        return None
    values = {}
    for opt, field, default in ACCURACY_OPTIONS:
        v = default if given[opt] is None else given[opt]
        if v < 1:
            raise ConfigError(f"{opt} must be at least 1, got {v}")
        values[field] = v
    problems = args.problems or str(default_problems)
    objective = AccuracyObjective(problems, **values)
    dev_problems(problems, objective.n_problems)
    for rf in grid.recent + (DEFAULT_RECENT_FRACTION,):  # every recent share a candidate may have
        BudgetConfig(kv_budget=objective.kv_budget, n_sink=objective.n_sink, recent_fraction=rf, protect_prompt=False)
    return objective


def _brief(sel: dict) -> dict:
    """A step-3 choice as the command prints it."""
    return {k: sel.get(k) for k in ("policy", "options", "recent_fraction", "objective")}
