#!/usr/bin/env python3
"""The prepared GPU check: native checks and a speed/memory/context comparison, in one JSON file.

Three modes (``scripts/gpu_check.sh`` picks the interpreter and keeps a log; docs/gpu.md says how to run them):

``--prepare`` (here, before a device run)
    Builds the travel bundle in ``build/gpu_bundle/`` (ignored by git; the device tool carries it):
    ``llama.cpp.tar.gz`` (the patched llama.cpp tree of ``scripts/prepare_llama_cpp.py``, pruned to what a
    CUDA build of libllama + ggml-base/-cpu/-cuda/-rpc needs), ``vocab-llama-bpe.gguf`` (llama.cpp's
    vocab-only Llama-3 tokenizer GGUF: the random models get Llama-3's 128,256-token vocabulary),
    ``wheels/`` (cffi and pycparser for CPython 3.12 manylinux x86-64), ``site/`` (the pure-Python packages
    llama_cpp (ctypes bindings only), gguf and diskcache, copied from this environment) and
    ``manifest.json``. Fails when the bundle exceeds ``--max-bundle-mib`` or bundle + working tree exceed
    the device tool's 64 MiB.

``--mode gpu`` (there, on the machine with the GPU)
    Unpacks the bundle into ``build/gpu_run/`` (kept on a warm machine: a rerun skips what is done),
    installs the wheels, builds the patched library and the capture shim with CUDA (sm_90, ninja, all
    cores, only the needed targets; a background process writes the 8B-shaped F16 model meanwhile), then
    runs the checks and measurements below on the GPU and writes ``$OUT/gpu_check.json``. Refuses to run
    without an NVIDIA GPU: it never produces GPU figures from anything else.

``--mode cpu`` (here and in CI)
    The same checks and measurements with small shapes on the CPU, using the installed package (no
    rebuild): a 4-layer random model, contexts 256/512/1024. Same JSON schema, ``"mode": "cpu"``.

What both modes run, on a random-weight model made by ``scripts/make_random_model.py``:

* native checks: the captured layer outputs (EPIKV's two layers) of a model with every layer on the GPU
  equal those of the same model on the CPU within a stated tolerance; the decode graph has
  FLASH_ATTN_EXT nodes (and no soft_max); an evicting session holds its budget (engine and llama.cpp's
  cells agree); EPIKV with a budget >= the sequence gives bit-identical logits to no eviction;
* per variant -- ``plain`` (no eviction, full cache), ``epikv`` and ``streaming`` (budget ``--budget``),
  ``h2o`` (flash attention off, attention read back) -- one growing sequence (random prompt tokens,
  prefilled in ``--batch`` chunks) with a greedy decode of ``--decode-tokens`` tokens at each context of
  ``--contexts``: decode tokens/s, eviction rounds and their mean time, live cells, KV bytes, memory used
  (GPU: ``nvidia-smi``; CPU: process RSS); then the sequence keeps growing (checkpoints at doubling
  lengths up to ``--max-context``) until the variant's time cap, the allocated cache (plain) or the run's
  deadline: the longest context each variant reaches, with the reason it stopped;
* in GPU mode, when time is left: ``tests/test_native.py`` itself, on a SmolLM2-shaped random model.

Exit status: 0 when every check passed and every stage ran, 1 when a check failed or a stage failed
(the JSON says which), 2 with one ``gpu_check: error: ...`` line for bad input or a missing prerequisite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
for _p in (str(SCRIPTS), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from epikv_local.errors import EpikvError, run_main  # noqa: E402  (errors.py imports nothing of the package)

SCHEMA = "epikv-gpu-check/1"
BUNDLE = ROOT / "build" / "gpu_bundle"
WORK = ROOT / "build" / "gpu_run"
JSON_NAME = "gpu_check.json"
DEVICE_TRAVEL_MIB = 64.0  # the device tool's limit on the working tree + carried paths
VOCAB_FILE = "models/ggml-vocab-llama-bpe.gguf"  # in the llama.cpp tree: Llama-3's tokenizer, vocab only
VOCAB_NAME = "vocab-llama-bpe.gguf"
SITE_PACKAGES = ("llama_cpp", "gguf", "diskcache")  # pure Python, copied from this environment
WHEELS = ("cffi", "pycparser")  # cffi has a compiled part: wheels for the device's CPython 3.12
DEVICE_PY = "3.12"
# the pruned llama.cpp tree: everything CMake reads for libllama + ggml-base/-cpu/-cuda/-rpc and rpc-server.cpp
TREE_FILES = ("CMakeLists.txt", "LICENSE", ".epikv-prepared", "ggml/CMakeLists.txt")
TREE_DIRS = ("cmake", "include", "src", "licenses", "vendor", "ggml/cmake", "ggml/include", "tools/rpc")
TREE_DROP = ("vendor/cpp-httplib",)  # only built with LLAMA_BUILD_COMMON (forced off)
GGML_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")  # ggml/src/<backend> kept; every other backend dropped

VARIANTS = {  # name -> registered policy, flash attention
    "plain": ("none", True),
    "epikv": ("epikv", True),
    "streaming": ("streaming", True),
    "h2o": ("h2o", False),
}
TEXT = ("Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15 and x = 5. "
        "Check: 3 * 5 + 5 = 20. Therefore the answer is 5. Now consider the next problem carefully.")
# GPU-resident vs CPU capture: max relative L2 error of a captured hidden-state row, and of g
CAPTURE_RTOL = 5e-2


@dataclass
class Shape:
    layers: int
    embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    ftype: str


@dataclass
class Preset:
    bench: Shape
    check: Shape | None  # None: the native checks use the benchmark model
    contexts: list[int]
    budget: int
    n_batch: int
    decode_tokens: int
    max_context: int
    variant_cap_s: float
    deadline_s: float
    pytest_native: bool


PRESETS = {
    # Llama-3-8B: 32 layers, n_embd 4096, 32 heads / 8 KV heads (head_dim 128), n_ff 14336, vocab 128256
    "gpu": Preset(bench=Shape(32, 4096, 32, 8, 14336, "q4_k_m"), check=Shape(30, 576, 9, 3, 1536, "q4_0"),
                  contexts=[4096, 16384, 32768], budget=2048, n_batch=512, decode_tokens=32,
                  max_context=262144, variant_cap_s=40.0, deadline_s=480.0, pytest_native=True),
    "cpu": Preset(bench=Shape(4, 256, 4, 2, 768, "q4_k_m"), check=None,
                  contexts=[256, 512, 1024], budget=128, n_batch=32, decode_tokens=16,
                  max_context=4096, variant_cap_s=4.0, deadline_s=240.0, pytest_native=False),
}


class CheckError(EpikvError):
    """A prerequisite of the GPU check is missing (bundle, GPU, compiler) or a step failed."""


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mib(n: float) -> float:
    return round(n / 2**20, 2)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(x):
    try:
        import numpy as np

        if isinstance(x, np.integer):
            return int(x)
        if isinstance(x, np.floating):
            return float(x)
        if isinstance(x, np.bool_):
            return bool(x)
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def finite_or_none(x):
    return x if x is None or (isinstance(x, (int, float)) and math.isfinite(x)) else None


def run_cmd(cmd: list[str], log_path: Path | None = None, env: dict | None = None, timeout: float | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command; its output goes to log_path (appended) or is captured."""
    if log_path is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout, cwd=cwd)


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ==========================================================================================================
# --prepare: the travel bundle
# ==========================================================================================================
def prepared_llama_dir() -> Path:
    """The patched llama.cpp tree for the current patches (extracted and patched now if missing)."""
    import prepare_llama_cpp as plc

    if os.environ.get("EPIKV_LLAMA_SOURCE_DIR"):
        raise CheckError("--prepare bundles the pinned sdist's tree (the device computes its name from "
                         "patches/SOURCE); unset EPIKV_LLAMA_SOURCE_DIR")
    try:
        return plc.prepare(os.environ.get("EPIKV_LLAMA_SDIST") or None, None)
    except plc.PrepareError as e:
        raise CheckError(f"preparing the llama.cpp source failed: {e}") from None


def expected_llama_dir_name() -> str:
    """The directory name prepare_llama_cpp.py gives the patched sdist tree of the current patches."""
    import prepare_llama_cpp as plc

    _, _, digest = plc.read_source()
    return f"llama.cpp-{digest[:12]}-{plc.patches_digest(plc.series())[:12]}"


def pruned_tree(src: Path) -> list[Path]:
    """Relative paths of the files of the pruned llama.cpp tree."""
    out: list[Path] = []

    def walk(d: Path) -> None:
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(src)
            if p.is_dir() or "__pycache__" in rel.parts or any(part.startswith(".git") for part in rel.parts):
                continue
            if any(rel.as_posix().startswith(x + "/") for x in TREE_DROP):
                continue
            out.append(rel)

    for f in TREE_FILES:
        if not (src / f).is_file():
            raise CheckError(f"the llama.cpp tree {src} has no {f}")
        out.append(Path(f))
    for d in TREE_DIRS:
        if not (src / d).is_dir():
            raise CheckError(f"the llama.cpp tree {src} has no {d}/")
        walk(src / d)
    gsrc = src / "ggml" / "src"
    for p in sorted(gsrc.iterdir()):
        if p.is_file():
            out.append(p.relative_to(src))
        elif p.name in GGML_BACKENDS:
            walk(p)
    return out


def travelling_tree_bytes() -> int | None:
    """Bytes of what the device tool sends besides carried paths: tracked + untracked-not-ignored files."""
    try:
        proc = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    if proc.returncode != 0:
        return None
    total = 0
    for name in proc.stdout.decode("utf-8", "replace").split("\0"):
        p = ROOT / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def wheel_cache() -> Path:
    from prepare_llama_cpp import cache_dir

    return cache_dir() / "gpu-wheels"


def download_wheels(dest: Path) -> list[Path]:
    """cffi + pycparser wheels for CPython 3.12 manylinux x86-64, the versions installed here (cached)."""
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for name in WHEELS:
        try:
            reqs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            reqs.append(name)
    cache = wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)

    def cached() -> list[Path]:
        found = []
        for req in reqs:
            name, _, ver = req.partition("==")
            hits = sorted(p for p in cache.glob(f"{name}-{ver or '*'}-*.whl")
                          if "cp312" in p.name or "py3-none-any" in p.name or "py2.py3-none-any" in p.name)
            if not hits:
                return []
            found.append(hits[-1])
        return found

    wheels = cached()
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               DEVICE_PY, "--implementation", "cp", "--platform", "manylinux2014_x86_64", "--platform",
               "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "-d", str(cache), *reqs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = cached()
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise CheckError(f"pip could not download the device's wheels ({' '.join(reqs)}): {last[0]}")
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for w in wheels:
        shutil.copy2(w, dest / w.name)
        out.append(dest / w.name)
    return out


def copy_site_packages(dest: Path) -> dict[str, str]:
    """Copy the pure-Python packages the device lacks; returns name -> version."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    dist = {"llama_cpp": "llama-cpp-python", "gguf": "gguf", "diskcache": "diskcache"}
    versions = {}
    for name in SITE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise CheckError(f"package {name} is not installed here (bash scripts/install.sh installs it)")
        src = Path(list(spec.submodule_search_locations)[0])
        compiled = [p for p in src.rglob("*") if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name]
        if compiled:  # llama_cpp must be the bindings only: the library is the patched build's
            raise CheckError(f"{src} holds compiled files ({compiled[0].name}); the bundle takes pure Python only")
        shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        try:
            versions[name] = version(dist[name])
        except PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def prepare(args) -> int:
    from benchlib import git_rev

    t0 = time.perf_counter()
    bundle = Path(args.bundle).resolve()
    limit = float(args.max_bundle_mib)
    llama = prepared_llama_dir()
    name = llama.name
    if name != expected_llama_dir_name():
        raise CheckError(f"prepared tree {name} is not the one the device will look for "
                         f"({expected_llama_dir_name()})")
    if bundle.exists():
        shutil.rmtree(bundle)
    bundle.mkdir(parents=True)
    files = pruned_tree(llama)
    tree_bytes = sum((llama / f).stat().st_size for f in files)
    tar_path = bundle / "llama.cpp.tar.gz"
    with tarfile.open(tar_path, "w:gz", compresslevel=6) as tf:
        for rel in files:
            info = tf.gettarinfo(str(llama / rel), arcname=f"{name}/{rel.as_posix()}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(llama / rel, "rb") as f:
                tf.addfile(info, f)
    vocab_src = llama / VOCAB_FILE
    if not vocab_src.is_file():
        raise CheckError(f"{vocab_src} is missing: the bundle needs llama.cpp's Llama-3 vocab GGUF")
    shutil.copy2(vocab_src, bundle / VOCAB_NAME)
    wheels = download_wheels(bundle / "wheels")
    versions = copy_site_packages(bundle / "site")
    parts = {
        "llama.cpp.tar.gz": tar_path.stat().st_size,
        VOCAB_NAME: (bundle / VOCAB_NAME).stat().st_size,
        "wheels": dir_bytes(bundle / "wheels"),
        "site": dir_bytes(bundle / "site"),
    }
    total = sum(parts.values())
    tree = travelling_tree_bytes()
    manifest = {
        "schema": "epikv-gpu-bundle/1",
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "git": git_rev(),
        "llama_dir": name,
        "llama_source": (llama / ".epikv-prepared").read_text().strip().splitlines(),
        "tree_files": len(files),
        "tree_bytes_uncompressed": tree_bytes,
        "ggml_backends": list(GGML_BACKENDS),
        "vocab": {"file": VOCAB_NAME, "from": VOCAB_FILE, "sha256": sha256(bundle / VOCAB_NAME)},
        "wheels": [w.name for w in wheels],
        "site_packages": versions,
        "device_python": DEVICE_PY,
        "bytes": parts,
        "total_bytes": total,
        "working_tree_bytes": tree,
        "tar_sha256": sha256(tar_path),
    }
    write_json(bundle / "manifest.json", manifest)
    total = dir_bytes(bundle)
    print(f"bundle: {bundle}")
    for k, v in parts.items():
        print(f"  {k:22} {mib(v):8.2f} MiB")
    print(f"  {'total':22} {mib(total):8.2f} MiB  (limit {limit:g} MiB; pruned llama.cpp tree: {len(files)} files, "
          f"{mib(tree_bytes):.1f} MiB before compression)")
    if tree is not None:
        print(f"  working tree that travels with it: {mib(tree):.2f} MiB; together {mib(total + tree):.2f} MiB "
              f"of the device tool's {DEVICE_TRAVEL_MIB:g} MiB")
    print(f"  built in {time.perf_counter() - t0:.1f} s")
    if mib(total) > limit:
        raise CheckError(f"the bundle is {mib(total):.1f} MiB, over the {limit:g} MiB limit")
    if tree is not None and mib(total + tree) > DEVICE_TRAVEL_MIB:
        raise CheckError(f"bundle + working tree = {mib(total + tree):.1f} MiB, over the device tool's "
                         f"{DEVICE_TRAVEL_MIB:g} MiB")
    print(f"BUNDLE_MIB={mib(total):.2f}")
    return 0


# ==========================================================================================================
# --mode gpu: bootstrap (unpack, wheels, build)
# ==========================================================================================================
def gpu_info() -> dict | None:
    """name / memory / driver of GPU 0 from nvidia-smi, or None when there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=name,memory.total,memory.used,driver_version",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = proc.stdout.strip().splitlines()[:1]
    if proc.returncode != 0 or not line:
        return None
    f = [x.strip() for x in line[0].split(",")]
    try:
        return {"name": f[0], "memory_total_mib": float(f[1]), "memory_used_mib": float(f[2]), "driver": f[3]}
    except (IndexError, ValueError):
        return None


def gpu_used_mib() -> float | None:
    info = gpu_info()
    return info["memory_used_mib"] if info else None


def rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def mem_available_mib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def tool_version(cmd: list[str]) -> str | None:
    exe = shutil.which(cmd[0]) or (cmd[0] if Path(cmd[0]).is_file() else None)
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[-1] if out else None


def find_nvcc() -> str | None:
    exe = shutil.which("nvcc")
    if exe:
        return exe
    for cand in ("/usr/local/cuda/bin/nvcc", *sorted(str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc"))):
        if Path(cand).is_file():
            return cand
    return None


@dataclass
class Bootstrap:
    work: Path
    lib_dir: Path
    site_dirs: list[Path]
    cache_dir: Path
    build: dict = field(default_factory=dict)


def bootstrap(args, report: dict, stage) -> Bootstrap:
    """Unpack the bundle, install the wheels, configure and build; returns where things are."""
    bundle = Path(args.bundle).resolve()
    work = Path(args.work).resolve()
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        raise CheckError(f"no bundle at {bundle}: run `bash scripts/gpu_check.sh --prepare` on the development "
                         "machine and carry build/gpu_bundle")
    manifest = json.loads(manifest_path.read_text())
    report["bundle"] = {k: manifest.get(k) for k in ("created", "git", "llama_dir", "wheels", "site_packages",
                                                      "total_bytes", "tar_sha256")}
    want = expected_llama_dir_name()
    if manifest.get("llama_dir") != want:
        raise CheckError(f"the bundle holds {manifest.get('llama_dir')} but patches/ now give {want}: the bundle is "
                         "stale, re-run `bash scripts/gpu_check.sh --prepare`")
    cache = work / "cache"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with stage("unpack"):
        tree = cache / want
        if not (tree / ".epikv-prepared").is_file():
            if tree.exists():
                shutil.rmtree(tree)
            cache.mkdir(parents=True, exist_ok=True)
            with tarfile.open(bundle / "llama.cpp.tar.gz") as tf:
                kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
                tf.extractall(cache, **kw)
            log(f"unpacked {want} into {cache}")
        else:
            log(f"{tree} already unpacked (warm machine)")
    site = work / "site"
    with stage("wheels"):
        probe = subprocess.run([sys.executable, "-c", "import cffi, pycparser"], capture_output=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(bundle / "site")])})
        if probe.returncode != 0:
            wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
            proc = run_cmd([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], logs / "pip.log")
            if proc.returncode != 0:
                raise CheckError(f"installing the bundled wheels failed: {tail(logs / 'pip.log', 3)}")
            log(f"installed {', '.join(Path(w).name for w in wheels)} into {site}")
    site_dirs = [site, bundle / "site"]
    for d in reversed(site_dirs):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    build_dir = work / ("build" if args.cuda else "build-cpu")
    lib_dir = work / ("lib" if args.cuda else "lib-cpu")
    boot = Bootstrap(work=work, lib_dir=lib_dir, site_dirs=site_dirs, cache_dir=cache)
    env = {**os.environ, "EPIKV_CACHE_DIR": str(cache)}
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = str(args.jobs or os.cpu_count() or 4)
    cmake_args = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", f"-DPython_EXECUTABLE={sys.executable}"]
    if args.cuda:
        nvcc = find_nvcc()
        if not nvcc:
            raise CheckError("no nvcc (CUDA compiler) on PATH or in /usr/local/cuda*/bin")
        cmake_args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                       # flash attention vector kernels for the f16 KV cache only (the tile/MMA kernels are built
                       # for every head size anyway); no fatbin compression; no NCCL (one GPU)
                       "-DGGML_CUDA_FA_QUANTS=f16-f16", "-DGGML_CUDA_COMPRESSION_MODE=none", "-DGGML_CUDA_NCCL=OFF"]
        boot.build["nvcc"] = tool_version([nvcc, "--version"])
    if not shutil.which("cmake"):
        raise CheckError("no cmake on PATH")
    cmake_version = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    boot.build.update({"cmake_args": cmake_args, "generator": "Ninja" if gen else "default", "jobs": int(jobs),
                       "targets": ["llama", "epikv_capture"], "build_dir": str(build_dir),
                       "cmake": cmake_version[0] if cmake_version else None,
                       "ninja": tool_version(["ninja", "--version"]) if gen else None})
    report["build"] = boot.build
    with stage("configure"):
        if not (build_dir / "CMakeCache.txt").is_file() or not (build_dir / ("build.ninja" if gen else "Makefile")).is_file():
            proc = run_cmd(["cmake", "-S", str(ROOT), "-B", str(build_dir), *gen, *cmake_args], logs / "build.log", env)
            if proc.returncode != 0:
                raise CheckError(f"cmake configure failed:\n{tail(logs / 'build.log')}")
        else:
            log(f"{build_dir} already configured (warm machine)")
    return boot


def build(args, boot: Bootstrap, stage) -> None:
    logs = boot.work / "logs"
    env = {**os.environ, "EPIKV_CACHE_DIR": str(boot.cache_dir)}
    build_dir = Path(boot.build["build_dir"])
    with stage("build"):
        t0 = time.perf_counter()
        proc = run_cmd(["cmake", "--build", build_dir.as_posix(), "--target", *boot.build["targets"], "-j",
                        str(boot.build["jobs"])], logs / "build.log", env)
        boot.build["build_seconds"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0:
            raise CheckError(f"the build failed:\n{tail(logs / 'build.log', 40)}")
        if boot.lib_dir.exists():
            shutil.rmtree(boot.lib_dir)
        boot.lib_dir.mkdir(parents=True)
        libs = [p for p in build_dir.rglob("lib*.so*") if "CMakeFiles" not in p.parts and p.is_file()]
        for p in libs:
            shutil.copy2(p, boot.lib_dir / p.name)
        names = sorted(p.name for p in boot.lib_dir.iterdir())
        boot.build["libraries"] = {n: (boot.lib_dir / n).stat().st_size for n in names if n.endswith(".so")}
        if "libllama.so" not in names or "libepikv_capture.so" not in names:
            raise CheckError(f"the build produced no libllama.so / libepikv_capture.so (found {names})")
        if args.cuda and "libggml-cuda.so" not in names:
            raise CheckError("the build produced no libggml-cuda.so")
        log(f"built in {boot.build['build_seconds']} s: {', '.join(boot.build['libraries'])}")


# ==========================================================================================================
# models
# ==========================================================================================================
def model_cmd(shape: Shape, out: Path, vocab: Path | None, ftype: str, context_length: int) -> list[str]:
    cmd = [sys.executable, str(SCRIPTS / "make_random_model.py"), "--out", str(out), "--layers", str(shape.layers),
           "--embd", str(shape.embd), "--n-head", str(shape.n_head), "--n-head-kv", str(shape.n_head_kv),
           "--n-ff", str(shape.n_ff), "--ftype", ftype, "--no-check", "--context-length", str(context_length)]
    if vocab is not None:
        cmd += ["--vocab-from", str(vocab)]
    return cmd


def child_env(boot: Bootstrap | None, lib_dir: Path | None) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(d) for d in boot.site_dirs] if boot else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if lib_dir is not None:
        env["EPIKV_LIB_DIR"] = str(lib_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def make_model(shape: Shape, out: Path, vocab: Path | None, context_length: int, env: dict, log_path: Path,
               timeout: float | None = None) -> dict:
    """make_random_model.py in one go (F16 then the quantizer); returns its description."""
    t0 = time.perf_counter()
    if not out.is_file():
        proc = run_cmd(model_cmd(shape, out, vocab, shape.ftype, context_length), log_path, env, timeout)
        if proc.returncode != 0 or not out.is_file():
            raise CheckError(f"make_random_model.py failed:\n{tail(log_path, 10)}")
    return {"path": str(out), "shape": asdict(shape), "vocab_from": str(vocab) if vocab else "default model",
            "bytes": out.stat().st_size, "seconds": round(time.perf_counter() - t0, 1)}


def quantize(src: Path, dst: Path, ftype: str, threads: int | None) -> None:
    import make_random_model as mrm

    mrm.quantize(src, dst, ftype, threads)


# ==========================================================================================================
# native checks
# ==========================================================================================================
def check_tokens(model, n: int) -> list[int]:
    toks = model.tokenize(TEXT)
    while len(toks) < n:
        toks = toks + model.tokenize(TEXT, add_special=False)
    return toks[:n]


def greedy_decode(session, n: int, keep_logits: bool = False):
    import numpy as np

    logits = []
    toks = []
    for _ in range(n):
        row = session.logits()
        if keep_logits:
            logits.append(row.copy())
        tok = int(np.argmax(row))
        toks.append(tok)
        session.decode_chunk([tok])
    return toks, logits


def capture_rows(model, layers, toks, n_batch: int) -> dict[int, "np.ndarray"]:
    import numpy as np

    from epikv_local.engine.handles import Context

    rows: dict[int, list] = {il: [] for il in layers}
    with Context(model, n_ctx=256, n_batch=n_batch) as ctx:
        for il in layers:
            ctx.set_layer_out(il, True)
        for i in range(0, len(toks), n_batch):
            part = toks[i:i + n_batch]
            ctx.decode(part, np.arange(i, i + len(part)))
            for il in layers:
                rows[il].append(ctx.layer_out(il, len(part)).copy())
    return {il: np.vstack(r) for il, r in rows.items()}


def native_checks(path: Path, on_gpu: bool) -> dict:
    """The four native checks on one model; every entry has ``passed``."""
    import numpy as np

    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.capture import MODE_PROBE, CallbackHandle, flash_attn_active
    from epikv_local.engine.handles import Context, Model
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy
    from epikv_local.policies.scoring import diff_norms

    out: dict = {}
    with Model(path, n_gpu_layers=-1 if on_gpu else 0) as model:
        info = model.info
        layers = tuple(make_policy("epikv").bind(info.shape).layers)
        toks = check_tokens(model, 48)

        # 1. capture from GPU-resident layers vs the CPU (decodes of 16 tokens: below ggml's 32-token threshold
        #    for offloading a CPU model's matrix products to the GPU, so the CPU model really runs on the CPU)
        t0 = time.perf_counter()
        try:
            with Model(path, n_gpu_layers=0, native=model.nat) as cpu_model:
                h_cpu = capture_rows(cpu_model, layers, toks, 16)
            h_dev = capture_rows(model, layers, toks, 16)
            per_layer = {}
            worst_h = worst_g = 0.0
            for il in layers:
                a, b = h_dev[il].astype(np.float64), h_cpu[il].astype(np.float64)
                rel_h = float(np.max(np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)))
                ga, gb = diff_norms(a, None)[1:], diff_norms(b, None)[1:]
                rel_g = float(np.max(np.abs(ga - gb) / np.maximum(np.abs(gb), 1e-30)))
                pearson = float(np.corrcoef(ga, gb)[0, 1]) if len(ga) > 2 and np.std(gb) > 0 else None
                per_layer[str(il)] = {"max_rel_err_hidden": rel_h, "max_rel_err_g": rel_g, "g_pearson": pearson,
                                      "rows": int(a.shape[0])}
                worst_h, worst_g = max(worst_h, rel_h), max(worst_g, rel_g)
            out["capture_gpu_vs_cpu"] = {
                "passed": bool(worst_h <= CAPTURE_RTOL and worst_g <= CAPTURE_RTOL),
                "tolerance": {"max_rel_err_hidden": CAPTURE_RTOL, "max_rel_err_g": CAPTURE_RTOL},
                "layers": list(layers), "tokens": len(toks), "n_batch": 16, "gpu_offload": on_gpu,
                "per_layer": per_layer, "max_rel_err_hidden": worst_h, "max_rel_err_g": worst_g,
                "note": ("model with every layer on the GPU vs the same file with n_gpu_layers=0" if on_gpu else
                         "CPU build: both runs are on the CPU, so this only checks the plumbing"),
                "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 -- recorded, the other checks still run
            out["capture_gpu_vs_cpu"] = {"passed": False, "error": f"{type(e).__name__}: {e}"}

        # 2. FLASH_ATTN_EXT in the decode graph (flash attention requested), no soft_max
        try:
            with CallbackHandle(model.nat, (), info.n_embd, 64, MODE_PROBE) as h:
                with Context(model, n_ctx=256, n_batch=64, flash_attn=True, cb_eval=h.cb_eval,
                             cb_eval_user_data=h.user_data) as ctx:
                    ctx.decode(toks[:8], np.arange(8))
                    ctx.decode(toks[8:9], [8])
                    nodes = h.probe_nodes()
            n_fa = sum(1 for _, op in nodes if op == "FLASH_ATTN_EXT")
            n_soft = sum(1 for name, _ in nodes if name.startswith("kq_soft_max"))
            out["flash_attn_graph"] = {"passed": bool(flash_attn_active(nodes) and n_fa > 0), "flash_attn_ext_nodes": n_fa,
                                       "kq_soft_max_nodes": n_soft, "n_layer": info.n_layer, "graph_nodes": len(nodes)}
        except Exception as e:  # noqa: BLE001
            out["flash_attn_graph"] = {"passed": False, "error": f"{type(e).__name__}: {e}"}

        # 3. the budget is held: engine bookkeeping and llama.cpp's cells agree, never above the budget
        budget = 64
        try:
            cfg = SessionConfig(n_batch=16)
            with Session(model, make_policy("epikv"), BudgetConfig(kv_budget=budget, protect_prompt=False), cfg) as s:
                s.feed(toks[:40])
                max_cells = 0
                agree = True
                for _ in range(10):
                    greedy_decode(s, 20)
                    cells = s.ctx.cell_positions()
                    cells = np.sort(cells[cells >= 0])
                    max_cells = max(max_cells, len(cells))
                    agree = agree and np.array_equal(cells, s.live_positions())
                st = s.stats()
            out["budget_held"] = {
                "passed": bool(st.max_live <= budget and max_cells <= budget and agree and st.n_evicted > 0
                               and st.flash_attn),
                "kv_budget": budget, "tokens": st.n_past, "max_live": st.max_live, "max_cells_in_cache": max_cells,
                "engine_and_cache_agree": bool(agree), "n_evicted": st.n_evicted, "n_rounds": st.n_rounds,
                "flash_attn": st.flash_attn}
        except Exception as e:  # noqa: BLE001
            out["budget_held"] = {"passed": False, "error": f"{type(e).__name__}: {e}"}

        # 4. budget >= sequence: EPIKV's logits are bit-identical to no eviction (same n_ctx)
        try:
            n_ctx, n_new = 256, 64
            runs = {}
            for pol in ("none", "epikv"):
                cfg = SessionConfig(n_batch=16, n_ctx=n_ctx)
                with Session(model, make_policy(pol), BudgetConfig(kv_budget=n_ctx, protect_prompt=False), cfg) as s:
                    s.feed(toks[:40])
                    gen, logits = greedy_decode(s, n_new, keep_logits=True)
                    runs[pol] = (gen, np.stack(logits), s.stats())
            same = bool(np.array_equal(runs["none"][1], runs["epikv"][1]))
            out["bit_identical_no_eviction"] = {
                "passed": bool(same and runs["epikv"][2].n_evicted == 0 and runs["none"][0] == runs["epikv"][0]),
                "steps": n_new, "n_ctx": n_ctx, "logits_bit_identical": same,
                "max_abs_diff": float(np.max(np.abs(runs["none"][1] - runs["epikv"][1]))),
                "tokens_identical": runs["none"][0] == runs["epikv"][0], "epikv_evicted": runs["epikv"][2].n_evicted}
        except Exception as e:  # noqa: BLE001
            out["bit_identical_no_eviction"] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        out["model"] = {"path": str(path), "desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd,
                        "n_head": info.n_head, "n_head_kv": info.n_head_kv, "n_vocab": info.n_vocab}
    return out


def native_pytest(check_model: Path, boot: Bootstrap, lib_dir: Path, timeout: float, log_path: Path) -> dict:
    """tests/test_native.py on the check model (placed where the suite looks for its default model)."""
    from epikv_local.api.models import MEMBER

    cache = boot.work / "pytest-cache"
    target = cache / "models" / Path(MEMBER).name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        os.symlink(check_model, target)
    env = child_env(boot, lib_dir)
    env["EPIKV_CACHE_DIR"] = str(cache)
    t0 = time.perf_counter()
    try:
        proc = run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_native.py"],
                       log_path, env, timeout, cwd=ROOT)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    summary = [ln for ln in tail(log_path, 40).splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    return {"ran": True, "returncode": rc, "passed": rc == 0, "summary": summary[-1] if summary else None,
            "timed_out": rc is None, "seconds": round(time.perf_counter() - t0, 1),
            "model": "random weights in the default model's place (SmolLM2-135M shape, Llama-3 vocab)"}


# ==========================================================================================================
# measurements
# ==========================================================================================================
def checkpoints(contexts: list[int], max_context: int) -> list[int]:
    """The contexts, then doubling lengths up to max_context (the longest-context search)."""
    pts = sorted(set(contexts))
    c = pts[-1]
    while c * 2 <= max_context:
        c *= 2
        pts.append(c)
    if pts[-1] < max_context:
        pts.append(max_context)
    return pts


def memory_now(on_gpu: bool) -> dict:
    return {"vram_used_mib": gpu_used_mib() if on_gpu else None, "rss_mib": rss_mib()}


def measure_decode(session, n: int, on_gpu: bool) -> dict:
    import numpy as np

    st0 = session.stats()
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(session.logits()))
        session.decode_chunk([tok])
    session.logits()  # waits for the last decode
    dt = time.perf_counter() - t0
    st1 = session.stats()
    rounds = st1.n_rounds - st0.n_rounds
    ev = st1.evict_seconds - st0.evict_seconds
    cells = session.ctx.cell_positions()
    return {"context": st0.n_past, "decode_tokens": n, "decode_seconds": round(dt, 4),
            "decode_tokens_per_s": n / dt if dt > 0 else None, "eviction_rounds": rounds,
            "mean_eviction_round_ms": 1000 * ev / rounds if rounds else None, "live_cells": st1.n_live,
            "cells_in_cache": int((cells >= 0).sum()), "max_live": st1.max_live, "kv_bytes": st1.kv_bytes,
            **memory_now(on_gpu)}


def run_variant(model, name: str, p: Preset, stop_at: float, on_gpu: bool, seed: int = 0, progress=None) -> dict:
    """One growing sequence under one variant: checkpoints (decode speed) until a stop; see the module doc."""
    import numpy as np

    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    policy, fa = VARIANTS[name]
    evicts = policy != "none"
    pts = checkpoints(p.contexts, p.max_context)
    n_ctx = p.budget + p.n_batch if evicts else p.max_context + p.decode_tokens * (len(pts) + 1) + p.n_batch
    rec: dict = {"variant": name, "policy": policy, "flash_attn_requested": fa, "kv_budget": p.budget if evicts else None,
                 "n_ctx_requested": n_ctx, "checkpoints": [], "error": None}
    t_start = time.perf_counter()
    try:
        session = Session(model, make_policy(policy),
                          BudgetConfig(kv_budget=p.budget if evicts else n_ctx, protect_prompt=False),
                          SessionConfig(n_batch=p.n_batch, flash_attn=fa, verify_flash_attn=True, n_ctx=n_ctx))
    except EpikvError as e:
        rec["error"] = f"session: {e}"
        rec["longest_context"] = {"tokens": 0, "stop_reason": "allocation_failed"}
        return rec
    vocab = model.info.n_vocab
    lo, hi = min(1000, vocab // 4), max(min(vocab - 1000, 100000), min(1000, vocab // 4) + 1)
    rng = np.random.default_rng(seed)
    prefill_s = 0.0
    prefill_tokens = 0
    reason = "max_context"
    with session as s:
        try:
            for target in pts:
                while s.n_past < target:
                    if time.time() >= stop_at:
                        reason = "time_cap"
                        break
                    n = min(p.n_batch, target - s.n_past)
                    if not evicts and s.n_past + n + p.decode_tokens > s.ctx.n_ctx:
                        reason = "cache_full"
                        break
                    t0 = time.perf_counter()
                    s.feed(rng.integers(lo, hi, size=n).tolist())
                    prefill_s += time.perf_counter() - t0
                    prefill_tokens += n
                if s.n_past < target:
                    break
                cp = measure_decode(s, p.decode_tokens, on_gpu)
                cp["phase"] = "context" if target in p.contexts else "search"
                cp["elapsed_s"] = round(time.perf_counter() - t_start, 2)
                rec["checkpoints"].append(cp)
                if progress:
                    progress(name, cp)
            last = rec["checkpoints"][-1]["context"] if rec["checkpoints"] else -1
            if reason != "max_context" and s.n_past > last + p.decode_tokens and time.time() < stop_at + 30:
                cp = measure_decode(s, p.decode_tokens, on_gpu)  # the speed where the sequence stopped
                cp["phase"] = "stop"
                cp["elapsed_s"] = round(time.perf_counter() - t_start, 2)
                rec["checkpoints"].append(cp)
        except EpikvError as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            reason = "error"
        st = s.stats()
        rec.update({
            "n_ctx": st.n_ctx, "kv_bytes": st.kv_bytes, "kv_bytes_per_cell": st.kv_bytes / st.n_ctx,
            "flash_attn_ran": s.flash_attn, "capture_layers": list(s.layers),
            "max_live": st.max_live, "n_evicted": st.n_evicted, "eviction_rounds": st.n_rounds,
            "mean_eviction_round_ms": 1000 * st.evict_seconds / st.n_rounds if st.n_rounds else None,
            "budget_respected": bool(st.max_live <= (p.budget if evicts else st.n_ctx)),
            "prefill_tokens": prefill_tokens, "prefill_seconds": round(prefill_s, 3),
            "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
            "longest_context": {"tokens": st.n_past, "stop_reason": reason,
                                "seconds": round(time.perf_counter() - t_start, 2)},
        })
    return rec


def context_table(variants: dict, p: Preset) -> dict:
    table = {}
    for c in p.contexts:
        row = {}
        for name in VARIANTS:
            v = variants.get(name)
            cp = next((x for x in (v or {}).get("checkpoints", []) if x["context"] == c), None)
            if cp is None:
                why = "not run" if v is None else (v.get("error") or v.get("longest_context", {}).get("stop_reason"))
                row[name] = {"reached": False, "why": why}
                continue
            row[name] = {"reached": True, "decode_tokens_per_s": cp["decode_tokens_per_s"],
                         "mean_eviction_round_ms": cp["mean_eviction_round_ms"]
                         if cp["mean_eviction_round_ms"] is not None else v.get("mean_eviction_round_ms"),
                         "live_cells": cp["live_cells"], "max_live": cp["max_live"], "kv_bytes": cp["kv_bytes"],
                         "vram_used_mib": cp["vram_used_mib"], "rss_mib": cp["rss_mib"],
                         "flash_attn_ran": v.get("flash_attn_ran"), "kv_budget": v.get("kv_budget")}
        table[str(c)] = row
    return table


def longest_summary(variants: dict, on_gpu: bool, baseline: dict) -> dict:
    out = {}
    for name, v in variants.items():
        lc = dict(v.get("longest_context", {}))
        lc["variant_cap_s"] = v.get("cap_s")
        if VARIANTS[name][0] == "none" and v.get("kv_bytes_per_cell"):
            # computed, not measured: how many cells of this model's KV cache the memory left would hold
            last = (v.get("checkpoints") or [{}])[-1]
            if on_gpu and baseline.get("gpu") and last.get("vram_used_mib") is not None:
                other = last["vram_used_mib"] - v["kv_bytes"] / 2**20  # model + compute buffers
                free = baseline["gpu"]["memory_total_mib"] - other
                lc["computed_max_context_by_memory"] = int(free * 2**20 / v["kv_bytes_per_cell"])
                lc["computed_from"] = "GPU memory total - (used at the last checkpoint - this KV cache), / KV bytes per cell"
            elif not on_gpu and mem_available_mib():
                lc["computed_max_context_by_memory"] = int(mem_available_mib() * 2**20 / v["kv_bytes_per_cell"])
                lc["computed_from"] = "host MemAvailable / KV bytes per cell"
        elif v.get("kv_budget"):
            lc["kv_memory"] = f"fixed at the budget: {v['kv_budget']} cells ({mib(v.get('kv_bytes', 0))} MiB)"
        out[name] = lc
    return out


# ==========================================================================================================
# the run
# ==========================================================================================================
def preset_from_args(args) -> Preset:
    p = PRESETS[args.mode]
    p = Preset(**{**asdict(p), "bench": Shape(**asdict(p.bench)), "check": Shape(**asdict(p.check)) if p.check else None})
    if args.contexts:
        p.contexts = [int(x) for x in args.contexts.split(",") if x]
    for k in ("budget", "decode_tokens", "max_context"):
        if getattr(args, k) is not None:
            setattr(p, k, getattr(args, k))
    if args.batch is not None:
        p.n_batch = args.batch
    if args.variant_cap_s is not None:
        p.variant_cap_s = args.variant_cap_s
    if args.deadline_s is not None:
        p.deadline_s = args.deadline_s
    if args.ftype:
        p.bench.ftype = args.ftype
    if args.no_native_pytest:
        p.pytest_native = False
    if not p.contexts or min(p.contexts) <= p.budget:
        raise CheckError(f"every context must exceed the budget {p.budget}: {p.contexts}")
    if p.budget <= p.n_batch or p.decode_tokens < 1 or p.max_context < max(p.contexts):
        raise CheckError("need budget > batch, decode tokens >= 1 and max context >= the largest context")
    return p


def run(args) -> int:
    t_origin = float(os.environ.get("GPU_CHECK_T0") or time.time())
    p = preset_from_args(args)
    deadline = t_origin + p.deadline_s
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_json = out_dir / JSON_NAME
    from benchlib import git_rev, machine

    report: dict = {
        "schema": SCHEMA, "mode": args.mode, "status": "running",
        "command": "bash scripts/gpu_check.sh " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_origin)), "git": git_rev(),
        "machine": {**machine(), "gpu": None}, "versions": {}, "stages": {}, "settings": asdict(p),
        "native_checks": {}, "variants": {}, "contexts": {}, "longest_context": {}, "errors": [], "notes": [],
    }
    failed = False

    def save():
        report["wall_seconds"] = round(time.time() - t_origin, 1)
        write_json(out_json, report)

    class stage:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            self.t0 = time.perf_counter()
            log(f"{self.name} ...")

        def __exit__(self, et, e, tb):
            report["stages"][self.name] = round(time.perf_counter() - self.t0, 2)
            log(f"{self.name}: {report['stages'][self.name]} s" + (f" -- FAILED: {e}" if e else ""))
            save()
            return False

    on_gpu = args.mode == "gpu" and args.cuda
    boot = None
    lib_dir = Path(args.lib_dir).resolve() if args.lib_dir else None
    bg = None
    try:
        if args.mode == "gpu":
            if args.cuda:
                gi = gpu_info()
                if gi is None:
                    raise CheckError("gpu mode found no NVIDIA GPU (nvidia-smi missing or failing): it never produces "
                                     "GPU figures without one; use --mode cpu")
                report["machine"]["gpu"] = gi
            boot = bootstrap(args, report, stage)
            lib_dir = boot.lib_dir
            os.environ["EPIKV_CACHE_DIR"] = str(boot.cache_dir)
        if lib_dir is not None:
            os.environ["EPIKV_LIB_DIR"] = str(lib_dir)
        env = child_env(boot, lib_dir)

        models = (boot.work if boot else out_dir / "models_tmp") / "models"
        models.mkdir(parents=True, exist_ok=True)
        bench_path = Path(args.model).resolve() if args.model else models / (
            f"random-{p.bench.layers}L-{p.bench.embd}-{p.bench.ftype}.gguf")
        vocab = (Path(args.bundle).resolve() / VOCAB_NAME) if boot else (Path(args.vocab_from) if args.vocab_from else None)
        ctx_len = max(131072, p.max_context + 4096)
        f16_path = bench_path.with_name(bench_path.stem + "-f16.gguf")
        if boot and not bench_path.is_file():
            # the F16 file is pure numpy: written while the library builds; quantized after it
            f16_path.unlink(missing_ok=True)
            with open(boot.work / "logs" / "model_f16.log", "w") as bg_log:
                bg = subprocess.Popen(model_cmd(p.bench, f16_path, vocab, "f16", ctx_len), stdout=bg_log,
                                      stderr=subprocess.STDOUT, env=env)
            log(f"writing the {p.bench.layers}-layer F16 model in the background (pid {bg.pid})")
        if boot:
            build(args, boot, stage)
            if args.build_only:
                report["status"] = "build_only"
                report["notes"].append("--build-only: the bootstrap and build ran; nothing was measured")
                if bg:
                    bg.terminate()
                    bg.wait()
                    f16_path.unlink(missing_ok=True)
                return 0

        with stage("load_native"):
            from epikv_local.engine.native import load

            nat = load()
            ll = nat.llama
            report["versions"] = {
                "llama_cpp_python": getattr(ll, "__version__", None) or _pkg_version("llama-cpp-python"),
                "numpy": _pkg_version("numpy"), "cffi": _pkg_version("cffi"), "gguf": _pkg_version("gguf"),
                "lib_dir": str(nat.lib_dir), "system_info": ll.llama_print_system_info().decode(errors="replace").strip(),
                "gpu_offload": bool(ll.llama_supports_gpu_offload()),
                "llama_cpp_source": (boot.cache_dir / expected_llama_dir_name() / ".epikv-prepared").read_text().split()
                if boot else None}
            if args.mode == "gpu" and args.cuda and not report["versions"]["gpu_offload"]:
                raise CheckError("the built library does not support GPU offload (no CUDA backend loaded)")
            if args.mode == "cpu" and report["versions"]["gpu_offload"]:
                report["notes"].append("cpu mode on a GPU-capable library: the models are loaded with n_gpu_layers=0, "
                                       "but ggml may still offload large prefill batches to the GPU")

        # the native-check model
        with stage("check_model"):
            if p.check is None:
                check_path = bench_path
                report["check_model"] = make_model(p.bench, bench_path, vocab, ctx_len, env, (boot.work if boot else out_dir) / "model.log")
            else:
                check_path = models / f"check-{p.check.layers}L-{p.check.embd}-{p.check.ftype}.gguf"
                report["check_model"] = make_model(p.check, check_path, vocab, 8192, env, boot.work / "logs" / "model.log")
        with stage("native_checks"):
            report["native_checks"] = native_checks(check_path, on_gpu)
            for name, c in report["native_checks"].items():
                if isinstance(c, dict) and "passed" in c:
                    log(f"  {name}: {'PASS' if c['passed'] else 'FAIL'}"
                        + (f" ({c.get('error')})" if c.get("error") else ""))
                    failed = failed or not c["passed"]

        # the benchmark model
        with stage("bench_model"):
            if bg is not None:
                rc = bg.wait()
                bg = None
                if rc != 0 or not f16_path.is_file():
                    raise CheckError(f"writing the F16 model failed:\n{tail(boot.work / 'logs' / 'model_f16.log', 10)}")
                t0 = time.perf_counter()
                quantize(f16_path, bench_path, p.bench.ftype, os.cpu_count())
                f16_path.unlink(missing_ok=True)
                log(f"quantized to {p.bench.ftype} in {time.perf_counter() - t0:.1f} s")
            if not bench_path.is_file():
                report["bench_model"] = make_model(p.bench, bench_path, vocab, ctx_len, env,
                                                   (boot.work / "logs" if boot else out_dir) / "model.log")
            report["bench_model"] = {"path": str(bench_path), "shape": asdict(p.bench), "bytes": bench_path.stat().st_size,
                                     "vocab_from": str(vocab) if vocab else "default model (SmolLM2-135M tokenizer)"}

        with stage("measure"):
            from epikv_local.engine.handles import Model

            baseline = {"gpu": gpu_info() if on_gpu else None, "rss_mib": rss_mib()}
            with Model(bench_path, n_gpu_layers=-1 if on_gpu else 0) as model:
                info = model.info
                report["bench_model"].update({"desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd,
                                              "n_head": info.n_head, "n_head_kv": info.n_head_kv,
                                              "n_vocab": info.n_vocab})
                report["memory_after_model_load"] = memory_now(on_gpu)
                names = list(VARIANTS)
                reserve = 50.0 if (p.pytest_native and boot) else 5.0
                for i, name in enumerate(names):
                    left = deadline - reserve - time.time()
                    cap = min(p.variant_cap_s, left / (len(names) - i))
                    if cap < 1.0:
                        report["variants"][name] = {"variant": name, "error": "skipped: the run's deadline",
                                                    "checkpoints": [], "cap_s": round(cap, 1)}
                        report["errors"].append(f"{name}: skipped, deadline")
                        failed = True
                        continue
                    log(f"variant {name}: cap {cap:.1f} s")

                    def progress(v, cp):
                        log(f"  {v} @ {cp['context']}: {cp['decode_tokens_per_s']:.1f} tok/s, live {cp['live_cells']}"
                            + (f", VRAM {cp['vram_used_mib']:.0f} MiB" if cp['vram_used_mib'] is not None else ""))

                    rec = run_variant(model, name, p, time.time() + cap, on_gpu, progress=progress)
                    rec["cap_s"] = round(cap, 1)
                    report["variants"][name] = rec
                    if rec.get("error"):
                        report["errors"].append(f"{name}: {rec['error']}")
                        failed = True
                    lc = rec.get("longest_context", {})
                    log(f"  {name}: reached {lc.get('tokens')} tokens ({lc.get('stop_reason')}), "
                        f"FA ran {rec.get('flash_attn_ran')}, budget respected {rec.get('budget_respected')}")
                    report["contexts"] = context_table(report["variants"], p)
                    report["longest_context"] = longest_summary(report["variants"], on_gpu, baseline)
                    save()
            report["memory_baseline"] = baseline
            for name, row in report["contexts"].items():
                missing = [v for v, e in row.items() if not e["reached"]]
                if missing:
                    report["notes"].append(f"context {name}: not reached by {', '.join(missing)} within the caps")

        if p.pytest_native and boot:
            left = deadline - time.time() - 5
            if left >= 20:
                with stage("native_pytest"):
                    report["native_pytest"] = native_pytest(check_path, boot, lib_dir, left, boot.work / "logs" / "pytest.log")
                    log(f"  tests/test_native.py: {report['native_pytest']['summary']}")
                    failed = failed or not report["native_pytest"]["passed"]
            else:
                report["native_pytest"] = {"ran": False, "reason": f"only {left:.0f} s left before the deadline"}
        else:
            report["native_pytest"] = {"ran": False, "reason": "cpu mode: the test suite runs tests/test_native.py "
                                                               "directly" if args.mode == "cpu" else "disabled"}
    except EpikvError as e:
        report["status"] = "failed"
        report["errors"].append(str(e))
        save()
        raise
    except Exception as e:
        report["status"] = "failed"
        report["errors"].append(f"{type(e).__name__}: {e}")
        save()
        raise
    finally:
        if bg is not None and bg.poll() is None:
            bg.terminate()
    report["status"] = "checks_failed" if failed else "complete"
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if boot:
        for name in ("build.log", "model_f16.log", "pytest.log"):
            src = boot.work / "logs" / name
            if src.is_file():
                (out_dir / name).write_text("\n".join(src.read_text(errors="replace").splitlines()[-400:]) + "\n")
    elif args.model is None and not args.keep_model:
        shutil.rmtree(out_dir / "models_tmp", ignore_errors=True)
    save()
    print_summary(report)
    log(f"wrote {out_json} ({report['status']}, {report['wall_seconds']} s)")
    return 1 if failed else 0


def _pkg_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def print_summary(report: dict) -> None:
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    mem = "VRAM MiB" if report["mode"] == "gpu" else "RSS MiB"
    print(f"\n{report['mode'].upper()} mode -- decode tokens/s at each context (budget "
          f"{report['settings']['budget']}, {report['settings']['decode_tokens']} tokens per point)")
    print(f"{'context':>8} {'variant':10} {'tok/s':>9} {'ms/evict':>9} {'live':>7} {mem:>9}")
    for c, row in report["contexts"].items():
        for v, e in row.items():
            if not e["reached"]:
                print(f"{c:>8} {v:10} {'not reached: ' + str(e.get('why')):>30}")
                continue
            m = e["vram_used_mib"] if report["mode"] == "gpu" else e["rss_mib"]
            print(f"{c:>8} {v:10} {f(e['decode_tokens_per_s'], '9.1f')} {f(e['mean_eviction_round_ms'], '9.3f')} "
                  f"{e['live_cells']:7d} {f(m, '9.0f')}")
    print("longest context reached:")
    for v, lc in report["longest_context"].items():
        extra = (f", computed memory bound {lc['computed_max_context_by_memory']}"
                 if lc.get("computed_max_context_by_memory") else "")
        print(f"  {v:10} {lc.get('tokens')} tokens ({lc.get('stop_reason')}, cap {lc.get('variant_cap_s')} s){extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true", help="build the travel bundle (here, before a device run)")
    ap.add_argument("--mode", choices=("cpu", "gpu"), help="run the check: cpu (here, CI) or gpu (on the device)")
    ap.add_argument("--out", default=None, help="folder of gpu_check.json (default: $OUT, else build/gpu_check_out)")
    ap.add_argument("--bundle", default=str(BUNDLE), help="travel bundle folder (default: build/gpu_bundle)")
    ap.add_argument("--work", default=str(WORK), help="gpu mode: unpack/build/model folder (default: build/gpu_run)")
    ap.add_argument("--max-bundle-mib", type=float, default=60.0)
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (gpu 4096,16384,32768; cpu 256,512,1024)")
    ap.add_argument("--budget", type=int, default=None, help="KV budget of epikv/streaming/h2o (gpu 2048, cpu 128)")
    ap.add_argument("--batch", type=int, default=None, help="n_batch = ubatch of the prefill (gpu 512, cpu 32)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens per checkpoint (gpu 32, cpu 16)")
    ap.add_argument("--max-context", type=int, default=None, help="end of the longest-context search (gpu 262144)")
    ap.add_argument("--variant-cap-s", type=float, default=None, help="time cap per variant (gpu 40, cpu 4)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="whole run, from gpu_check.sh's start (gpu 480, cpu 240); stages shrink to fit")
    ap.add_argument("--ftype", choices=("q4_0", "q4_k_m", "q8_0", "f16"), default=None,
                    help="benchmark model quantization (default q4_k_m)")
    ap.add_argument("--model", default=None, help="use this GGUF as the benchmark model instead of making one")
    ap.add_argument("--vocab-from", default=None, help="cpu mode: tokenizer GGUF of the random model (default: SmolLM2)")
    ap.add_argument("--lib-dir", default=None, help="cpu mode: patched libraries to use (default: the installed ones)")
    ap.add_argument("--keep-model", action="store_true", help="cpu mode: keep the random model in --out")
    ap.add_argument("--jobs", type=int, default=None, help="gpu mode: build jobs (default: all cores)")
    ap.add_argument("--no-cuda", dest="cuda", action="store_false",
                    help="gpu mode without CUDA: tests the bootstrap and build on a CPU machine (with --build-only)")
    ap.add_argument("--build-only", action="store_true", help="gpu mode: stop after the build")
    ap.add_argument("--no-native-pytest", action="store_true", help="gpu mode: skip tests/test_native.py")
    args = ap.parse_args(argv)
    if args.prepare == bool(args.mode):
        ap.error("give exactly one of --prepare and --mode cpu|gpu")
    if args.prepare:
        return prepare(args)
    if args.mode == "gpu" and not args.cuda and not args.build_only:
        ap.error("--no-cuda only tests the bootstrap: add --build-only (no figures are made without a GPU)")
    if args.mode == "cpu" and (args.build_only or not args.cuda):
        ap.error("--build-only / --no-cuda belong to --mode gpu")
    if args.out is None:
        args.out = os.environ.get("OUT") or str(ROOT / "build" / "gpu_check_out")
    return run(args)


if __name__ == "__main__":
    sys.exit(run_main("gpu_check", main))
