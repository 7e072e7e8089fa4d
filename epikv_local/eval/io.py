"""Reading JSONL inputs with one clear error per bad line; writing results: JSON with numpy scalars and NaN
cleaned, written atomically (``write_atomic`` is :func:`epikv_local.fileio.write_atomic`, re-exported)."""

from __future__ import annotations

import json
import os
from pathlib import Path
import numpy as np

from ..errors import DataError
from ..fileio import write_atomic  # noqa: F401  (re-exported for the harness)


def nan_to_none(x):
    """NaN floats -> None, recursively through dicts, lists and tuples (tuples become lists): strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    return x


def to_json(res: dict) -> str:
    """``res`` as indented JSON: numpy scalars as numbers, NaN as null."""
    def conv(o):
        if isinstance(o, (np.floating,)):
            return float(o)
        if isinstance(o, (np.integer,)):
            return int(o)
        raise TypeError(type(o))

    return json.dumps(nan_to_none(res), indent=2, default=conv)


def read_jsonl(path: str | os.PathLike, what: str = "file") -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a JSONL file; DataError naming the file and line when
    it is missing, not UTF-8, or a line is not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{i + 1}: not a JSON object")
        out.append((i + 1, rec))
    return out
