"""``--prepare``: the travel bundle ``build/gpu_bundle/`` that the device tool carries to the GPU machine (the
pruned patched llama.cpp tree, Llama-3's vocab GGUF, the device's wheels, pure-Python packages, a manifest),
and the name of the llama.cpp tree the current patches give (the GPU run refuses a stale bundle by it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from epikv_local.fileio import sha256_file

from .common import ROOT, CheckError, dir_bytes, mib, pkg_version, write_json

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
    """Build the bundle at --bundle, print its size (a last line BUNDLE_MIB=...) and check the limits."""
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
        "ggml_backends": list(GGML_BACKENDS), "tar_sha256": sha256_file(tar_path),
        "vocab": {"file": VOCAB_NAME, "from": VOCAB_FILE, "sha256": sha256_file(bundle / VOCAB_NAME)},
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
