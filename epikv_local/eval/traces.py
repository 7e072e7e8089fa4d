"""Reasoning traces (JSONL records with ``problem`` and ``trace``), tokenized for the evaluation passes."""

from __future__ import annotations

from pathlib import Path

from ..engine.handles import Model
from ..errors import ConfigError, DataError
from .io import read_jsonl
from .provenance import REPO


def trace_text(record: dict) -> str:
    """The text evaluated for one trace record: ``problem + "\\n\\n" + trace``."""
    return f"{record['problem']}\n\n{record['trace']}"


def load_traces(path: str | Path, model: Model, max_tokens: int, n_traces: int | None = None,
                min_tokens: int | None = None, interleave_sources: bool = False) -> list[tuple[str, list[int]]]:
    """Read a JSONL trace file and tokenize each record's ``problem + "\\n\\n" + trace`` with ``model``.

    Tokens are truncated to ``max_tokens``; records with fewer than ``min_tokens`` tokens (default:
    ``max_tokens``, i.e. only traces long enough to fill the window) are skipped. ``interleave_sources``
    takes the records round-robin over their ``model`` field (so a few traces cover every trace generator)
    instead of file order. Returns up to ``n_traces`` ``(id, tokens)`` pairs.
    """
    path = Path(path)
    if max_tokens < 2:
        raise ConfigError(f"max_tokens must be >= 2, got {max_tokens}")
    need = max_tokens if min_tokens is None else min_tokens
    records = []
    for lineno, rec in read_jsonl(path, "trace file"):
        if "problem" not in rec or "trace" not in rec:
            raise DataError(f"{path}:{lineno}: record without 'problem' and 'trace' fields")
        records.append(rec)
    if interleave_sources:
        groups: dict[str, list[dict]] = {}
        for rec in records:
            groups.setdefault(str(rec.get("model", "")), []).append(rec)
        queues = list(groups.values())
        records = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    out: list[tuple[str, list[int]]] = []
    for i, rec in enumerate(records):
        if n_traces is not None and len(out) >= n_traces:
            break
        toks = model.tokenize(trace_text(rec))[:max_tokens]
        if len(toks) < need:
            continue
        out.append((str(rec.get("id", f"{path.name}:{i}")), toks))
    return out


#: dev traces shipped with the package (see data/README.md)
PACKAGED_DEV_TRACES = Path(__file__).resolve().parent / "data" / "dev_traces.jsonl"


def default_dev_traces() -> Path:
    """The dev split beside a source checkout (``../shared/data/r1_traces_dev.jsonl``), else the few dev
    traces shipped with the package. The checkout is :data:`.provenance.REPO`: the installed package run from
    the repository's root finds the dev split as a source checkout does."""
    p = REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"
    return p if p.is_file() else PACKAGED_DEV_TRACES
