#!/usr/bin/env python3
"""The prepared GPU check: native checks and a speed / memory / context comparison, in one JSON file.

Three uses (``scripts/gpu_check.sh`` picks the interpreter and keeps a log; docs/gpu.md says how to run them):

``--prepare`` (here, before a device run)
    Builds the travel bundle ``build/gpu_bundle/`` (ignored by git; the device tool carries it):
    ``llama.cpp.tar.gz`` (the patched llama.cpp tree of ``scripts/prepare_llama_cpp.py``, pruned to what a
    CUDA build of libllama + ggml-base/-cpu/-cuda/-rpc needs), ``vocab-llama-bpe.gguf`` (llama.cpp's
    vocab-only Llama-3 tokenizer: the random models get Llama-3's 128,256-token vocabulary), ``wheels/``
    (cffi and pycparser for CPython 3.12 manylinux x86-64), ``site/`` (the pure-Python packages llama_cpp --
    ctypes bindings only --, gguf and diskcache, copied from this environment) and ``manifest.json``.
    Fails when the bundle exceeds ``--max-bundle-mib`` or bundle + working tree exceed the tool's 64 MiB.

``--mode gpu`` (there, on the machine with the GPU)
    Unpacks the bundle into ``build/gpu_run/`` (kept on a warm machine: a rerun skips what is done),
    installs the wheels, builds the patched library and the capture shim with CUDA (sm_90, ninja, all
    cores, only the needed targets) while a background process writes the 8B-shaped F16 model, then runs
    the checks and measurements below on the GPU. Refuses to run without an NVIDIA GPU: it never produces
    GPU figures from anything else.

``--mode cpu`` (here and in CI)
    The same driver with small shapes on the CPU and the installed package (no rebuild): a 4-layer random
    model, contexts 256/512/1024. Same JSON schema, ``"mode": "cpu"``.

Both modes, on random-weight models made by ``scripts/make_random_model.py``:

* native checks: captured layer outputs (EPIKV's two layers) of the model with every layer on the GPU vs
  the same file on the CPU, within a stated tolerance; FLASH_ATTN_EXT nodes (and no soft_max) in the decode
  graph; an evicting session holds its budget (engine and llama.cpp's cells agree); EPIKV with a budget >=
  the sequence gives logits bit-identical to no eviction;
* per variant -- ``plain`` (no eviction, full cache), ``epikv`` and ``streaming`` (KV budget ``--budget``),
  ``h2o`` (flash attention off, attention read back) -- a growing sequence (random prompt tokens, prefilled
  in ``--batch`` chunks, eviction on) with a greedy decode of ``--decode-tokens`` tokens at each context of
  ``--contexts``: decode tokens/s, eviction rounds and their mean time, live cells, KV bytes, memory in use
  (GPU: ``nvidia-smi`` memory.used; CPU: process RSS). The sequence then keeps growing (checkpoints at
  doubling lengths up to ``--max-context``) until the variant's time cap, its cache (plain) or the run's
  deadline: the longest context each variant reaches, and why it stopped. Plain gets one session per context
  with a cache of exactly that size, then one sized for ``--max-context`` for the search;
* GPU mode, with the time left: ``tests/engine/test_native.py`` itself, on a SmolLM2-shaped random model.

Result: ``<out>/gpu_check.json`` (written after every stage, so a run cut short still leaves its results).
Exit status: 0 when every check passed and every stage ran; 1 when a check or a stage failed (the JSON says
which); 2 with one ``gpu_check: error: ...`` line for bad input or a missing prerequisite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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

from epikv_local.errors import EpikvError, run_main  # noqa: E402  (imports nothing else of the package)

SCHEMA = "epikv-gpu-check/1"
BUNDLE = ROOT / "build" / "gpu_bundle"
WORK = ROOT / "build" / "gpu_run"
JSON_NAME = "gpu_check.json"
DEVICE_TRAVEL_MIB = 64.0  # the device tool's limit on working tree + carried paths
VOCAB_FILE = "models/ggml-vocab-llama-bpe.gguf"  # in the llama.cpp tree: Llama-3's tokenizer, vocab only
VOCAB_NAME = "vocab-llama-bpe.gguf"
SITE_PACKAGES = {"llama_cpp": "llama-cpp-python", "gguf": "gguf", "diskcache": "diskcache"}  # pure Python
WHEELS = ("cffi", "pycparser")  # cffi has a compiled part: wheels for the device's CPython
DEVICE_PY = "3.12"
# the pruned llama.cpp tree: what CMake reads for libllama + ggml-base/-cpu/-cuda/-rpc and rpc-server.cpp
TREE_FILES = ("CMakeLists.txt", "LICENSE", ".epikv-prepared", "ggml/CMakeLists.txt")
TREE_DIRS = ("cmake", "include", "src", "licenses", "vendor", "ggml/cmake", "ggml/include", "tools/rpc")
TREE_DROP = ("vendor/cpp-httplib",)  # only built with LLAMA_BUILD_COMMON (forced off)
GGML_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")  # ggml/src/<backend> kept; every other backend dropped
# lean CUDA build: flash-attention vector kernels for the f16 KV cache only (tile/MMA kernels are built for every
# head size regardless), no fatbin compression, no NCCL (one GPU)
CUDA_ARGS = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_QUANTS=f16-f16",
             "-DGGML_CUDA_COMPRESSION_MODE=none", "-DGGML_CUDA_NCCL=OFF")
BUILD_TARGETS = ("llama", "epikv_capture")  # ggml, ggml-base and the backends (cpu, cuda, rpc) come with them
PYTEST_MAX_S = 120.0  # GPU mode: tests/engine/test_native.py runs while the 8B model is quantized, at most this long ...
MEASURE_RESERVE_S = 150.0  # ... and only if this much time is left for the measurements afterwards

VARIANTS = {  # name -> (registered policy, flash attention)
    "plain": ("none", True),
    "epikv": ("epikv", True),
    "streaming": ("streaming", True),
    "h2o": ("h2o", False),
}
TEXT = ("Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15 and x = 5. "
        "Check: 3 * 5 + 5 = 20. Therefore the answer is 5. Now consider the next problem carefully.")
# GPU-resident vs CPU capture. The two runs use different kernels (activation quantization of the matrix
# products, flash attention), so the captured rows differ by rounding: on the CPU alone, flash attention on vs
# off already moves layers 9/20 of a 30-layer model by up to 2.5-3.4 % (relative L2 per row) and g by up to
# 1-2 %. A broken capture (wrong rows, stale or zero buffers) is off by O(1).
CAPTURE_RTOL = 0.10  # max relative L2 error of a captured hidden-state row, and max relative error of g
CAPTURE_MIN_PEARSON = 0.99  # correlation of g over the tokens


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
    threads: int | None  # llama.cpp CPU threads; None: the package's default (engine.handles.resolve_threads)


PRESETS = {
    # Llama-3-8B: 32 layers, n_embd 4096, 32 heads / 8 KV heads (head_dim 128), n_ff 14336, vocab 128256
    # (tied embeddings: the output matrix is the embedding); the check model has SmolLM2-135M's shape
    "gpu": Preset(bench=Shape(32, 4096, 32, 8, 14336, "q4_k_m"), check=Shape(30, 576, 9, 3, 1536, "q4_0"),
                  contexts=[4096, 16384, 32768], budget=2048, n_batch=512, decode_tokens=32, max_context=262144,
                  variant_cap_s=40.0, deadline_s=480.0, pytest_native=True, threads=None),
    # one thread: ggml's spinning thread pool slows down badly when a 2-core machine is shared
    "cpu": Preset(bench=Shape(4, 256, 4, 2, 768, "q4_k_m"), check=None, contexts=[256, 512, 1024], budget=128,
                  n_batch=32, decode_tokens=16, max_context=4096, variant_cap_s=4.0, deadline_s=240.0,
                  pytest_native=False, threads=1),
}


class CheckError(EpikvError):
    """A prerequisite of the GPU check is missing (bundle, GPU, compiler) or one of its steps failed."""


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


def _json_default(x):
    import numpy as np

    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    tmp.replace(path)


def run_cmd(cmd: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command with its output appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout,
                              cwd=cwd, check=False)


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def pkg_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ==========================================================================================================
# --prepare: the travel bundle
# ==========================================================================================================
def prepared_llama_dir() -> Path:
    """The patched llama.cpp tree for the current patches (extracted and patched now if missing)."""
    import prepare_llama_cpp as plc

    if os.environ.get("EPIKV_LLAMA_SOURCE_DIR"):
        raise CheckError("--prepare bundles the pinned sdist's tree (the device finds it by the name that "
                         "patches/SOURCE gives); unset EPIKV_LLAMA_SOURCE_DIR")
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
            if not any(rel.as_posix().startswith(x + "/") for x in TREE_DROP):
                out.append(rel)

    for f in TREE_FILES:
        if not (src / f).is_file():
            raise CheckError(f"the llama.cpp tree {src} has no {f}")
        out.append(Path(f))
    for d in TREE_DIRS:
        if not (src / d).is_dir():
            raise CheckError(f"the llama.cpp tree {src} has no {d}/")
        walk(src / d)
    for p in sorted((src / "ggml" / "src").iterdir()):
        if p.is_file():
            out.append(p.relative_to(src))
        elif p.name in GGML_BACKENDS:
            walk(p)
    return out


def travelling_tree_bytes() -> int | None:
    """Bytes the device tool sends besides carried paths: tracked + untracked-not-ignored files."""
    try:
        proc = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                              check=False)
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


def download_wheels(dest: Path) -> list[Path]:
    """cffi + pycparser wheels for CPython 3.12 manylinux x86-64, the versions installed here (cached)."""
    from prepare_llama_cpp import cache_dir

    reqs = [f"{n}=={pkg_version(n)}" if pkg_version(n) else n for n in WHEELS]
    cache = cache_dir() / "gpu-wheels"
    cache.mkdir(parents=True, exist_ok=True)
    tags = ("cp312", "py3-none-any", "py2.py3-none-any")

    def cached() -> list[Path]:
        found = []
        for req in reqs:
            name, _, ver = req.partition("==")
            hits = sorted(p for p in cache.glob(f"{name}-{ver or '*'}-*.whl") if any(t in p.name for t in tags))
            if not hits:
                return []
            found.append(hits[-1])
        return found

    wheels = cached()
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               DEVICE_PY, "--implementation", "cp", "--platform", "manylinux2014_x86_64", "--platform",
               "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "-d", str(cache), *reqs]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = cached()
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise CheckError(f"pip could not download the device's wheels ({' '.join(reqs)}): {last[0]}")
    dest.mkdir(parents=True, exist_ok=True)
    for w in wheels:
        shutil.copy2(w, dest / w.name)
    return [dest / w.name for w in wheels]


def copy_site_packages(dest: Path) -> dict[str, str | None]:
    """Copy the pure-Python packages the device lacks from this environment; returns name -> version."""
    import importlib.util

    versions = {}
    for name, dist in SITE_PACKAGES.items():
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise CheckError(f"package {name} is not installed here (bash scripts/install.sh installs it)")
        src = Path(next(iter(spec.submodule_search_locations)))
        compiled = [p for p in src.rglob("*") if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name]
        if compiled:  # llama_cpp must be the bindings only: the library is the patched build's
            raise CheckError(f"{src} holds compiled files ({compiled[0].name}); the bundle takes pure Python only")
        shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        versions[name] = pkg_version(dist)
    return versions


def prepare(args) -> int:
    from benchlib import git_rev

    t0 = time.perf_counter()
    bundle = Path(args.bundle).resolve()
    limit = float(args.max_bundle_mib)
    llama = prepared_llama_dir()
    name = llama.name
    if name != expected_llama_dir_name():
        raise CheckError(f"prepared tree {name} is not the one the device will look for ({expected_llama_dir_name()})")
    if bundle.exists():
        shutil.rmtree(bundle)
    bundle.mkdir(parents=True)
    files = pruned_tree(llama)
    tar_path = bundle / "llama.cpp.tar.gz"
    with tarfile.open(tar_path, "w:gz", compresslevel=6) as tf:
        for rel in files:
            info = tf.gettarinfo(str(llama / rel), arcname=f"{name}/{rel.as_posix()}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(llama / rel, "rb") as f:
                tf.addfile(info, f)
    if not (llama / VOCAB_FILE).is_file():
        raise CheckError(f"{llama / VOCAB_FILE} is missing: the bundle needs llama.cpp's Llama-3 vocab GGUF")
    shutil.copy2(llama / VOCAB_FILE, bundle / VOCAB_NAME)
    wheels = download_wheels(bundle / "wheels")
    versions = copy_site_packages(bundle / "site")
    parts = {"llama.cpp.tar.gz": tar_path.stat().st_size, VOCAB_NAME: (bundle / VOCAB_NAME).stat().st_size,
             "wheels": dir_bytes(bundle / "wheels"), "site": dir_bytes(bundle / "site")}
    tree = travelling_tree_bytes()
    manifest = {
        "schema": "epikv-gpu-bundle/1", "created": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git_rev(),
        "llama_dir": name, "llama_source": (llama / ".epikv-prepared").read_text().split(),
        "tree_files": len(files), "tree_bytes_uncompressed": sum((llama / f).stat().st_size for f in files),
        "ggml_backends": list(GGML_BACKENDS), "tar_sha256": sha256(tar_path),
        "vocab": {"file": VOCAB_NAME, "from": VOCAB_FILE, "sha256": sha256(bundle / VOCAB_NAME)},
        "wheels": [w.name for w in wheels], "site_packages": versions, "device_python": DEVICE_PY,
        "bytes": parts, "working_tree_bytes": tree,
    }
    write_json(bundle / "manifest.json", manifest)
    total = dir_bytes(bundle)
    print(f"bundle: {bundle}")
    for k, v in parts.items():
        print(f"  {k:22} {mib(v):8.2f} MiB")
    print(f"  {'total':22} {mib(total):8.2f} MiB  (limit {limit:g} MiB; the pruned llama.cpp tree has {len(files)} "
          f"files, {mib(manifest['tree_bytes_uncompressed']):.1f} MiB before compression)")
    if tree is not None:
        print(f"  the working tree travels with it: {mib(tree):.2f} MiB; together {mib(total + tree):.2f} MiB of the "
              f"device tool's {DEVICE_TRAVEL_MIB:g} MiB")
    print(f"  built in {time.perf_counter() - t0:.1f} s")
    if mib(total) > limit:
        raise CheckError(f"the bundle is {mib(total):.1f} MiB, over the {limit:g} MiB limit")
    if tree is not None and mib(total + tree) > DEVICE_TRAVEL_MIB:
        raise CheckError(f"bundle + working tree = {mib(total + tree):.1f} MiB, over the device tool's "
                         f"{DEVICE_TRAVEL_MIB:g} MiB")
    print(f"BUNDLE_MIB={mib(total):.2f}")
    return 0


# ==========================================================================================================
# machine facts
# ==========================================================================================================
def gpu_info() -> dict | None:
    """name / memory / driver of GPU 0 from nvidia-smi, or None when there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=name,memory.total,memory.used,driver_version",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=False)
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


def proc_kib(path: str, key: str) -> float | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_now(on_gpu: bool) -> dict:
    gi = gpu_info() if on_gpu else None
    return {"vram_used_mib": gi["memory_used_mib"] if gi else None, "rss_mib": proc_kib("/proc/self/status", "VmRSS")}


def first_line(cmd: list[str]) -> str | None:
    """First line of a tool's version output (None when it is missing)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in (proc.stdout or proc.stderr).splitlines() if ln.strip()]
    return lines[0].strip() if lines else None


def backend_devices(lib_dir: Path) -> list[dict]:
    """ggml's registered devices (name, description, type, memory) from the loaded libggml."""
    import ctypes

    path = lib_dir / "libggml.so"
    if not path.is_file():
        return []
    g = ctypes.CDLL(str(path))  # already loaded by libllama: the same handle
    g.ggml_backend_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_dev_get.restype = ctypes.c_void_p
    g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in (g.ggml_backend_dev_name, g.ggml_backend_dev_description):
        fn.restype = ctypes.c_char_p
        fn.argtypes = [ctypes.c_void_p]
    g.ggml_backend_dev_type.restype = ctypes.c_int
    g.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    g.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(ctypes.c_size_t)]
    kinds = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": (g.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                    "description": (g.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                    "type": kinds.get(g.ggml_backend_dev_type(dev), "unknown"),
                    "memory_free_mib": mib(free.value), "memory_total_mib": mib(total.value)})
    return out


def find_nvcc() -> str | None:
    exe = shutil.which("nvcc")
    if exe:
        return exe
    for cand in ("/usr/local/cuda/bin/nvcc", *sorted(str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc"))):
        if Path(cand).is_file():
            return cand
    return None


# ==========================================================================================================
# --mode gpu: bootstrap and build
# ==========================================================================================================
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


def bootstrap(args, run: "Run") -> Bootstrap:
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


def build(args, boot: Bootstrap, run: "Run") -> None:
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


# ==========================================================================================================
# models
# ==========================================================================================================
def model_cmd(shape: Shape, out: Path, vocab: Path | None, ftype: str, context_length: int) -> list[str]:
    cmd = [sys.executable, str(SCRIPTS / "make_random_model.py"), "--out", str(out), "--layers", str(shape.layers),
           "--embd", str(shape.embd), "--n-head", str(shape.n_head), "--n-head-kv", str(shape.n_head_kv),
           "--n-ff", str(shape.n_ff), "--ftype", ftype, "--no-check", "--context-length", str(context_length)]
    return cmd + (["--vocab-from", str(vocab)] if vocab is not None else [])


def child_env(boot: Bootstrap | None, lib_dir: Path | None) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT), str(SCRIPTS)] + ([str(d) for d in boot.site_dirs] if boot else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if lib_dir is not None:
        env["EPIKV_LIB_DIR"] = str(lib_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ==========================================================================================================
# native checks
# ==========================================================================================================
def check_tokens(model, n: int) -> list[int]:
    toks = model.tokenize(TEXT)
    while len(toks) < n:
        toks = toks + model.tokenize(TEXT, add_special=False)
    return toks[:n]


def greedy_decode(session, n: int, keep_logits: bool = False) -> tuple[list[int], list]:
    import numpy as np

    toks, logits = [], []
    for _ in range(n):
        row = session.logits()
        if keep_logits:
            logits.append(row.copy())
        toks.append(int(np.argmax(row)))
        session.decode_chunk([toks[-1]])
    return toks, logits


def capture_rows(model, layers, toks, n_batch: int, threads: int | None) -> dict:
    """layer -> (T, n_embd) captured outputs of the tokens, decoded n_batch at a time."""
    import numpy as np

    from epikv_local.engine.handles import Context

    rows: dict[int, list] = {il: [] for il in layers}
    with Context(model, n_ctx=256, n_batch=n_batch, n_threads=threads) as ctx:
        for il in layers:
            ctx.set_layer_out(il, True)
        for i in range(0, len(toks), n_batch):
            part = toks[i:i + n_batch]
            ctx.decode(part, np.arange(i, i + len(part)))
            for il in layers:
                rows[il].append(ctx.layer_out(il, len(part)).copy())
    return {il: np.vstack(r).astype(np.float64) for il, r in rows.items()}


def _failed(e: BaseException) -> dict:
    return {"passed": False, "error": f"{type(e).__name__}: {e}"}


def native_checks(path: Path, on_gpu: bool, threads: int | None) -> dict:
    """The four native checks on one model; each entry has ``passed``."""
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

        # 1. capture from GPU-resident layers vs the CPU. Decodes of 16 tokens: below ggml's 32-token threshold for
        #    running a CPU-resident model's matrix products on the GPU, so the CPU model really runs on the CPU.
        t0 = time.perf_counter()
        try:
            with Model(path, n_gpu_layers=0, native=model.nat) as cpu_model:
                h_cpu = capture_rows(cpu_model, layers, toks, 16, threads)
            h_dev = capture_rows(model, layers, toks, 16, threads)
            per_layer, worst_h, worst_g, worst_r = {}, 0.0, 0.0, 1.0
            for il in layers:
                a, b = h_dev[il], h_cpu[il]
                rel_h = float(np.max(np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)))
                ga, gb = diff_norms(a, None)[1:], diff_norms(b, None)[1:]
                rel_g = float(np.max(np.abs(ga - gb) / np.maximum(np.abs(gb), 1e-30)))
                if np.std(ga) > 0 and np.std(gb) > 0:
                    r = float(np.corrcoef(ga, gb)[0, 1])
                else:
                    r = float(np.array_equal(ga, gb))
                per_layer[str(il)] = {"max_rel_err_hidden": rel_h, "max_rel_err_g": rel_g, "g_pearson": r,
                                      "mean_rel_err_hidden": float(np.mean(np.linalg.norm(a - b, axis=1)
                                                                           / np.linalg.norm(b, axis=1)))}
                worst_h, worst_g, worst_r = max(worst_h, rel_h), max(worst_g, rel_g), min(worst_r, r)
            out["capture_gpu_vs_cpu"] = {
                "passed": bool(worst_h <= CAPTURE_RTOL and worst_g <= CAPTURE_RTOL and worst_r >= CAPTURE_MIN_PEARSON),
                "tolerance": {"max_rel_err_hidden": CAPTURE_RTOL, "max_rel_err_g": CAPTURE_RTOL,
                              "min_g_pearson": CAPTURE_MIN_PEARSON},
                "max_rel_err_hidden": worst_h, "max_rel_err_g": worst_g, "min_g_pearson": worst_r,
                "layers": list(layers), "tokens": len(toks), "n_batch": 16, "gpu_offload": on_gpu,
                "per_layer": per_layer,
                "compared": ("every layer on the GPU vs the same file with n_gpu_layers=0" if on_gpu else
                             "CPU mode: both runs are on the CPU (plumbing only, the errors must be 0)"),
                "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 -- recorded; the other checks still run
            out["capture_gpu_vs_cpu"] = _failed(e)

        # 2. flash attention requested: FLASH_ATTN_EXT nodes in the decode graph, no kq_soft_max
        try:
            with CallbackHandle(model.nat, (), info.n_embd, 64, MODE_PROBE) as h, \
                    Context(model, n_ctx=256, n_batch=64, flash_attn=True, cb_eval=h.cb_eval,
                            cb_eval_user_data=h.user_data, n_threads=threads) as ctx:
                ctx.decode(toks[:8], np.arange(8))
                ctx.decode(toks[8:9], [8])  # a one-token decode step
                nodes = h.probe_nodes()
            n_fa = sum(1 for _, op in nodes if op == "FLASH_ATTN_EXT")
            out["flash_attn_graph"] = {
                "passed": bool(flash_attn_active(nodes) and n_fa > 0), "flash_attn_ext_nodes": n_fa,
                "kq_soft_max_nodes": sum(1 for name, _ in nodes if name.startswith("kq_soft_max")),
                "n_layer": info.n_layer, "graph_nodes": len(nodes)}
        except Exception as e:  # noqa: BLE001
            out["flash_attn_graph"] = _failed(e)

        # 3. the budget is held: never more live cells than the budget, engine and llama.cpp's cells agree
        budget = 64
        try:
            with Session(model, make_policy("epikv"), BudgetConfig(kv_budget=budget, protect_prompt=False),
                         SessionConfig(n_batch=16, n_threads=threads)) as s:
                s.feed(toks[:40])
                max_cells, agree = 0, True
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
            out["budget_held"] = _failed(e)

        # 4. a budget >= the sequence: EPIKV (capture on, nothing evicted) gives logits bit-identical to no eviction
        try:
            n_ctx, n_new, runs = 256, 64, {}
            for pol in ("none", "epikv"):
                with Session(model, make_policy(pol), BudgetConfig(kv_budget=n_ctx, protect_prompt=False),
                             SessionConfig(n_batch=16, n_ctx=n_ctx, n_threads=threads)) as s:
                    s.feed(toks[:40])
                    gen, logits = greedy_decode(s, n_new, keep_logits=True)
                    runs[pol] = (gen, np.stack(logits), s.stats())
            same = bool(np.array_equal(runs["none"][1], runs["epikv"][1]))
            out["bit_identical_no_eviction"] = {
                "passed": bool(same and runs["epikv"][2].n_evicted == 0 and runs["none"][0] == runs["epikv"][0]),
                "steps": n_new, "prompt_tokens": 40, "n_ctx": n_ctx, "logits_bit_identical": same,
                "max_abs_diff": float(np.max(np.abs(runs["none"][1] - runs["epikv"][1]))),
                "tokens_identical": runs["none"][0] == runs["epikv"][0], "epikv_evicted": runs["epikv"][2].n_evicted}
        except Exception as e:  # noqa: BLE001
            out["bit_identical_no_eviction"] = _failed(e)
        out["model"] = {"path": str(path), "desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd,
                        "n_head": info.n_head, "n_head_kv": info.n_head_kv, "n_vocab": info.n_vocab}
    return out


def native_pytest(check_model: Path, boot: Bootstrap, timeout: float) -> dict:
    """tests/engine/test_native.py, with the check model where the suite looks for its default model."""
    from epikv_local.api.models import MEMBER

    cache = boot.work / "pytest-cache"
    target = cache / "models" / Path(MEMBER).name
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    os.symlink(check_model, target)
    env = child_env(boot, boot.lib_dir)
    env["EPIKV_CACHE_DIR"] = str(cache)
    log_path = boot.logs / "pytest.log"
    t0 = time.perf_counter()
    try:
        rc = run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_native.py"],
                     log_path, env, timeout, cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        rc = None
    summary = [ln for ln in tail(log_path, 40).splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    return {"ran": True, "passed": rc == 0, "returncode": rc, "timed_out": rc is None,
            "summary": summary[-1] if summary else None, "seconds": round(time.perf_counter() - t0, 1),
            "model": "random weights in the default model's place (SmolLM2-135M's shape, Llama-3 vocab)"}


# ==========================================================================================================
# measurements
# ==========================================================================================================
def checkpoints(contexts: list[int], max_context: int) -> list[int]:
    """The contexts, then doubling lengths up to max_context (the longest-context search)."""
    pts = sorted(set(contexts))
    while pts[-1] * 2 <= max_context:
        pts.append(pts[-1] * 2)
    if pts[-1] < max_context:
        pts.append(max_context)
    return pts


def measure_decode(session, n: int, on_gpu: bool) -> dict:
    """Greedy-decode n tokens (eviction on) and time them, up to the last decode's completion."""
    import numpy as np

    st0 = session.stats()
    t0 = time.perf_counter()
    for _ in range(n):
        session.decode_chunk([int(np.argmax(session.logits()))])
    session.logits()  # waits for the last decode
    dt = time.perf_counter() - t0
    st1 = session.stats()
    rounds = st1.n_rounds - st0.n_rounds
    evict_s = st1.evict_seconds - st0.evict_seconds
    cells = session.ctx.cell_positions()
    return {"context": st0.n_past, "decode_tokens": n, "decode_seconds": round(dt, 4),
            "decode_tokens_per_s": n / dt if dt > 0 else None, "eviction_rounds": rounds,
            "mean_eviction_round_ms": 1000 * evict_s / rounds if rounds else None, "live_cells": st1.n_live,
            "cells_in_cache": int((cells >= 0).sum()), "max_live": st1.max_live, "kv_bytes": st1.kv_bytes,
            **memory_now(on_gpu)}


def grow(model, p: Preset, name: str, n_ctx: int, targets: list[int], stop_at: float, on_gpu: bool,
         t_start: float, progress=None, seed: int = 0) -> dict:
    """One session, one growing sequence: prefill (random tokens, ``p.n_batch`` at a time) to each target and
    decode ``p.decode_tokens`` there; stop at the first of the time cap (``stop_at``, wall clock), a full cache
    (plain) or the last target. Returns its checkpoints, counters and why it stopped."""
    import numpy as np

    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    policy, fa = VARIANTS[name]
    evicts = policy != "none"
    out: dict = {"n_ctx_requested": n_ctx, "checkpoints": [], "error": None}
    try:
        session = Session(model, make_policy(policy),
                          BudgetConfig(kv_budget=p.budget if evicts else n_ctx, protect_prompt=False),
                          SessionConfig(n_batch=p.n_batch, flash_attn=fa, verify_flash_attn=True, n_ctx=n_ctx,
                                        n_threads=p.threads))
    except EpikvError as e:  # e.g. a plain cache that does not fit
        out.update(error=f"{type(e).__name__}: {e}", tokens=0, stop_reason="allocation_failed")
        return out
    vocab = model.info.n_vocab
    lo = min(1000, vocab // 4)  # random ordinary tokens, clear of the special tokens at either end
    hi = max(lo + 1, min(vocab - 1000, 100000))
    rng = np.random.default_rng(seed)
    prefill_s, prefill_tokens, reason = 0.0, 0, "max_context"
    with session as s:
        try:
            for target in targets:
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
                cp.update(phase="context" if target in p.contexts else "search",
                          elapsed_s=round(time.perf_counter() - t_start, 2))
                out["checkpoints"].append(cp)
                if progress:
                    progress(name, cp)
            last = out["checkpoints"][-1]["context"] if out["checkpoints"] else -1
            if reason != "max_context" and s.n_past > last + p.decode_tokens:
                cp = measure_decode(s, p.decode_tokens, on_gpu)  # the speed where the sequence stopped
                cp.update(phase="stop", elapsed_s=round(time.perf_counter() - t_start, 2))
                out["checkpoints"].append(cp)
        except EpikvError as e:
            out["error"] = f"{type(e).__name__}: {e}"
            reason = "error"
        st = s.stats()
        out.update(n_ctx=st.n_ctx, kv_bytes=st.kv_bytes, flash_attn_ran=s.flash_attn, capture_layers=list(s.layers),
                   max_live=st.max_live, n_evicted=st.n_evicted, eviction_rounds=st.n_rounds,
                   evict_seconds=st.evict_seconds, prefill_tokens=prefill_tokens, prefill_seconds=prefill_s,
                   tokens=st.n_past, stop_reason=reason)
    return out


def run_variant(model, name: str, p: Preset, stop_at: float, on_gpu: bool, progress=None) -> dict:
    """A variant's checkpoints and longest context.

    Evicting variants: one session (a cache of budget + one ubatch) whose sequence grows through every context,
    then through the search checkpoints. Plain: one session per context with a cache of exactly that context
    (+ the decoded tokens + one ubatch), so that its memory is what that context needs, then one session with
    a cache for ``max_context`` for the search (its sequence starts again from 0)."""
    policy, fa = VARIANTS[name]
    evicts = policy != "none"
    pts = checkpoints(p.contexts, p.max_context)
    t_start = time.perf_counter()
    if evicts:
        sessions = [grow(model, p, name, p.budget + p.n_batch, pts, stop_at, on_gpu, t_start, progress)]
    else:
        sessions = []
        for c in p.contexts:
            sessions.append(grow(model, p, name, c + p.decode_tokens + p.n_batch, [c], stop_at, on_gpu, t_start,
                                 progress))
            if sessions[-1]["stop_reason"] != "max_context":
                break
        else:
            search = [t for t in pts if t > max(p.contexts)]
            if search:
                n_ctx = p.max_context + p.decode_tokens * (len(search) + 1) + p.n_batch
                sessions.append(grow(model, p, name, n_ctx, search, stop_at, on_gpu, t_start, progress, seed=1))
    last = sessions[-1]
    done = [x for x in sessions if "n_ctx" in x]
    rounds = sum(x["eviction_rounds"] for x in done)
    prefill_s = sum(x["prefill_seconds"] for x in done)
    prefill_tokens = sum(x["prefill_tokens"] for x in done)
    errors = [x["error"] for x in sessions if x["error"]]
    rec = {
        "variant": name, "policy": policy, "flash_attn_requested": fa, "kv_budget": p.budget if evicts else None,
        "sessions": [{k: x.get(k) for k in ("n_ctx_requested", "n_ctx", "kv_bytes", "tokens", "stop_reason")}
                     for x in sessions],
        "checkpoints": [cp for x in sessions for cp in x["checkpoints"]],
        "error": "; ".join(errors) if errors else None,
        "n_ctx": max((x["n_ctx"] for x in done), default=None),
        "kv_bytes": max((x["kv_bytes"] for x in done), default=None),
        "kv_bytes_per_cell": done[0]["kv_bytes"] / done[0]["n_ctx"] if done else None,
        "flash_attn_ran": all(x["flash_attn_ran"] for x in done) if done else None,
        "capture_layers": done[0]["capture_layers"] if done else [],
        "max_live": max((x["max_live"] for x in done), default=0),
        "n_evicted": sum(x["n_evicted"] for x in done), "eviction_rounds": rounds,
        "mean_eviction_round_ms": 1000 * sum(x["evict_seconds"] for x in done) / rounds if rounds else None,
        "budget_respected": all(x["max_live"] <= (p.budget if evicts else x["n_ctx"]) for x in done),
        "prefill_tokens": prefill_tokens, "prefill_seconds": round(prefill_s, 3),
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
        "longest_context": {"tokens": max((x.get("tokens", 0) for x in sessions), default=0),
                            "stop_reason": last["stop_reason"], "seconds": round(time.perf_counter() - t_start, 2)},
    }
    return rec


def context_table(variants: dict, p: Preset) -> dict:
    """context -> variant -> the figures at that context (``reached`` false, with why, when it was not)."""
    table = {}
    for c in p.contexts:
        row = {}
        for name in VARIANTS:
            v = variants.get(name) or {}
            cp = next((x for x in v.get("checkpoints", []) if x["context"] == c), None)
            if cp is None:
                row[name] = {"reached": False, "why": "not run" if not v else
                             (v.get("error") or v.get("longest_context", {}).get("stop_reason"))}
                continue
            ms = cp["mean_eviction_round_ms"]
            row[name] = {"reached": True, "decode_tokens_per_s": cp["decode_tokens_per_s"],
                         "mean_eviction_round_ms": ms if ms is not None else v.get("mean_eviction_round_ms"),
                         "live_cells": cp["live_cells"], "max_live": cp["max_live"], "kv_bytes": cp["kv_bytes"],
                         "vram_used_mib": cp["vram_used_mib"], "rss_mib": cp["rss_mib"],
                         "flash_attn_requested": v.get("flash_attn_requested"),
                         "flash_attn_ran": v.get("flash_attn_ran"), "kv_budget": v.get("kv_budget")}
        table[str(c)] = row
    return table


def longest_summary(variants: dict, on_gpu: bool, gpu_total_mib: float | None) -> dict:
    out = {}
    for name, v in variants.items():
        lc = {**v.get("longest_context", {}), "variant_cap_s": v.get("cap_s")}
        last = (v.get("checkpoints") or [{}])[-1]
        if v.get("policy") == "none" and v.get("kv_bytes_per_cell"):
            # computed, not measured: the cells of this model's KV cache that the memory would hold
            if on_gpu and gpu_total_mib and last.get("vram_used_mib") is not None:
                other = last["vram_used_mib"] - v["kv_bytes"] / 2**20  # model, compute buffers, CUDA context
                lc["computed_max_context_by_memory"] = int((gpu_total_mib - other) * 2**20 / v["kv_bytes_per_cell"])
                lc["computed_from"] = "(GPU memory total - memory used besides this KV cache) / KV bytes per cell"
            elif not on_gpu and proc_kib("/proc/meminfo", "MemAvailable"):
                avail = proc_kib("/proc/meminfo", "MemAvailable")
                lc["computed_max_context_by_memory"] = int(avail * 2**20 / v["kv_bytes_per_cell"])
                lc["computed_from"] = "host MemAvailable / KV bytes per cell"
        elif v.get("kv_budget"):
            lc["kv_memory"] = f"fixed: {v['kv_budget']} live cells, {mib(v.get('kv_bytes', 0))} MiB allocated"
        out[name] = lc
    return out


# ==========================================================================================================
# the run
# ==========================================================================================================
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

    def stage(self, name: str):
        run = self

        class _Stage:
            def __enter__(self):
                self.t0 = time.perf_counter()
                log(f"{name} ...")

            def __exit__(self, et, e, tb):
                run.report["stages"][name] = round(time.perf_counter() - self.t0, 2)
                log(f"{name}: {run.report['stages'][name]} s" + (f" -- FAILED: {e}" if e else ""))
                run.save()
                return False

        return _Stage()


def preset_from_args(args) -> Preset:
    base = PRESETS[args.mode]
    p = Preset(**{**asdict(base), "bench": Shape(**asdict(base.bench)),
                  "check": Shape(**asdict(base.check)) if base.check else None})
    if args.contexts:
        p.contexts = sorted(int(x) for x in args.contexts.split(",") if x.strip())
    for k in ("budget", "decode_tokens", "max_context", "variant_cap_s", "deadline_s", "threads"):
        if getattr(args, k) is not None:
            setattr(p, k, getattr(args, k))
    if args.batch is not None:
        p.n_batch = args.batch
    if args.ftype:
        p.bench.ftype = args.ftype
    if args.no_native_pytest:
        p.pytest_native = False
    if not p.contexts or min(p.contexts) <= p.budget:
        raise CheckError(f"every context must exceed the budget {p.budget}: {p.contexts}")
    if p.budget <= p.n_batch or p.decode_tokens < 1 or p.max_context < max(p.contexts):
        raise CheckError("need --budget > --batch, --decode-tokens >= 1 and --max-context >= the largest context")
    return p


QUANTIZE_PY = ("import sys; from pathlib import Path; import make_random_model as m; "
               "m.quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))")


class Models:
    """The random models, made with make_random_model.py. On the GPU machine each F16 file is written by a
    background process while the library builds (pure numpy), then quantized by the patched build's quantizer
    (``make_random_model.quantize``, in a subprocess) in the background while the native checks run."""

    def __init__(self, run: Run, folder: Path, vocab: Path | None, env: dict, log_dir: Path):
        self.run, self.folder, self.vocab, self.env, self.log_dir = run, folder, vocab, env, log_dir
        self.f16: dict[str, tuple] = {}  # what -> (shape, final path, f16 path, writer process)
        self.jobs: dict[str, tuple] = {}  # what -> (thread, result dict)
        self.procs: list[subprocess.Popen] = []

    def path(self, what: str, shape: Shape) -> Path:
        return self.folder / f"{what}-{shape.layers}L-{shape.embd}-{shape.ftype}.gguf"

    def start_f16(self, what: str, shape: Shape, out: Path, context_length: int) -> None:
        if out.is_file():
            return
        f16 = out.with_name(out.stem + "-f16.gguf")
        f16.unlink(missing_ok=True)
        cmd = model_cmd(shape, f16, self.vocab, "f16", context_length)
        self.run.report["commands"][f"{what}_f16"] = " ".join(cmd)
        with open(self.log_dir / f"{what}_f16.log", "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        self.f16[what] = (shape, out, f16, proc)
        log(f"{what}: writing its F16 file in the background ({shape.layers} layers, n_embd {shape.embd})")

    def start_quantize(self, what: str) -> None:
        """Once the library is built: wait for the F16 writer, then quantize, in the background."""
        if what not in self.f16 or what in self.jobs:
            return
        import threading

        shape, out, f16, writer = self.f16.pop(what)
        threads = os.cpu_count() or 4
        cmd = [sys.executable, "-c", QUANTIZE_PY, str(f16), str(out), shape.ftype, str(threads)]
        self.run.report["commands"][f"{what}_quantize"] = (f"make_random_model.quantize({f16.name}, {out.name}, "
                                                           f"{shape.ftype!r}, {threads})")
        result: dict = {}

        def work():
            t0 = time.time()
            if writer.wait() != 0 or not f16.is_file():
                result["error"] = f"writing the {what} failed:\n{tail(self.log_dir / f'{what}_f16.log', 10)}"
                return
            result["f16_done_after_s"] = round(time.time() - self.run.t_origin, 1)
            t1 = time.time()
            with open(self.log_dir / f"{what}_quantize.log", "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env)
                self.procs.append(proc)
                rc = proc.wait()
            f16.unlink(missing_ok=True)
            if rc != 0 or not out.is_file():
                result["error"] = f"quantizing the {what} failed:\n{tail(self.log_dir / f'{what}_quantize.log', 10)}"
            result.update(quantize_seconds=round(time.time() - t1, 1), waited_for_f16_s=round(t1 - t0, 1))

        th = threading.Thread(target=work, name=f"quantize-{what}", daemon=True)
        th.start()
        self.jobs[what] = (th, result)
        log(f"{what}: quantizing to {shape.ftype} in the background once its F16 file is written")

    def finish(self, what: str, shape: Shape, out: Path, context_length: int) -> dict:
        """The model at ``out``: wait for its background job, or make it now in one go."""
        t0 = time.perf_counter()
        info: dict = {}
        self.start_quantize(what)
        if what in self.jobs:
            th, result = self.jobs.pop(what)
            th.join()
            if "error" in result:
                raise CheckError(result["error"])
            info.update(result)
            log(f"{what}: ready ({shape.ftype}, quantized in {result['quantize_seconds']} s)")
        elif not out.is_file():
            cmd = model_cmd(shape, out, self.vocab, shape.ftype, context_length)
            self.run.report["commands"][what] = " ".join(cmd)
            if run_cmd(cmd, self.log_dir / "model.log", self.env).returncode != 0 or not out.is_file():
                raise CheckError(f"make_random_model.py failed:\n{tail(self.log_dir / 'model.log', 10)}")
        else:
            log(f"{what}: {out.name} is already there")
        return {"path": str(out), "shape": asdict(shape), "bytes": out.stat().st_size,
                "vocab_from": str(self.vocab) if self.vocab else "the default model's tokenizer (SmolLM2-135M, 49152)",
                "waited_s": round(time.perf_counter() - t0, 1), **info}

    def stop(self) -> None:
        """End the background processes (a run that failed or was cut short) and drop half-written files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        for th, _ in self.jobs.values():
            th.join(timeout=10)
        for _, _, f16, _ in self.f16.values():
            f16.unlink(missing_ok=True)
        for f16 in self.folder.glob("*-f16.gguf"):
            f16.unlink(missing_ok=True)


def run_check(args) -> int:
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
        models = Models(run, folder, vocab, child_env(boot, lib_dir), boot.logs if boot else run.out_dir)
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
            from epikv_local.engine.native import load

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
            if args.mode == "cpu" and report["versions"]["gpu_backend"]:
                report["notes"].append("cpu mode on a GPU-capable library: models load with n_gpu_layers=0, but ggml "
                                       "may still run large prefill batches on the GPU")

        with run.stage("check_model"):
            report["check_model"] = models.finish("check_model" if p.check else "bench_model", check_shape, check_path,
                                                  8192 if p.check else ctx_len)
        models.start_quantize("bench_model")  # GPU machine: the CPUs quantize while the GPU runs the checks
        with run.stage("native_checks"):
            report["native_checks"] = native_checks(check_path, on_gpu, p.threads)
            for name, c in report["native_checks"].items():
                if "passed" in c:
                    why = f" ({c['error']})" if c.get("error") else ""
                    log(f"  {name}: {'PASS' if c['passed'] else 'FAIL'}{why}")
                    run.failed = run.failed or not c["passed"]

        if p.pytest_native and boot:
            budget_s = min(PYTEST_MAX_S, run.left() - MEASURE_RESERVE_S)
            if budget_s >= 30:
                with run.stage("native_pytest"):
                    report["native_pytest"] = native_pytest(check_path, boot, budget_s)
                    log(f"  tests/engine/test_native.py: {report['native_pytest']['summary']}")
                    run.failed = run.failed or not report["native_pytest"]["passed"]
            else:
                report["native_pytest"] = {"ran": False, "reason": f"{max(budget_s, 0):.0f} s left for it before "
                                           "the measurements"}
        else:
            report["native_pytest"] = {"ran": False, "reason": "cpu mode: the test suite runs tests/engine/test_native.py "
                                       "itself" if args.mode == "cpu" else "--no-native-pytest"}

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
            for name in ("build.log", "bench_model_f16.log", "bench_model_quantize.log", "pytest.log"):
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


def measure(run: Run, p: Preset, bench_path: Path, on_gpu: bool) -> None:
    from epikv_local.engine.handles import Model

    report = run.report
    gpu_total = (report["machine"].get("gpu") or {}).get("memory_total_mib")
    report["memory_before_model_load"] = memory_now(on_gpu)
    with Model(bench_path, n_gpu_layers=-1 if on_gpu else 0) as model:
        info = model.info
        report["bench_model"].update({"desc": info.desc, "n_layer": info.n_layer, "n_embd": info.n_embd,
                                      "n_head": info.n_head, "n_head_kv": info.n_head_kv, "n_vocab": info.n_vocab})
        report["memory_after_model_load"] = memory_now(on_gpu)
        names = list(VARIANTS)
        for i, name in enumerate(names):
            cap = min(p.variant_cap_s, (run.left() - 5) / (len(names) - i))
            if cap < 1.0:
                report["variants"][name] = {"variant": name, "policy": VARIANTS[name][0], "checkpoints": [],
                                            "error": "skipped: the run's deadline", "cap_s": round(cap, 1)}
                report["errors"].append(f"{name}: skipped, deadline")
                run.failed = True
                continue
            log(f"variant {name}: cap {cap:.1f} s")

            def progress(v, cp):
                mem = f", VRAM {cp['vram_used_mib']:.0f} MiB" if cp["vram_used_mib"] is not None else ""
                log(f"  {v} @ {cp['context']}: {cp['decode_tokens_per_s']:.1f} tok/s, live {cp['live_cells']}{mem}")

            try:
                rec = run_variant(model, name, p, time.time() + cap, on_gpu, progress)
            except Exception as e:  # noqa: BLE001 -- recorded; the other variants still run
                rec = {"variant": name, "policy": VARIANTS[name][0], "checkpoints": [],
                       "error": f"{type(e).__name__}: {e}", "longest_context": {"tokens": 0, "stop_reason": "error"}}
            rec["cap_s"] = round(cap, 1)
            report["variants"][name] = rec
            if rec.get("error"):
                report["errors"].append(f"{name}: {rec['error']}")
                run.failed = True
            lc = rec["longest_context"]
            log(f"  {name}: {lc['tokens']} tokens ({lc['stop_reason']}), flash attention ran: "
                f"{rec.get('flash_attn_ran')}, budget respected: {rec.get('budget_respected')}")
            report["contexts"] = context_table(report["variants"], p)
            report["longest_context"] = longest_summary(report["variants"], on_gpu, gpu_total)
            run.save()
    for c, row in report["contexts"].items():
        missing = [v for v, e in row.items() if not e["reached"]]
        if missing:
            report["notes"].append(f"context {c}: not reached by {', '.join(missing)} within the caps")


def print_summary(report: dict) -> None:
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    gpu = report["mode"] == "gpu"
    s = report["settings"]
    print(f"\n{report['mode'].upper()} mode -- decode tokens/s at each context (budget {s['budget']}, "
          f"{s['decode_tokens']} greedy tokens per point)")
    mem = "VRAM MiB" if gpu else "RSS MiB"
    print(f"{'context':>8} {'variant':10} {'tok/s':>9} {'ms/evict':>9} {'live':>7} {'KV MiB':>9} {mem:>9}")
    for c, row in report["contexts"].items():
        for v, e in row.items():
            if not e["reached"]:
                print(f"{c:>8} {v:10} not reached ({e.get('why')})")
                continue
            print(f"{c:>8} {v:10} {f(e['decode_tokens_per_s'], '9.1f')} {f(e['mean_eviction_round_ms'], '9.3f')} "
                  f"{e['live_cells']:7d} {f(mib(e['kv_bytes']), '9.2f')} "
                  f"{f(e['vram_used_mib'] if gpu else e['rss_mib'], '9.0f')}")
    print("longest context reached:")
    for v, lc in report["longest_context"].items():
        extra = (f"; computed memory bound {lc['computed_max_context_by_memory']} tokens"
                 if lc.get("computed_max_context_by_memory") else "")
        print(f"  {v:10} {lc.get('tokens')} tokens ({lc.get('stop_reason')}, cap {lc.get('variant_cap_s')} s){extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true", help="build the travel bundle (here, before a device run)")
    ap.add_argument("--mode", choices=("cpu", "gpu"), help="run the check: cpu (here, CI) or gpu (on the device)")
    ap.add_argument("--out", default=None, help="folder of gpu_check.json (default: $OUT, else build/gpu_check_out)")
    ap.add_argument("--bundle", default=str(BUNDLE), help="travel bundle folder (default: build/gpu_bundle)")
    ap.add_argument("--work", default=str(WORK), help="gpu mode: unpack/build/model folder (default: build/gpu_run)")
    ap.add_argument("--max-bundle-mib", type=float, default=60.0, help="--prepare fails above this size (60)")
    ap.add_argument("--contexts", default=None, help="comma-separated (gpu 4096,16384,32768; cpu 256,512,1024)")
    ap.add_argument("--budget", type=int, default=None, help="KV budget of epikv/streaming/h2o (gpu 2048, cpu 128)")
    ap.add_argument("--batch", type=int, default=None, help="n_batch = ubatch of the prefill (gpu 512, cpu 32)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens per checkpoint (gpu 32, cpu 16)")
    ap.add_argument("--max-context", type=int, default=None, help="end of the longest-context search (262144, 4096)")
    ap.add_argument("--variant-cap-s", type=float, default=None, help="time cap per variant (gpu 40, cpu 4)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the whole run, from gpu_check.sh's start (gpu 480, cpu 240); the variant caps shrink to fit")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp CPU threads (gpu: the package's default; "
                    "cpu: 1)")
    ap.add_argument("--ftype", choices=("q4_0", "q4_k_m", "q8_0", "f16"), default=None,
                    help="benchmark model type (q4_k_m)")
    ap.add_argument("--model", default=None, help="use this GGUF as the benchmark model instead of making one")
    ap.add_argument("--vocab-from", default=None, help="cpu mode: tokenizer GGUF of the random model (SmolLM2's)")
    ap.add_argument("--lib-dir", default=None, help="cpu mode: patched libraries to use (default: the installed ones)")
    ap.add_argument("--keep-model", action="store_true", help="cpu mode: keep the random model under --out")
    ap.add_argument("--jobs", type=int, default=None, help="gpu mode: build jobs (default: all cores)")
    ap.add_argument("--cmake-arg", action="append", metavar="-DNAME=VALUE",
                    help="gpu mode: one more CMake configure argument (repeatable), e.g. -DCUDAToolkit_ROOT=...")
    ap.add_argument("--no-cuda", dest="cuda", action="store_false",
                    help="gpu mode without CUDA, with --build-only: test the bootstrap and build on a CPU machine")
    ap.add_argument("--build-only", action="store_true", help="gpu mode: stop after the build")
    ap.add_argument("--no-native-pytest", action="store_true", help="gpu mode: skip tests/engine/test_native.py")
    args = ap.parse_args(argv)
    if args.prepare == bool(args.mode):
        ap.error("give exactly one of --prepare and --mode cpu|gpu")
    if args.prepare:
        return prepare(args)
    if args.mode == "gpu" and not args.cuda and not args.build_only:
        ap.error("--no-cuda only tests the bootstrap: add --build-only (nothing is measured without a GPU)")
    if args.mode == "cpu" and (args.build_only or not args.cuda):
        ap.error("--build-only and --no-cuda belong to --mode gpu")
    if args.out is None:
        args.out = os.environ.get("OUT") or str(ROOT / "build" / "gpu_check_out")
    return run_check(args)


if __name__ == "__main__":
    sys.exit(run_main("gpu_check", main))
