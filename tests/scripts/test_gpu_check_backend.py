"""The backend fixture of the GPU check (scripts/gpu_check/backend.py, a pytest plugin): it runs unchanged tests
of tests/engine/test_native.py on the model it is given, reports every test's outcome and graph probes, and
refuses ``--backend gpu`` on a library without a GPU device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLASH_TEST = "tests/engine/test_native.py::test_graph_nodes_show_flash_attention"


def run_backend(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """pytest with the plugin in a child process; returns it and the plugin's report ({} if none)."""
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(ROOT)])}
    for k in ("EPIKV_TEST_BACKEND", "EPIKV_TEST_MODEL", "EPIKV_TEST_THREADS"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check.backend",
                           "--backend-report", str(report), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, json.loads(report.read_text()) if report.is_file() else {}


def test_runs_test_native_on_the_given_model(tmp_path, model_path):
    proc, report = run_backend(tmp_path, "--backend-model", str(model_path), FLASH_TEST)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert report["backend"]["device"] == "cpu" and report["exitstatus"] == 0
    tests = report["tests"]
    assert len(tests) == 2 and all("[cpu-" in nodeid for nodeid in tests)  # model_path parametrized: the override
    by_fa = {t["params"]["flash_attn"]: t for t in tests.values()}
    assert all(t["outcome"] == "passed" for t in tests.values())
    on, off = by_fa[True]["graph_probes"][-1], by_fa[False]["graph_probes"][-1]
    assert on["flash_attn_ext_nodes"] >= 30 and on["kq_soft_max_nodes"] == 0  # SmolLM2-135M: 30 layers
    assert off["flash_attn_ext_nodes"] == 0 and off["kq_soft_max_nodes"] >= 30


def test_the_given_model_really_replaces_the_default(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    proc, report = run_backend(tmp_path, "--backend-model", str(broken), f"{FLASH_TEST}[cpu-True]")
    assert proc.returncode != 0
    (rec,) = report["tests"].values()
    assert rec["outcome"] == "error" and rec["error"]  # tests/conftest.py's model fixture loaded the broken file


def test_gpu_backend_refuses_a_library_without_a_gpu(tmp_path):
    if subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi")
    proc, report = run_backend(tmp_path, "--backend", "gpu", "scripts/gpu_check/checks.py")
    assert proc.returncode != 0
    assert report["tests"] and all(t["outcome"] == "error" for t in report["tests"].values())
    assert all("registered no GPU device" in t["error"] for t in report["tests"].values())


def test_an_unknown_backend_is_a_usage_error(tmp_path):
    proc, _ = run_backend(tmp_path, "--backend", "tpu", "scripts/gpu_check/checks.py")
    assert proc.returncode == 4 and "--backend must be one of cpu, gpu" in proc.stdout + proc.stderr
