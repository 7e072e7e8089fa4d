"""The prepared GPU check (scripts/gpu_check.sh, docs/gpu.md): its CPU mode end to end, its bundle, its refusals.

The CPU mode runs the same driver as the GPU run with small shapes; these tests check the JSON's schema and
invariants (all four variants at every context, budgets held, flash attention on/off as documented, finite
numbers), never a speed threshold.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
VARIANTS = {"plain", "epikv", "streaming", "h2o"}
CHECKS = {"capture_gpu_vs_cpu", "flash_attn_graph", "budget_held", "bit_identical_no_eviction"}


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory, model_path) -> dict:
    out = tmp_path_factory.mktemp("gpu_check_cpu")
    # a roomier cap than the default 4 s (a slow CI machine still reaches every context) and a shorter search
    proc = run_script("--mode", "cpu", "--out", str(out), "--variant-cap-s", "15", "--max-context", "2048")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "gpu_check.log").is_file()  # the console output, kept by gpu_check.sh
    assert not (out / "models_tmp").exists()  # the random model is removed
    return json.loads((out / "gpu_check.json").read_text())


def test_cpu_mode_schema(cpu_report):
    r = cpu_report
    for key in ("schema", "mode", "status", "started", "finished", "wall_seconds", "git", "machine", "commands",
                "versions", "stages", "settings", "check_model", "native_checks", "native_pytest", "bench_model",
                "variants", "contexts", "longest_context", "errors", "notes"):
        assert key in r, key
    assert r["schema"] == "epikv-gpu-check/1"
    assert r["mode"] == "cpu" and r["status"] == "complete" and r["errors"] == []
    assert r["machine"]["gpu"] is None  # never a GPU figure in CPU mode
    assert r["versions"]["gpu_backend"] is False
    assert all(d["type"] != "gpu" for d in r["versions"]["backend_devices"])
    assert any(d["type"] == "cpu" for d in r["versions"]["backend_devices"])
    assert r["commands"]["run"].startswith("bash scripts/gpu_check.sh")
    assert "make_random_model.py" in r["commands"]["bench_model"]
    s = r["settings"]
    assert s["contexts"] == [256, 512, 1024] and s["bench"]["layers"] == 4 and s["bench"]["embd"] == 256
    assert r["bench_model"]["n_layer"] == 4 and r["bench_model"]["n_embd"] == 256
    for stage in ("load_native", "check_model", "native_checks", "bench_model", "measure"):
        assert finite(r["stages"][stage]), stage
    assert r["native_pytest"]["ran"] is False


def test_cpu_mode_native_checks(cpu_report):
    checks = cpu_report["native_checks"]
    assert CHECKS <= set(checks)
    for name in CHECKS:
        assert checks[name]["passed"] is True, (name, checks[name])
    cap = checks["capture_gpu_vs_cpu"]
    assert cap["gpu_offload"] is False and cap["max_rel_err_hidden"] == 0.0  # both runs on the CPU here
    assert checks["flash_attn_graph"]["flash_attn_ext_nodes"] >= checks["model"]["n_layer"]
    assert checks["flash_attn_graph"]["kq_soft_max_nodes"] == 0
    held = checks["budget_held"]
    assert held["max_live"] <= held["kv_budget"] and held["max_cells_in_cache"] <= held["kv_budget"]
    assert held["n_evicted"] > 0 and held["engine_and_cache_agree"] is True
    same = checks["bit_identical_no_eviction"]
    assert same["logits_bit_identical"] is True and same["epikv_evicted"] == 0 and same["max_abs_diff"] == 0.0


def test_cpu_mode_native_checks_are_pytest_tests_behind_the_backend(cpu_report):
    checks = cpu_report["native_checks"]
    cmd = cpu_report["commands"]["native_checks"]
    assert "-p gpu_check.backend" in cmd and "--backend cpu" in cmd
    # the flash-attention check is test_native.py's own test, the others are gpu_check's
    assert checks["flash_attn_graph"]["test"].startswith(
        "tests/engine/test_native.py::test_graph_nodes_show_flash_attention[")
    for name in CHECKS - {"flash_attn_graph"}:
        assert checks[name]["test"] == f"scripts/gpu_check/checks.py::test_{name}", name
    assert checks["model"]["path"] == cpu_report["check_model"]["path"]


def test_cpu_mode_variants_and_contexts(cpu_report):
    r = cpu_report
    budget = r["settings"]["budget"]
    assert set(r["variants"]) == VARIANTS
    assert set(r["contexts"]) == {str(c) for c in r["settings"]["contexts"]}
    for c, row in r["contexts"].items():
        assert set(row) == VARIANTS, c  # all four variants present at every context
        for name, e in row.items():
            assert e["reached"] is True, (c, name, e)  # small shapes: every variant gets there within its cap
            assert finite(e["decode_tokens_per_s"]) and e["decode_tokens_per_s"] > 0, (c, name)
            assert finite(e["rss_mib"]) and e["vram_used_mib"] is None
            assert e["flash_attn_ran"] is (name != "h2o"), (c, name)  # H2O with flash attention off, the rest on
            assert e["flash_attn_requested"] is (name != "h2o"), (c, name)
            if name == "plain":
                assert e["kv_budget"] is None and e["live_cells"] > int(c)  # the full cache
                assert e["mean_eviction_round_ms"] is None
            else:
                assert e["kv_budget"] == budget and e["live_cells"] <= budget and e["max_live"] <= budget
                assert finite(e["mean_eviction_round_ms"]) and e["mean_eviction_round_ms"] > 0
    for name, v in r["variants"].items():
        assert v["error"] is None and v["budget_respected"] is True, name
        assert v["flash_attn_requested"] is (name != "h2o") and v["flash_attn_ran"] is (name != "h2o")
        assert finite(v["prefill_tokens_per_s"]) and v["prefill_tokens_per_s"] > 0
        if name == "plain":
            assert v["n_evicted"] == 0 and v["kv_budget"] is None
        else:
            assert v["n_evicted"] > 0 and v["max_live"] <= budget
            assert v["capture_layers"] if name == "epikv" else True
        for cp in v["checkpoints"]:
            assert cp["cells_in_cache"] == cp["live_cells"]  # llama.cpp's cells and the engine agree
            assert finite(cp["decode_tokens_per_s"]) and cp["decode_tokens"] == r["settings"]["decode_tokens"]
        lc = r["longest_context"][name]
        assert lc["tokens"] >= max(r["settings"]["contexts"])
        assert lc["stop_reason"] in ("time_cap", "max_context", "cache_full")
    assert "computed_max_context_by_memory" in r["longest_context"]["plain"]


def test_prepare_bundle_under_the_limit(tmp_path):
    bundle = tmp_path / "bundle"
    proc = run_script("--prepare", "--bundle", str(bundle), timeout=180)
    if proc.returncode != 0 and "pip could not download" in proc.stderr:
        pytest.skip(f"no package index to fetch the device's wheels: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    size = float(next(ln for ln in proc.stdout.splitlines() if ln.startswith("BUNDLE_MIB=")).split("=")[1])
    assert 0 < size <= 60
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert abs(total / 2**20 - size) < 0.01
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["llama_dir"].startswith("llama.cpp-")
    assert {w.split("-")[0] for w in manifest["wheels"]} == {"cffi", "pycparser"}
    assert any("cp312" in w and "manylinux" in w for w in manifest["wheels"])
    assert set(manifest["site_packages"]) == {"llama_cpp", "gguf", "diskcache"}
    for name in ("llama.cpp.tar.gz", "vocab-llama-bpe.gguf"):
        assert (bundle / name).is_file(), name
    assert not list((bundle / "site").rglob("*.so")) and not list((bundle / "site").rglob("__pycache__"))
    import tarfile

    with tarfile.open(bundle / "llama.cpp.tar.gz") as tf:
        names = tf.getnames()
    top = manifest["llama_dir"]
    for needed in ("CMakeLists.txt", ".epikv-prepared", "include/llama.h", "ggml/src/ggml-cuda/CMakeLists.txt",
                   "ggml/src/ggml-cpu/CMakeLists.txt", "ggml/src/ggml-rpc/CMakeLists.txt", "tools/rpc/rpc-server.cpp"):
        assert f"{top}/{needed}" in names, needed
    for dropped in ("ggml/src/ggml-vulkan/", "ggml/src/ggml-metal/", "ggml/src/ggml-sycl/", "tests/", "docs/",
                    "examples/", "models/", "tools/server/"):
        assert not any(n.startswith(f"{top}/{dropped}") for n in names), dropped


def test_gpu_mode_refuses_without_a_gpu(tmp_path):
    if subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi")
    proc = run_script("--mode", "gpu", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "no NVIDIA GPU" in proc.stdout + proc.stderr
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["mode"] == "gpu" and r["status"] == "failed" and r["variants"] == {} and r["contexts"] == {}


def test_gpu_mode_refuses_a_stale_bundle(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"llama_dir": "llama.cpp-000000000000-000000000000"}))
    proc = run_script("--mode", "gpu", "--no-cuda", "--build-only", "--bundle", str(bundle), "--work",
                      str(tmp_path / "work"), "--out", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2
    assert "stale" in proc.stdout + proc.stderr


def test_no_cuda_needs_build_only(tmp_path):
    proc = run_script("--mode", "gpu", "--no-cuda", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "--build-only" in proc.stdout + proc.stderr
