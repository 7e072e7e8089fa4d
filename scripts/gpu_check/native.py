"""The driver's side of the native tests: runs pytest with the backend plugin (``gpu_check.backend``) in a child
process -- the checks of ``checks`` with test_native.py's flash-attention graph test, and in GPU mode the whole
of tests/engine/test_native.py -- and turns the plugin's report into the JSON's ``native_checks`` and
``native_pytest`` entries (the same schema as when the checks ran inside the driver)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ROOT, log, run_cmd, tail

CHECKS_FILE = "scripts/gpu_check/checks.py"
NATIVE_FILE = "tests/engine/test_native.py"
FLASH_TEST = "test_graph_nodes_show_flash_attention"
#: the JSON's check -> (file, test function, its parameters) of the pytest test that makes it
CHECKS = {
    "capture_gpu_vs_cpu": (CHECKS_FILE, "test_capture_gpu_vs_cpu", {}),
    "flash_attn_graph": (NATIVE_FILE, FLASH_TEST, {"flash_attn": True}),
    "budget_held": (CHECKS_FILE, "test_budget_held", {}),
    "bit_identical_no_eviction": (CHECKS_FILE, "test_bit_identical_no_eviction", {}),
}


def run_pytest(targets: list[str], device: str, model: Path, threads: int | None, env: dict, log_path: Path,
               timeout: float) -> dict:
    """pytest on targets behind the backend; its output is appended to log_path. Returns the command, return
    code (None: timed out), last summary line, seconds and the plugin's report ({} when it wrote none)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_pytest_") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check.backend",
               "--backend", device, "--backend-model", str(model), "--backend-report", str(report_path),
               *(["--backend-threads", str(threads)] if threads else []), *targets]
        t0 = time.perf_counter()
        try:
            rc = run_cmd(cmd, log_path, env, timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = None
        seconds = round(time.perf_counter() - t0, 1)
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    # the log holds every run of this process: the last summary line is this run's
    summary = [ln for ln in tail(log_path, 40).splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    return {"command": " ".join(cmd), "returncode": rc, "timed_out": rc is None,
            "summary": summary[-1] if summary else None, "seconds": seconds, "report": report}


def _find(tests: dict, file: str, func: str, params: dict) -> dict | None:
    for nodeid, rec in tests.items():
        if (nodeid.startswith(file + "::") and rec["name"] == func
                and all(rec["params"].get(k) == v for k, v in params.items())):
            return rec
    return None


def check_entry(rec: dict | None, why_missing: str, model: dict | None) -> dict:
    """A test's record as the JSON's check entry: ``passed``, its figures, the test and its time (and
    ``error`` when it did not pass)."""
    if rec is None:
        return {"passed": False, "error": f"not run: {why_missing}"}
    entry = {"passed": rec["outcome"] == "passed", **rec.get("figures", {})}
    if rec["name"] == FLASH_TEST:  # the figures of its graph probe, recorded by the plugin
        entry.update(rec["graph_probes"][-1] if rec.get("graph_probes") else {})
        entry["n_layer"] = (model or {}).get("n_layer")
    entry.setdefault("seconds", rec["seconds"])
    entry["test"] = rec["nodeid"]
    if rec.get("error"):
        entry["error"] = rec["error"]
    return entry


def native_checks(model: Path, device: str, threads: int | None, env: dict, log_dir: Path,
                  timeout: float) -> tuple[dict, str]:
    """The four native checks on one model (each entry has ``passed``) and the pytest command that ran them."""
    res = run_pytest([CHECKS_FILE, f"{NATIVE_FILE}::{FLASH_TEST}"], device, model, threads, env,
                     log_dir / "pytest.log", timeout)
    report = res["report"]
    why = ("timed out" if res["timed_out"] else res["summary"] or
           f"pytest wrote no report (exit {res['returncode']}): {tail(log_dir / 'pytest.log', 3)}")
    out = {name: check_entry(_find(report.get("tests", {}), *spec), why, report.get("model"))
           for name, spec in CHECKS.items()}
    out["model"] = report.get("model")
    log(f"  native checks: {res['summary']} ({res['seconds']} s)")
    return out, res["command"]


def native_pytest(model: Path, device: str, env: dict, log_dir: Path, timeout: float) -> dict:
    """The whole of tests/engine/test_native.py on the backend, the model in the default model's place."""
    res = run_pytest([NATIVE_FILE], device, model, None, env, log_dir / "pytest.log", timeout)
    tests = res["report"].get("tests", {}).values()
    outcomes = {o: sum(1 for t in tests if t["outcome"] == o) for o in ("passed", "failed", "error", "skipped")}
    return {"ran": True, "passed": res["returncode"] == 0, "returncode": res["returncode"],
            "timed_out": res["timed_out"], "summary": res["summary"], "seconds": res["seconds"],
            "outcomes": outcomes, "failed_tests": [t["nodeid"] for t in tests if t["outcome"] in ("failed", "error")],
            "command": res["command"], "backend": device,
            "model": "random weights in the default model's place (SmolLM2-135M's shape, Llama-3 vocab)"}
