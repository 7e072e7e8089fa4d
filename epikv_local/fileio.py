"""Files the package writes and checks, in one place: atomic writes (no half-written file is ever left at the
target path) and sha256 digests of files and bytes.

A leaf beside ``errors``: every layer may import it, it imports only ``errors``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from .errors import EpikvError

#: bytes read at a time while hashing (4 MiB: large GGUF files hash at disk speed)
HASH_BLOCK = 1 << 22


def write_atomic(path: str | os.PathLike, content: "str | bytes | Callable[[Path], None]", *,
                 error: type[EpikvError] | None = None, what: str = "file", make_parents: bool = True) -> Path:
    """Write ``content`` to ``path`` through a temporary file in the same folder, renamed into place.

    content: text (UTF-8), bytes, or a function that writes the temporary path it is given (binary formats,
        e.g. ``np.savez``; the temporary name keeps ``path``'s suffix so such writers add none of their own).
    error: when given, an OSError becomes this EpikvError naming ``what`` and the path (one clear line);
        otherwise the OSError propagates. make_parents: create missing parent folders first.
    The temporary file is removed on every path out, success or failure.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(tmp)
        elif isinstance(content, (bytes, bytearray, memoryview)):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        if error is None:
            raise
        raise error(f"cannot write the {what} {path}: {e.strerror or e}") from None
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a whole file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
