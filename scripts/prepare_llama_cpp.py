#!/usr/bin/env python3
"""Fetch, verify, extract and patch the llama.cpp source that epikv-local builds.

The source is the ``vendor/llama.cpp`` tree of the llama-cpp-python sdist named in ``patches/SOURCE``
(pinned version, sha256 checked). Nothing of llama.cpp is committed to this repository.

Steps (each skipped when its result is already in the cache):
1. sdist: ``--sdist FILE`` / ``$EPIKV_LLAMA_SDIST``, else the cache, else ``pip download`` from the
   package index into the cache. The file's sha256 must match ``patches/SOURCE``.
2. extract ``vendor/llama.cpp`` to ``<cache>/llama.cpp-<sdist sha12>-<patches sha12>/``;
3. apply ``patches/series`` in order (``patch -p1``); write a ``.epikv-prepared`` marker.

``--source-dir DIR`` / ``$EPIKV_LLAMA_SOURCE_DIR`` uses an already extracted, *unpatched* llama.cpp tree
instead of the sdist (copied to the cache, then patched), for offline builds.

Prints the prepared directory on stdout (the last line). Exit status 1 with a one-line message on error.
Cache: ``$EPIKV_CACHE_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/epikv-local``.
Standard library only: CMake runs it inside pip's isolated build environment, before the package is installed.
Its digests come from the source tree's ``epikv_local/fileio.py`` (a leaf that imports only ``errors``, both
standard library only; importing ``epikv_local`` loads nothing else).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from epikv_local.fileio import sha256_bytes, sha256_file  # noqa: E402

PATCHES = ROOT / "patches"
MARKER = ".epikv-prepared"


class PrepareError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("EPIKV_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "epikv-local"


def read_source() -> tuple[str, str, str]:
    """Return (requirement, file name, sha256) from patches/SOURCE."""
    for line in (PATCHES / "SOURCE").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            req, fname, digest = line.split()
            if not digest.startswith("sha256="):
                raise PrepareError(f"patches/SOURCE: expected sha256=..., got {digest!r}")
            return req, fname, digest.split("=", 1)[1]
    raise PrepareError("patches/SOURCE names no source")


def series() -> list[Path]:
    names = [ln.strip() for ln in (PATCHES / "series").read_text().splitlines()]
    paths = [PATCHES / n for n in names if n and not n.startswith("#")]
    for p in paths:
        if not p.is_file():
            raise PrepareError(f"patches/series names a missing patch: {p.name}")
    return paths


def patches_digest(paths: list[Path]) -> str:
    """sha256 over each patch's name followed by its bytes, in series order."""
    return sha256_bytes(b"".join(p.name.encode() + p.read_bytes() for p in paths))


def obtain_sdist(explicit: str | None, req: str, fname: str, digest: str) -> Path:
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise PrepareError(f"sdist not found: {path}")
    else:
        path = cache_dir() / "sdist" / fname
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"epikv: downloading {req} sdist with pip", file=sys.stderr)
            name = req.split("==")[0]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
                   "--no-build-isolation", "-d", str(path.parent), req]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if not path.is_file():
                raise PrepareError(f"pip could not download {req}: {proc.stderr.strip().splitlines()[-1:]}")
    actual = sha256_file(path)
    if actual != digest:
        raise PrepareError(f"sha256 mismatch for {path}: expected {digest}, got {actual}")
    return path


def extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tf:
        prefix = None
        members = []
        for m in tf.getmembers():
            parts = Path(m.name).parts
            if len(parts) >= 3 and parts[1] == "vendor" and parts[2] == "llama.cpp":
                prefix = Path(*parts[:3])
                members.append(m)
        if not members:
            raise PrepareError(f"{sdist} has no vendor/llama.cpp tree")
        for m in members:
            m.name = str(Path(m.name).relative_to(prefix)) if Path(m.name) != prefix else "."
        tf.extractall(dest, members=members, filter="tar")


def apply_patches(tree: Path, paths: list[Path]) -> None:
    for p in paths:
        proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-d", str(tree), "-i", str(p)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise PrepareError(f"patch {p.name} does not apply: {proc.stdout.strip()[-400:]}")


def prepare(sdist_arg: str | None, source_arg: str | None) -> Path:
    req, fname, digest = read_source()
    paths = series()
    pd = patches_digest(paths)
    if source_arg:
        src = Path(source_arg).expanduser()
        if not (src / "include" / "llama.h").is_file():
            raise PrepareError(f"not a llama.cpp source tree (no include/llama.h): {src}")
        key = "src-" + sha256_bytes(str(src.resolve()).encode())[:12]
    else:
        key = digest[:12]
    out = cache_dir() / f"llama.cpp-{key}-{pd[:12]}"
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        if source_arg:
            shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "build*"))
        else:
            extract(obtain_sdist(sdist_arg, req, fname, digest), tmp)
        git_link = tmp / ".git"  # the sdist carries a submodule pointer file; patch does not need it
        if git_link.is_file():
            git_link.unlink()
        apply_patches(tmp, paths)
        (tmp / MARKER).write_text(f"{req}\n{digest}\npatches {pd}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", default=os.environ.get("EPIKV_LLAMA_SDIST") or None)
    ap.add_argument("--source-dir", default=os.environ.get("EPIKV_LLAMA_SOURCE_DIR") or None)
    args = ap.parse_args(argv)
    try:
        print(prepare(args.sdist, args.source_dir))
    except PrepareError as e:
        print(f"epikv: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
