"""Shared pieces of the benchmark scripts: provenance (git revision, machine), writing the result document,
the command-line scaffolding (one-line argument errors, ``--merge`` or a run, timestamped progress) and one
timed decode run.

Importing it puts the source tree on ``sys.path`` (the scripts run the working tree's package, whichever copy
is installed). The result documents' provenance comes from :mod:`epikv_local.eval.provenance`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from epikv_local.errors import ConfigError, run_main  # noqa: E402
from epikv_local.eval.provenance import git_revision, portable  # noqa: E402


def git_rev() -> str:
    """HEAD's commit in this checkout, with ``-dirty`` when tracked files differ from it (``unknown`` without
    git)."""
    return git_revision(ROOT)


def machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor(),
            "python": platform.python_version()}


def provenance(script: str, argv: list[str] | None) -> dict:
    """The fields a result document starts with: the command (``python scripts/<script> ARGS``), the git
    revision and the machine."""
    return {"command": f"python scripts/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "git_rev": git_rev(), "machine": machine()}


def save_json(path: str | os.PathLike | None, doc: dict) -> None:
    """Write ``doc`` as indented JSON to ``path``, atomically, its machine paths made portable
    (:func:`~epikv_local.eval.provenance.portable`) and NaN written as null (strict JSON); nothing when ``path``
    is None."""
    from epikv_local.eval.io import nan_to_none, write_atomic

    if path:
        write_atomic(path, json.dumps(nan_to_none(portable(doc)), indent=2) + "\n",
                     what="result file", error=ConfigError)


class ArgParser(argparse.ArgumentParser):
    """An argument parser whose errors are a ConfigError: one ``<prog>: error: ...`` line and exit status 2
    through :func:`epikv_local.errors.run_main` (argparse prints the usage as well by default)."""

    def error(self, message):
        raise ConfigError(message)


def run_or_merge(prog: str, parser: argparse.ArgumentParser, run, merge, argv: list[str] | None) -> int:
    """A script with a ``--merge`` option as a command: ``merge(args)`` when it is given, else ``run(args)``,
    through :func:`epikv_local.errors.run_main`."""
    def main(a):
        args = parser.parse_args(a)
        return merge(args) if args.merge else run(args)

    return run_main(prog, main, argv)


def records_to_merge(path: str | os.PathLike) -> list[dict]:
    """:func:`read_records` for ``--merge``: a ConfigError when the file is missing or holds no record, where a
    run would start one (a merge of nothing would write an empty result or fail on its first row)."""
    rows = read_records(path)
    if not rows:
        raise ConfigError(f"{path}: no records to merge" if Path(path).exists() else f"{path} not found")
    return rows


def read_records(path: str | os.PathLike, required: tuple[str, ...] = ("setting", "id", "correct")) -> list[dict]:
    """The records of a JSONL records file (none when it does not exist). A torn last line (a run killed while
    writing it) is left out; any other line that is not a record with the ``required`` keys is one ConfigError
    naming it."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the records file {path}: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            if n == len(lines):
                continue
            rec = None
        if not isinstance(rec, dict) or any(k not in rec for k in required):
            raise ConfigError(f"line {n} of {path} is not a record of this benchmark (a JSON object with "
                              f"{', '.join(required)})")
        out.append(rec)
    return out


def append_record(path: str | os.PathLike, record: dict | None) -> None:
    """Append ``record`` to a JSONL records file as one whole line (its folder made first; None: only check
    that it can be written, before a run spends minutes on its first outcome); a path that cannot be written is
    one ConfigError line."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with path.open("a", encoding="utf-8") as f:
            if record is not None:
                f.write(json.dumps(record) + "\n")
        if record is None and not existed:  # the check leaves no empty file behind for a run refused later
            path.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write the records file {path}: {e.strerror or e}") from None


def csv_of(kind, what: str):
    """An argparse type: comma-separated values of ``kind`` (int, float, str), empty and repeated items dropped
    (a repeated policy or budget would run its setting twice)."""
    def parse(text: str) -> list:
        try:
            return list(dict.fromkeys(kind(x) for x in text.split(",") if x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: comma-separated {kind.__name__} values, got {text!r}") from None
    return parse


def with_calibration(args, model: str, rows: list[dict], records: Path) -> tuple[list[str], object, str | None]:
    """``--calibration FILE|auto`` of an answer benchmark: (the policies to run: ``args.policies`` plus
    ``epikv_calibrated`` and, with step 3, ``calibrated``, or only those ``--calibration-runs`` names; the loaded
    calibration or None; its file name). ConfigError when ``records`` (read as ``rows``) holds one of these runs
    of another calibration (a setting's outcomes come from one calibration), or for a run it cannot give."""
    from epikv_local.eval.specs import CALIBRATED, SELECTED, load_calibration_arg

    policies = list(args.policies)
    runs = args.calibration_runs
    if runs == []:
        raise ConfigError("--calibration-runs: name at least one of epikv_calibrated, calibrated")
    if runs and not args.calibration:
        raise ConfigError("--calibration-runs needs --calibration FILE|auto")
    for x in runs or []:
        if x not in (CALIBRATED, SELECTED):
            raise ConfigError(f"--calibration-runs: unknown run {x!r}; choose from {CALIBRATED}, {SELECTED}")
    if not args.calibration:
        return policies, None, None
    cal = load_calibration_arg(args.calibration, Path(model))
    name = Path(cal.path).name
    if runs and SELECTED in runs and cal.selected is None:
        raise ConfigError(f"--calibration-runs {SELECTED}: {name} has no step 3 (no per-budget choice)")
    wanted = runs or [CALIBRATED] + ([SELECTED] if cal.selected is not None else [])
    policies += [x for x in wanted if x not in policies]
    for r in rows:  # a resumed run adds to the same calibration's outcomes only, run by run
        if r.get("calibration") not in (None, name) and r.get("policy") in wanted:
            raise ConfigError(f"{records} holds {r['policy']} runs of calibration {r['calibration']!r}, not "
                              f"{name!r}: use another --records file or --calibration-runs")
    return policies, cal, name


def add_calibration_args(p) -> None:
    """``--calibration`` and ``--calibration-runs`` of an answer benchmark (read by :func:`with_calibration`)."""
    p.add_argument("--calibration", help="also run 'epikv_calibrated' and (with step 3) 'calibrated' from this "
                                         "calibration JSON ('auto': the model's cached calibration)")
    p.add_argument("--calibration-runs", type=csv_of(str, "--calibration-runs"), default=None,
                   help="only these of the calibration's runs (epikv_calibrated, calibrated; default: both)")


def calibration_record(how: dict, cal_name: str | None) -> dict:
    """What a record of a calibration's run adds (the calibration's file name, what ran: policy, settings with
    the query statistics by file name, recent share); {} for a registered policy's run."""
    if "kv_policy_settings" not in how:
        return {}
    opts = {k: Path(v).name if k == "query_stats" else v for k, v in how["kv_policy_settings"].items()}
    return {"calibration": cal_name, "ran": {**how, "kv_policy_settings": opts}}


def dev_trace_text() -> str:
    """The text of the package's dev traces (the ones ``calibrate`` ships), joined by spaces."""
    from epikv_local.eval.io import read_jsonl
    from epikv_local.eval.traces import default_dev_traces, trace_text

    return " ".join(trace_text(r) for _, r in read_jsonl(default_dev_traces(), "trace file"))


def log(msg: str) -> None:
    """A progress line on stderr, timestamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_run(model, spec: dict, prompt: list[int], n_tokens: int, budget: int, n_batch: int,
            threads: int | None) -> dict:
    """Prefill ``prompt`` and decode ``n_tokens`` greedily under ``spec``; returns tokens/s and eviction stats.

    spec: ``policy`` (registry name), ``flash_attn`` (bool), ``verify`` (probe the graph for flash attention),
    optional ``route`` ("layer_out" | "callback"). Every run allocates the same context,
    ``context_cells(budget, n_batch)`` = budget + n_batch cells; policy ``none`` (the plain llama.cpp
    baseline) gets that whole context as its budget, so the generated tokens fill the slack beyond ``budget``.
    """
    from epikv_local.api.generation import generate
    from epikv_local.engine.sampling import SamplingConfig
    from epikv_local.engine.budget import BudgetConfig, context_cells
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy, policy_spec

    n_ctx = context_cells(budget, n_batch)
    cfg = SessionConfig(n_batch=n_batch, n_threads=threads, flash_attn=spec["flash_attn"],
                        verify_flash_attn=spec["verify"], capture_route=spec.get("route", "layer_out"), n_ctx=n_ctx)
    share = policy_spec(spec["policy"]).recent_fraction  # a policy's own recent share, as the front doors give it
    bcfg = BudgetConfig(kv_budget=n_ctx if spec["policy"] == "none" else budget, protect_prompt=False,
                        **({"recent_fraction": share} if share is not None else {}))
    with Session(model, make_policy(spec["policy"]), bcfg, cfg) as s:
        res = generate(s, prompt, n_tokens, SamplingConfig(), ignore_eog=True)
        st = s.stats()
        return {"tps": res.stats.decode_tokens_per_s, "prefill_tps": res.stats.prefill_tokens_per_s,
                "n_generated": res.stats.n_generated_tokens,
                "n_evicted": st.n_evicted, "rounds": st.n_rounds, "evict_s": st.evict_seconds,
                "max_live": st.max_live, "n_ctx": st.n_ctx,
                "flash_attn": st.flash_attn if spec["verify"] else None}


def median_ratio(a: list[dict], b: list[dict], key: str = "tps") -> tuple[float | None, list[float]]:
    """Median of the per-round ratios a/b of ``key`` (tokens/s: "tps" decode, "prefill_tps" prompt; rounds paired
    in order)."""
    ratios = [x[key] / y[key] for x, y in zip(a, b) if y[key] > 0]
    return (statistics.median(ratios) if ratios else None), ratios
