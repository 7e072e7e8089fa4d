"""Result documents of the benchmark scripts: where a result came from, and reading one back for ``--merge``.

A result document is a JSON object that starts with its provenance (:func:`run_header`: the command line,
the git revision of the source tree, the UTC date, the machine and the model file's fingerprint), then its
``settings``, ``wall_seconds`` and the results. A result measured in parts is merged into one document whose
provenance names the parts (:func:`merged_header`). ``scripts/bench_fidelity.py`` and
``scripts/bench_collapse.py`` write and merge theirs through here; ``scripts/benchlib.py`` takes the git
revision from here as well.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import DataError
from ..fileio import sha256_bytes

def _checkout() -> Path:
    """The source checkout whose revision a result names and beside which ``../shared/data`` lies: the folder
    above this package when it is imported from a checkout; else the working folder when that is a checkout's
    root (the README's ``.venv/bin/epikv-local`` runs the installed copy of the package, from the repository);
    else the folder above the installed package (no checkout: the packaged data are used)."""
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").is_file():
        return here
    try:
        cwd = Path.cwd()
    except OSError:  # the working folder was deleted: no checkout to name
        return here
    if (cwd / "pyproject.toml").is_file() and (cwd / "epikv_local").is_dir():
        return cwd
    return here


#: the source tree of this run (see :func:`_checkout`)
REPO = _checkout()
#: bytes of the model file hashed for its fingerprint (a whole GGUF takes too long to hash per run)
FINGERPRINT_BYTES = 1 << 20


def git_revision(repo: str | os.PathLike = REPO) -> str:
    """HEAD's commit in ``repo``, with ``-dirty`` when tracked files differ from it; ``unknown`` outside a
    git checkout or without git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=30).stdout.strip()
        if not rev:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def model_fingerprint(path: Path) -> dict:
    """The model file's path, size and the sha256 of its first MiB."""
    with open(path, "rb") as f:
        head = f.read(FINGERPRINT_BYTES)
    return {"path": portable(str(path)), "size_bytes": path.stat().st_size, "sha256_first_1MiB": sha256_bytes(head)}


def machine(threads: int | None) -> dict:
    """Platform, Python, CPU count and the CPU threads the run asked for (as given: None is the default)."""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "threads": threads}


def _prefixes() -> list[tuple[str, str]]:
    """(machine path, portable spelling) pairs, most specific first: this checkout's Python, the checkout, the
    shared data beside it, the model cache, the home folder, the temporary folder. Only absolute paths (a
    relative one would match anywhere in a text)."""
    from ..api.models import cache_dir

    home, cache = Path.home(), cache_dir()
    if os.environ.get("EPIKV_CACHE_DIR"):
        cache_spelling = "$EPIKV_CACHE_DIR/"
    elif cache == home / ".cache" / "epikv-local":
        cache_spelling = "~/.cache/epikv-local/"
    else:
        cache_spelling = "$XDG_CACHE_HOME/epikv-local/"
    pairs = []
    if sys.executable:
        python = Path(sys.executable)
        pairs.append((str(python), str(python.relative_to(REPO)) if python.is_relative_to(REPO) else "python"))
    pairs += [(str(REPO) + os.sep, ""), (str(REPO.parent / "shared") + os.sep, "../shared/"),
              (str(cache) + os.sep, cache_spelling), (str(home) + os.sep, "~/"),
              (str(Path(tempfile.gettempdir())) + os.sep, "$TMPDIR/")]
    return [(a, b) for a, b in pairs if Path(a).is_absolute() and a != os.sep]


def portable(value):
    """``value`` with the paths of this machine spelled so that they mean the same on another one: in a string,
    the checkout's prefix made repository-relative (``.venv/bin/python``, ``results/x.json``), the shared
    data as ``../shared/``, the model cache as ``~/.cache/epikv-local/`` (or ``$EPIKV_CACHE_DIR/``,
    ``$XDG_CACHE_HOME/epikv-local/``), the home folder as ``~/`` and the temporary folder as ``$TMPDIR/``;
    lists and dicts element by element (tuples become lists, as in JSON); anything else unchanged. A committed
    result names no path of the machine it ran on."""
    return _portable(value, _prefixes())


def _portable(value, pairs: list[tuple[str, str]]):
    if isinstance(value, str):
        for machine_path, spelling in pairs:
            value = value.replace(machine_path, spelling)
        return value
    if isinstance(value, dict):
        return {k: _portable(v, pairs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v, pairs) for v in value]
    return value


def command_line() -> str:
    """This process's command line, shell-quoted, with portable paths (:func:`portable`)."""
    return portable(shlex.join([sys.executable] + sys.argv))


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run_header(model_path: Path, threads: int | None) -> dict:
    """The provenance a run's result document starts with: command, git_revision, date, machine, model."""
    return {"command": command_line(), "git_revision": git_revision(), "date": utc_now(),
            "machine": machine(threads), "model": model_fingerprint(model_path)}


def merged_header(docs: list[dict]) -> dict:
    """The provenance of a result merged from the result documents ``docs`` (machine and model: the first
    part's), followed by what :func:`merged_settings` and the caller add."""
    return {"command": command_line(), "parts": [d["command"] for d in docs], "git_revision": git_revision(),
            "date": utc_now(), "machine": docs[0]["machine"], "model": docs[0]["model"]}


def merged_settings(docs: list[dict]) -> dict:
    """The first part's settings with the policies of every part (in order, once each) and the first
    calibration any part ran with."""
    settings = dict(docs[0]["settings"])
    settings["policies"] = list(dict.fromkeys(p for d in docs for p in d["settings"]["policies"]))
    settings["calibration"] = next((d["settings"]["calibration"] for d in docs
                                    if d["settings"].get("calibration")), None)
    return settings


def merged_wall_seconds(docs: list[dict]) -> float:
    return round(sum(d.get("wall_seconds", 0) for d in docs), 1)


def read_result_doc(path: Path, what: str) -> dict:
    """A result document for ``--merge``: a JSON object with a ``settings`` object (DataError otherwise)."""
    if not path.is_file():
        raise DataError(f"--merge: {path} not found")
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"--merge: {path} is not JSON ({e})") from None
    if not (isinstance(d, dict) and isinstance(d.get("settings"), dict)):
        raise DataError(f"--merge: {path} is not {what} (no settings)")
    return d


def settings_mismatch(docs: list[dict], keys: tuple[str, ...]) -> tuple[int, list[str]] | None:
    """(index of the first document whose settings differ from the first one's in any of ``keys``, those
    keys), or None when all agree."""
    for i, d in enumerate(docs[1:], start=1):
        diff = [k for k in keys if d["settings"].get(k) != docs[0]["settings"].get(k)]
        if diff:
            return i, diff
    return None
