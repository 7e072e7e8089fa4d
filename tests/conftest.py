"""Shared fixtures: the real default model (fetched by scripts/install.sh) and the shared data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def model_path() -> Path:
    from epikv_local.api.models import default_model_path

    return default_model_path(fetch=False)


@pytest.fixture(scope="session")
def nat():
    from epikv_local.engine.native import load

    return load()


@pytest.fixture(scope="session")
def model(nat, model_path):
    from epikv_local.engine.handles import Model

    with Model(model_path, native=nat) as m:
        yield m


@pytest.fixture(scope="session")
def dev_traces() -> list[dict]:
    path = SHARED / "r1_traces_dev.jsonl"
    if not path.is_file():
        pytest.fail(f"shared data missing: {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


#: fixtures that load the real model (or the native library): a test that uses one is marked ``model``
MODEL_FIXTURES = frozenset({"model_path", "nat", "model"})


def pytest_configure(config):
    config.addinivalue_line("markers", "model: needs the real default model or the native library (slow lane); "
                                       "the fast lane is `pytest -m \"not model\"`")


#: tests that load the model or the native library in a subprocess (no fixture says so): module paths, or
#: module::test names, relative to tests/
SUBPROCESS_MODEL_TESTS = (
    "scripts/test_product_benchmarks.py::test_multiturn", "scripts/test_product_benchmarks.py::test_quant_kv",
    "scripts/test_product_benchmarks.py::test_evict_scaling",
    "scripts/test_product_benchmarks.py::test_soak_passes_and_fails",
    "scripts/test_product_benchmarks.py::test_accuracy_bench_runs_resumes_and_merges",
    "scripts/test_product_benchmarks.py::test_recall_bench_passkey_and_multiturn",
    "scripts/test_bench_scripts.py::test_bench_calibration_smoke", "engine/test_llama_cpp_upstream.py",
    "scripts/test_gpu_check_backend.py",
)
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        # a plugin's tests (scripts/gpu_check/checks.py) live outside tests/: keyed by their absolute path
        rel = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.as_posix()
        name = f"{rel}::{item.originalname or item.name}"
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or rel in SUBPROCESS_MODEL_TESTS \
                or name in SUBPROCESS_MODEL_TESTS:
            item.add_marker(pytest.mark.model)
