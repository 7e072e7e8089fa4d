"""``--mode gpu``'s bootstrap and build: check and unpack the bundle into ``build/gpu_run/``, install its wheels,
configure this repository's CMake (lean CUDA options) and build only the needed targets, with every step
skipped that a warm machine has already done."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .bundle import expected_llama_dir_name
from .common import ROOT, CheckError, log, run_cmd, tail
from .facts import find_nvcc, first_line

if TYPE_CHECKING:
    from .run import Run

# lean CUDA build: flash-attention vector kernels for the f16 KV cache only (tile/MMA kernels are built for every
# head size regardless), no fatbin compression, no NCCL (one GPU)
CUDA_ARGS = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_QUANTS=f16-f16",
             "-DGGML_CUDA_COMPRESSION_MODE=none", "-DGGML_CUDA_NCCL=OFF")
BUILD_TARGETS = ("llama", "epikv_capture")  # ggml, ggml-base and the backends (cpu, cuda, rpc) come with them


@dataclass
class Bootstrap:
    work: Path
    bundle: Path
    cache_dir: Path
    lib_dir: Path
    build_dir: Path
    site_dirs: list[Path]
    build: dict = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.work / "logs"


def bootstrap(args, run: Run) -> Bootstrap:
    """Check and unpack the bundle, install its wheels, configure the build."""
    bundle = Path(args.bundle).resolve()
    work = Path(args.work).resolve()
    if not (bundle / "manifest.json").is_file():
        raise CheckError(f"no bundle at {bundle}: run `bash scripts/gpu_check.sh --prepare` on the development machine "
                         "and carry build/gpu_bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    run.report["bundle"] = {k: manifest.get(k) for k in ("created", "git", "llama_dir", "wheels", "site_packages",
                                                          "bytes", "tar_sha256")}
    want = expected_llama_dir_name()
    if manifest.get("llama_dir") != want:
        raise CheckError(f"the bundle holds {manifest.get('llama_dir')} but patches/ now give {want}: the bundle is "
                         "stale, re-run `bash scripts/gpu_check.sh --prepare`")
    boot = Bootstrap(work=work, bundle=bundle, cache_dir=work / "cache",
                     lib_dir=work / ("lib" if args.cuda else "lib-cpu"),
                     build_dir=work / ("build" if args.cuda else "build-cpu"),
                     site_dirs=[work / "site", bundle / "site"])
    boot.logs.mkdir(parents=True, exist_ok=True)
    with run.stage("unpack"):
        tree = boot.cache_dir / want
        if (tree / ".epikv-prepared").is_file():
            log(f"{tree} already unpacked (warm machine)")
        else:
            if tree.exists():
                shutil.rmtree(tree)
            boot.cache_dir.mkdir(parents=True, exist_ok=True)
            with tarfile.open(bundle / "llama.cpp.tar.gz") as tf:
                tf.extractall(boot.cache_dir, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
            log(f"unpacked {want} into {boot.cache_dir}")
    with run.stage("wheels"):
        probe = subprocess.run([sys.executable, "-c", "import cffi, pycparser"], capture_output=True, check=False,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, boot.site_dirs))})
        if probe.returncode != 0:
            wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
            proc = run_cmd([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(boot.site_dirs[0]), *wheels],
                           boot.logs / "pip.log")
            if proc.returncode != 0:
                raise CheckError(f"installing the bundled wheels failed: {tail(boot.logs / 'pip.log', 3)}")
            log(f"installed {', '.join(Path(w).name for w in wheels)}")
    for d in reversed(boot.site_dirs):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    if not shutil.which("cmake"):
        raise CheckError("no cmake on PATH")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cmake_args = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", f"-DPython_EXECUTABLE={sys.executable}"]
    if args.cuda:
        nvcc = find_nvcc()
        if not nvcc:
            raise CheckError("no nvcc (CUDA compiler) on PATH or in /usr/local/cuda*/bin")
        cmake_args += [*CUDA_ARGS, f"-DCMAKE_CUDA_COMPILER={nvcc}",
                       f"-DCUDAToolkit_ROOT={Path(nvcc).resolve().parent.parent}"]
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
        boot.build["nvcc"] = next((ln.strip() for ln in version.splitlines() if "release" in ln), version.strip())
        boot.build["nvcc_path"] = nvcc
    cmake_args += list(args.cmake_arg or [])
    jobs = args.jobs or os.cpu_count() or 4
    configure = ["cmake", "-S", str(ROOT), "-B", str(boot.build_dir), *gen, *cmake_args]
    build = ["cmake", "--build", str(boot.build_dir), "--target", *BUILD_TARGETS, "-j", str(jobs)]
    boot.build.update({"cmake": first_line(["cmake", "--version"]),
                       "ninja": first_line(["ninja", "--version"]) if gen else None,
                       "cxx": first_line(["c++", "--version"]), "jobs": jobs, "build_dir": str(boot.build_dir),
                       "configure_command": configure, "build_command": build,
                       "ld_library_path": os.environ.get("LD_LIBRARY_PATH")})
    run.report["build"] = boot.build
    with run.stage("configure"):
        marker = boot.build_dir / ("build.ninja" if gen else "Makefile")
        if (boot.build_dir / "CMakeCache.txt").is_file() and marker.is_file():
            log(f"{boot.build_dir} already configured (warm machine)")
        else:
            env = {**os.environ, "EPIKV_CACHE_DIR": str(boot.cache_dir)}
            if run_cmd(configure, boot.logs / "build.log", env).returncode != 0:
                raise CheckError(f"cmake configure failed:\n{tail(boot.logs / 'build.log')}")
    return boot


def missing_shared_libs(lib: Path) -> list[str]:
    """Libraries that ``ldd`` cannot resolve for lib (empty when ldd is missing)."""
    if not shutil.which("ldd"):
        return []
    proc = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=False)
    return [ln.split()[0] for ln in proc.stdout.splitlines() if "not found" in ln]


def build(args, boot: Bootstrap, run: Run) -> None:
    """Build the needed targets and copy the libraries into boot.lib_dir."""
    with run.stage("build"):
        env = {**os.environ, "EPIKV_CACHE_DIR": str(boot.cache_dir)}
        t0 = time.perf_counter()
        proc = run_cmd(boot.build["build_command"], boot.logs / "build.log", env)
        boot.build["build_seconds"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0:
            raise CheckError(f"the build failed:\n{tail(boot.logs / 'build.log', 40)}")
        if boot.lib_dir.exists():
            shutil.rmtree(boot.lib_dir)
        boot.lib_dir.mkdir(parents=True)
        for p in boot.build_dir.rglob("lib*.so*"):
            if "CMakeFiles" not in p.parts and p.is_file():  # versioned symlinks stay symlinks
                shutil.copy2(p, boot.lib_dir / p.name, follow_symlinks=False)
        names = sorted(p.name for p in boot.lib_dir.iterdir())
        boot.build["libraries"] = {n: (boot.lib_dir / n).resolve().stat().st_size for n in names if n.endswith(".so")}
        need = ["libllama.so", "libepikv_capture.so"] + (["libggml-cuda.so"] if args.cuda else [])
        if not set(need) <= set(names):
            raise CheckError(f"the build produced no {', '.join(sorted(set(need) - set(names)))} (found {names})")
        missing = sorted({m for n in boot.build["libraries"] for m in missing_shared_libs(boot.lib_dir / n)})
        boot.build["unresolved_shared_libs"] = missing
        if missing:
            raise CheckError(f"the built libraries need {', '.join(missing)}, which the loader does not find: add "
                             "their folder to LD_LIBRARY_PATH (gpu_check.sh adds the CUDA toolkit's lib64)")
        log(f"built in {boot.build['build_seconds']} s: {', '.join(boot.build['libraries'])}")
