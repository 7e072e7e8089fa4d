"""The backend fixture: a pytest plugin that runs native tests on a chosen device and model, and reports them.

Load it with ``-p gpu_check.backend`` (``scripts/`` on PYTHONPATH). Without it nothing changes, and with its
defaults it selects what the normal test run uses: the CPU and the default model. Options (each also read from
an environment variable, for a plain ``pytest`` call):

``--backend cpu|gpu`` (``EPIKV_TEST_BACKEND``)
    the device. ``gpu``: every layer on the GPU; the library (``EPIKV_LIB_DIR``) must register a GPU device,
    else every test errors. ``cpu``: every layer on the CPU; CUDA devices are hidden from the library
    (``CUDA_VISIBLE_DEVICES=""``, set before it loads), so a GPU build stays on the CPU too.
``--backend-model PATH`` (``EPIKV_TEST_MODEL``)
    the GGUF in the default model's place (default: the default model).
``--backend-threads N`` (``EPIKV_TEST_THREADS``)
    llama.cpp CPU threads of the tests that take them from ``backend`` (default: the package's).
``--backend-report PATH``
    writes every test's outcome, error, figures and graph probes there as JSON (gpu_check reads it).

Fixtures: ``backend`` (the selection), ``backend_model`` (the model loaded on the device; its facts go into the
report), ``figures`` (a dict a test fills with what it measured, before it asserts: the report carries it
even when the test fails).

Tests under tests/ keep tests/conftest.py's fixtures, which load ``model_path`` with every layer offloaded: for
them the plugin parametrizes ``model_path`` directly with the backend's model (a direct parametrization
overrides the fixture of that name, and with it ``model``, which is built on it), and the device follows from
the library and ``CUDA_VISIBLE_DEVICES``. So tests/engine/test_native.py runs unchanged on the GPU.

Every test's graph probes (``CallbackHandle.probe_nodes``) are counted into the report: a test of
test_native.py that probes the decode graph reports how many FLASH_ATTN_EXT and kq_soft_max nodes it saw,
without a second copy of that test here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from .common import write_json

DEVICES = ("cpu", "gpu")
_BACKEND = pytest.StashKey["Backend"]()
_RESULTS = pytest.StashKey[dict]()  # nodeid -> the test's record
_SESSION = pytest.StashKey[dict]()  # facts of the session: the backend model's shape
_FIGURES = pytest.StashKey[dict]()
_PROBES = pytest.StashKey[list]()


@dataclass(frozen=True)
class Backend:
    """The device and model the native tests run on."""

    device: str
    model_path: Path | None  # None: the default model
    threads: int | None

    @property
    def n_gpu_layers(self) -> int:
        return -1 if self.device == "gpu" else 0

    def resolved_model(self) -> Path:
        from epikv_local.api.models import default_model_path

        return self.model_path or default_model_path(fetch=False)


def pytest_addoption(parser):
    env = os.environ.get
    group = parser.getgroup("backend", "device and model of the native tests (gpu_check.backend)")
    group.addoption("--backend", default=env("EPIKV_TEST_BACKEND") or "cpu", help="cpu (default) or gpu")
    group.addoption("--backend-model", default=env("EPIKV_TEST_MODEL") or None,
                    help="GGUF in the default model's place (default: the default model)")
    group.addoption("--backend-threads", type=int, default=int(env("EPIKV_TEST_THREADS") or 0) or None,
                    help="llama.cpp CPU threads of the backend's fixtures (default: the package's)")
    group.addoption("--backend-report", default=None, help="write each test's outcome and figures here (JSON)")


def pytest_configure(config):
    device = config.getoption("backend")
    if device not in DEVICES:  # an environment variable's value is not checked by the option parser
        raise pytest.UsageError(f"--backend must be one of {', '.join(DEVICES)}, not {device!r}")
    model = config.getoption("backend_model")
    if model is not None and not Path(model).is_file():
        raise pytest.UsageError(f"--backend-model: no file {model}")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # no test has loaded the library yet
    config.stash[_BACKEND] = Backend(device, Path(model).resolve() if model else None,
                                     config.getoption("backend_threads"))
    config.stash[_RESULTS] = {}
    config.stash[_SESSION] = {}


def pytest_report_header(config):
    b = config.stash[_BACKEND]
    return f"backend: {b.device}, model {b.model_path or 'the default model'}"


def pytest_generate_tests(metafunc):
    b = metafunc.config.stash[_BACKEND]
    if b.model_path is not None and "model_path" in metafunc.fixturenames:
        metafunc.parametrize("model_path", [b.model_path], ids=[b.device], scope="session")


@pytest.fixture(scope="session")
def backend(request) -> Backend:
    return request.config.stash[_BACKEND]


@pytest.fixture(scope="session", autouse=True)
def _backend_has_its_device(request, backend):
    """--backend gpu on a library without a GPU device would measure the CPU: refuse it for every test."""
    if backend.device == "gpu":
        from epikv_local.engine.native import load

        from .facts import backend_devices

        devices = backend_devices(load().lib_dir)
        request.config.stash[_SESSION]["backend_devices"] = devices
        if not any(d["type"] == "gpu" for d in devices):
            pytest.fail(f"--backend gpu: the library registered no GPU device ({devices})", pytrace=False)


@pytest.fixture(scope="session")
def backend_model(request, backend):
    from epikv_local.engine.handles import Model

    path = backend.resolved_model()
    with Model(path, n_gpu_layers=backend.n_gpu_layers) as model:
        info = model.info
        request.config.stash[_SESSION]["model"] = {
            "path": str(path), "desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd,
            "n_head": info.n_head, "n_head_kv": info.n_head_kv, "n_vocab": info.n_vocab}
        yield model


@pytest.fixture
def figures(request) -> dict:
    return request.node.stash.setdefault(_FIGURES, {})


@pytest.fixture(autouse=True)
def _count_graph_probes(request, monkeypatch):
    """Counts the nodes of every decode graph a test probes (wrapping the method, not changing its result)."""
    try:
        from epikv_local.engine.capture import CallbackHandle
    except ImportError:  # a test that needs no native code, on a machine without it
        return
    probes = request.node.stash.setdefault(_PROBES, [])
    original = CallbackHandle.probe_nodes

    def probe_nodes(self):
        nodes = original(self)
        probes.append({"graph_nodes": len(nodes),
                       "flash_attn_ext_nodes": sum(1 for _, op in nodes if op == "FLASH_ATTN_EXT"),
                       "kq_soft_max_nodes": sum(1 for name, _ in nodes if name.startswith("kq_soft_max"))})
        return nodes

    monkeypatch.setattr(CallbackHandle, "probe_nodes", probe_nodes)


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[-1])
    lines = str(report.longrepr).strip().splitlines()
    return lines[-1] if lines else report.outcome


@pytest.hookimpl(hookwrapper=True)  # the old style: the GPU machine's pytest may predate wrapper=True (8.1)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    rec = item.config.stash[_RESULTS].setdefault(item.nodeid, {
        "nodeid": item.nodeid, "name": getattr(item, "originalname", item.name), "outcome": "passed",
        "params": {k: v for k, v in getattr(getattr(item, "callspec", None), "params", {}).items()
                   if isinstance(v, (bool, int, float, str))},
        "seconds": 0.0})
    rec["seconds"] = round(rec["seconds"] + report.duration, 3)
    if report.failed and rec["outcome"] in ("passed", "skipped"):
        rec["outcome"] = "failed" if report.when == "call" else "error"
        rec["error"] = _message(report)
    elif report.skipped and rec["outcome"] == "passed":
        rec["outcome"] = "skipped"
        rec["error"] = f"skipped: {_message(report)}"
    if report.when == "teardown":  # the last phase: the test's figures are complete
        rec["figures"] = item.stash.get(_FIGURES, {})
        rec["graph_probes"] = item.stash.get(_PROBES, [])


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("backend_report")
    if path:
        b = session.config.stash[_BACKEND]
        write_json(Path(path), {"backend": {"device": b.device, "model_path": b.model_path, "threads": b.threads},
                                **session.config.stash[_SESSION], "exitstatus": int(exitstatus),
                                "tests": session.config.stash[_RESULTS]})
