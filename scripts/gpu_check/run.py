"""One ``--mode cpu|gpu`` run: ``Run`` (the report being written, the deadline, the stage timer) and
``run_check``, which goes through the stages -- refusal without a GPU, bootstrap and build, the native library,
the models, the native checks and test_native.py (pytest behind the backend fixture), the measurements -- and
leaves the JSON on every way out."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .build import Bootstrap, bootstrap, build
from .bundle import VOCAB_NAME, expected_llama_dir_name
from .common import JSON_NAME, SCHEMA, CheckError, log, pkg_version, write_json
from .facts import backend_devices, gpu_info
from .measure import measure, print_summary
from .models import Models, child_env
from .native import native_checks, native_pytest
from .presets import Preset, preset_from_args

PYTEST_MAX_S = 120.0  # GPU mode: test_native.py runs while the 8B model is quantized, at most this long ...
MEASURE_RESERVE_S = 150.0  # ... and only if this much time is left for the measurements afterwards
CHECKS_MAX_S = 180.0  # the native checks' pytest run: a hung one must not take the measurements' time
RETURNED_LOGS = ("build.log", "bench_model_f16.log", "bench_model_quantize.log", "pytest.log")  # GPU mode, to $OUT


class Run:
    """The report being written, the deadline and the stage timer."""

    def __init__(self, args, p: Preset):
        from benchlib import git_rev, machine

        self.t_origin = float(os.environ.get("GPU_CHECK_T0") or time.time())
        self.deadline = self.t_origin + p.deadline_s
        self.out_dir = Path(args.out).resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / JSON_NAME
        self.failed = False
        self.report: dict = {
            "schema": SCHEMA, "mode": args.mode, "status": "running",
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.t_origin)), "finished": None,
            "wall_seconds": None, "git": git_rev(), "machine": {**machine(), "gpu": None},
            "commands": {"run": "bash scripts/gpu_check.sh " + " ".join(sys.argv[1:])}, "versions": {},
            "stages": {}, "settings": asdict(p), "native_checks": {}, "native_pytest": {}, "variants": {},
            "contexts": {}, "longest_context": {}, "errors": [], "notes": []}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.report["wall_seconds"] = round(time.time() - self.t_origin, 1)
        write_json(self.path, self.report)

    @contextlib.contextmanager
    def stage(self, name: str):
        """Times the block into ``stages`` and saves the report after it, also when it fails."""
        t0 = time.perf_counter()
        log(f"{name} ...")
        failure = None
        try:
            yield
        except BaseException as e:
            failure = e
            raise
        finally:
            self.report["stages"][name] = round(time.perf_counter() - t0, 2)
            log(f"{name}: {self.report['stages'][name]} s" + (f" -- FAILED: {failure}" if failure else ""))
            self.save()


def load_native(run: Run, boot: Bootstrap | None, on_gpu: bool) -> None:
    """Load the library in this process and record its versions and devices; refuse a GPU run without a GPU."""
    from epikv_local.engine.native import load

    report = run.report
    nat = load()
    ll = nat.llama
    devices = backend_devices(nat.lib_dir)
    report["versions"] = {
        "llama_cpp_python": pkg_version("llama-cpp-python") or getattr(ll, "__version__", None),
        "numpy": pkg_version("numpy"), "cffi": pkg_version("cffi"), "gguf": pkg_version("gguf"),
        "lib_dir": str(nat.lib_dir), "backend_devices": devices,
        "gpu_backend": any(d["type"] == "gpu" for d in devices),
        "system_info": ll.llama_print_system_info().decode(errors="replace").strip(),
        "llama_cpp_source": (boot.cache_dir / expected_llama_dir_name() / ".epikv-prepared").read_text().split()
        if boot else None}
    if on_gpu and not report["versions"]["gpu_backend"]:
        raise CheckError(f"the built library registered no GPU device (devices: {devices})")
    if report["mode"] == "cpu" and report["versions"]["gpu_backend"]:
        report["notes"].append("cpu mode on a GPU-capable library: the driver loads models with n_gpu_layers=0, but "
                               "ggml may still run large prefill batches on the GPU (the native checks' pytest run "
                               "hides the GPU)")


def run_native(run: Run, p: Preset, check_path: Path, on_gpu: bool, env: dict, log_dir: Path,
               boot: Bootstrap | None) -> None:
    """The native checks, then (GPU mode, if the time allows) test_native.py, both behind the backend."""
    report = run.report
    device = "gpu" if on_gpu else "cpu"
    with run.stage("native_checks"):
        report["native_checks"], report["commands"]["native_checks"] = native_checks(
            check_path, device, p.threads, env, log_dir, min(CHECKS_MAX_S, max(run.left(), 30.0)))
        for name, c in report["native_checks"].items():
            if c and "passed" in c:
                why = f" ({c['error']})" if c.get("error") else ""
                log(f"  {name}: {'PASS' if c['passed'] else 'FAIL'}{why}")
                run.failed = run.failed or not c["passed"]
    if p.pytest_native and boot:
        budget_s = min(PYTEST_MAX_S, run.left() - MEASURE_RESERVE_S)
        if budget_s >= 30:
            with run.stage("native_pytest"):
                report["native_pytest"] = native_pytest(check_path, device, env, log_dir, budget_s)
                log(f"  tests/engine/test_native.py: {report['native_pytest']['summary']}")
                run.failed = run.failed or not report["native_pytest"]["passed"]
        else:
            report["native_pytest"] = {"ran": False, "reason": f"{max(budget_s, 0):.0f} s left for it before "
                                       "the measurements"}
    else:
        report["native_pytest"] = {"ran": False, "reason": "cpu mode: the test suite runs tests/engine/test_native.py "
                                   "itself" if report["mode"] == "cpu" else "--no-native-pytest"}


def run_check(args) -> int:
    """The whole run; the exit status is 0 when everything passed, 1 when a check or a stage failed."""
    p = preset_from_args(args)
    run = Run(args, p)
    report = run.report
    on_gpu = args.mode == "gpu" and args.cuda
    boot: Bootstrap | None = None
    models: Models | None = None
    try:
        if args.mode == "gpu":
            if args.cuda:
                gi = gpu_info()
                if gi is None:
                    raise CheckError("gpu mode found no NVIDIA GPU (nvidia-smi missing or failing); it never makes GPU "
                                     "figures without one: use --mode cpu")
                report["machine"]["gpu"] = gi
            boot = bootstrap(args, run)
            os.environ["EPIKV_CACHE_DIR"] = str(boot.cache_dir)
            lib_dir = boot.lib_dir
        else:
            lib_dir = Path(args.lib_dir).resolve() if args.lib_dir else None
        if lib_dir is not None:
            os.environ["EPIKV_LIB_DIR"] = str(lib_dir)
        folder = boot.work / "models" if boot else run.out_dir / "models_tmp"
        folder.mkdir(parents=True, exist_ok=True)
        vocab = boot.bundle / VOCAB_NAME if boot else (Path(args.vocab_from) if args.vocab_from else None)
        env, log_dir = child_env(boot, lib_dir), boot.logs if boot else run.out_dir
        models = Models(run, folder, vocab, env, log_dir)
        ctx_len = max(131072, p.max_context + 4096)  # n_ctx_train written to the GGUF
        bench_path = Path(args.model).resolve() if args.model else models.path("bench_model", p.bench)
        check_shape = p.check or p.bench
        check_path = models.path("check_model", p.check) if p.check else bench_path
        if boot and not args.build_only:
            models.start_f16("bench_model", p.bench, bench_path, ctx_len)
            if p.check:
                models.start_f16("check_model", p.check, check_path, 8192)
        if boot:
            build(args, boot, run)
            if args.build_only:
                report["status"] = "build_only"
                report["notes"].append("--build-only: bootstrap and build only, nothing measured")
                return 0

        with run.stage("load_native"):
            load_native(run, boot, on_gpu)
        with run.stage("check_model"):
            report["check_model"] = models.finish("check_model" if p.check else "bench_model", check_shape, check_path,
                                                  8192 if p.check else ctx_len)
        models.start_quantize("bench_model")  # GPU machine: the CPUs quantize while the GPU runs the checks
        run_native(run, p, check_path, on_gpu, env, log_dir, boot)
        with run.stage("bench_model"):
            report["bench_model"] = models.finish("bench_model", p.bench, bench_path, ctx_len)
        with run.stage("measure"):
            measure(run, p, bench_path, on_gpu)
        report["status"] = "checks_failed" if run.failed else "complete"
    except BaseException as e:
        report["status"] = "failed"
        report["errors"].append(f"{type(e).__name__}: {e}")
        raise
    finally:
        if models is not None:
            models.stop()
        if boot:
            for name in RETURNED_LOGS:
                src = boot.logs / name
                if src.is_file():
                    lines = src.read_text(errors="replace").splitlines()[-400:]
                    (run.out_dir / name).write_text("\n".join(lines) + "\n")
        elif args.mode == "cpu" and not args.keep_model:
            shutil.rmtree(run.out_dir / "models_tmp", ignore_errors=True)
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        run.save()
    if report["contexts"]:
        print_summary(report)
    log(f"wrote {run.path} ({report['status']}, {report['wall_seconds']} s)")
    return 1 if run.failed else 0
