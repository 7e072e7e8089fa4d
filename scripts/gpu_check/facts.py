"""Facts about the machine, for the report: GPU 0 (nvidia-smi), memory in use (VRAM, RSS), tools' versions,
ggml's registered backend devices, and where nvcc is."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .common import mib


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
