"""llama-cpp-python's own test suite (from the pinned sdist the build used) against our patched library.

The patched libllama must not break llama-cpp-python: its tests run here in a subprocess, offline. Those that
need a model from the Hugging Face Hub cannot run without network; each of them must fail for exactly that
reason (LocalEntryNotFoundError), and every other test must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: network-free tests of llama-cpp-python 0.3.36 (measured: 8 pass, 18 need the hub)
MIN_PASSED = 8


def sdist_path() -> Path:
    explicit = os.environ.get("EPIKV_LLAMA_SDIST")
    if explicit:
        return Path(explicit)
    line = next(ln for ln in (REPO / "patches" / "SOURCE").read_text().splitlines()
                if ln.strip() and not ln.startswith("#"))
    fname = line.split()[1]
    base = os.environ.get("EPIKV_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "epikv-local"
    return Path(base) / "sdist" / fname


def test_llama_cpp_python_own_tests_pass_on_the_patched_library(tmp_path):
    sdist = sdist_path()
    if not sdist.is_file():
        pytest.fail(f"the llama-cpp-python sdist the build used is missing: {sdist}")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers()
                   if "/tests/" in m.name or m.name.endswith("models/ggml-vocab-llama-spm.gguf")]
        tf.extractall(tmp_path, members=members, filter="data")
    root = next(tmp_path.iterdir())
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests",
                        f"--junitxml={junit}"], cwd=root, capture_output=True, text=True, timeout=900, env=env)
    assert junit.is_file(), r.stdout[-2000:] + r.stderr[-2000:]
    passed, needs_hub, other = [], [], []
    for tc in ET.parse(junit).iter("testcase"):
        bad = [c for c in tc if c.tag in ("failure", "error")]
        skipped = [c for c in tc if c.tag == "skipped"]
        if not bad and not skipped:
            passed.append(tc.get("name"))
        elif bad and "LocalEntryNotFoundError" in (bad[0].get("message", "") + (bad[0].text or "")):
            needs_hub.append(tc.get("name"))
        elif bad:
            other.append((tc.get("name"), bad[0].get("message", "")[:300]))
    print(f"llama-cpp-python tests: {len(passed)} passed, {len(needs_hub)} need the hub, {len(other)} other")
    assert not other, other
    assert len(passed) >= MIN_PASSED, passed
