"""What every module of the check shares: its paths, CheckError, and the small helpers (the console log, MiB,
folder sizes, the JSON written atomically, a subprocess with its output in a log file, a log's tail, package
versions)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from epikv_local.errors import EpikvError  # imports nothing else of the package
from epikv_local.fileio import write_atomic  # imports only errors

from . import ROOT, SCRIPTS

__all__ = ["ROOT", "SCRIPTS", "SCHEMA", "BUNDLE", "WORK", "JSON_NAME", "CheckError", "log", "mib", "dir_bytes",
           "write_json", "run_cmd", "tail", "pkg_version"]

SCHEMA = "epikv-gpu-check/1"
BUNDLE = ROOT / "build" / "gpu_bundle"
WORK = ROOT / "build" / "gpu_run"
JSON_NAME = "gpu_check.json"


class CheckError(EpikvError):
    """A prerequisite of the GPU check is missing (bundle, GPU, compiler) or one of its steps failed."""


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mib(n: float) -> float:
    return round(n / 2**20, 2)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _json_default(x):
    import numpy as np  # only once a figure is numpy's: --prepare and the refusals run without it

    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_json(path: Path, data: dict) -> None:
    """Atomically: a run cut short leaves the previous complete file, never half of one."""
    write_atomic(path, json.dumps(data, indent=1, default=_json_default) + "\n")


def run_cmd(cmd: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command with its output appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout,
                              cwd=cwd, check=False)


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def pkg_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
