"""All native bindings of epikv-local, in one place.

Two libraries are bound, both built by this package's CMake into ``epikv_local/lib``:

* ``libllama`` (patched llama.cpp). The stock API is used through llama-cpp-python's ctypes module
  (``llama_cpp``), which is made to load *this* library through ``LLAMA_CPP_LIB_PATH``. The functions that
  our patches add to ``llama.h`` are declared below with cffi, mirroring the header (see ``patches/``).
* ``libepikv_capture`` (``native/epikv_capture.h``): the eval-callback capture route, graph probe and
  attention readback.

Nothing is loaded at import: :func:`load` loads once and returns a :class:`Native` handle. C return codes
become :class:`NativeError` here, with llama.cpp's last error lines attached.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib.metadata
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cffi

from ..errors import INTERRUPTED, NativeError, interrupt_handler

# --- declarations: mirror include/llama.h (patched) and native/epikv_capture.h ---------------------------
LLAMA_CDEF = """
typedef int32_t llama_pos;
typedef int32_t llama_seq_id;
typedef struct llama_memory_i * llama_memory_t;
struct llama_context;

int32_t llama_memory_seq_rm_pos(llama_memory_t mem, llama_seq_id seq_id, const llama_pos * pos, int32_t n_pos);
int32_t llama_memory_seq_cell_pos(llama_memory_t mem, llama_seq_id seq_id, llama_pos * out, int32_t n_out);
enum llama_layer_capture {
    LLAMA_LAYER_CAPTURE_OUT   = 0,
    LLAMA_LAYER_CAPTURE_K     = 1,
    LLAMA_LAYER_CAPTURE_Q     = 2,
    LLAMA_LAYER_CAPTURE_COUNT = 3,
};
int32_t llama_set_layer_capture(struct llama_context * ctx, enum llama_layer_capture kind, int32_t il, bool enable);
float * llama_get_layer_capture(struct llama_context * ctx, enum llama_layer_capture kind, int32_t il, int32_t * n_row);
typedef bool (*llama_kv_full_callback)(struct llama_context * ctx, int32_t n_tokens, void * user_data);
void    llama_set_kv_full_callback(struct llama_context * ctx, llama_kv_full_callback cb, void * user_data);
"""

# ggml-rpc.h / ggml-backend.h: llama.cpp's RPC backend (libggml-rpc, built when GGML_RPC=ON)
RPC_CDEF = """
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
ggml_backend_reg_t ggml_backend_rpc_reg(void);
void ggml_backend_register(ggml_backend_reg_t reg);
void ggml_backend_device_register(ggml_backend_dev_t device);
void ggml_backend_unload(ggml_backend_reg_t reg);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
int ggml_backend_dev_type(ggml_backend_dev_t device);
"""
# enum ggml_backend_dev_type (ggml-backend.h)
DEV_TYPE_GPU, DEV_TYPE_IGPU = 1, 2

CAPTURE_CDEF = """
#define EPIKV_MODE_CAPTURE 1
#define EPIKV_MODE_PROBE 2
#define EPIKV_MODE_ATTN 4
typedef struct epikv_capture epikv_capture;
struct ggml_tensor;
epikv_capture * epikv_capture_new(const int32_t * layers, int32_t n_layers, int32_t n_embd, int32_t max_tokens);
void epikv_capture_free(epikv_capture * cap);
int32_t epikv_capture_set_mode(epikv_capture * cap, int32_t mode);
bool epikv_capture_cb_eval(struct ggml_tensor * t, bool ask, void * user_data);
int32_t epikv_capture_take(epikv_capture * cap, float * g_out, int32_t max_rows);
void epikv_capture_reset(epikv_capture * cap);
int32_t epikv_capture_enable_attention(epikv_capture * cap, int32_t max_cells);
int32_t epikv_capture_take_attention(epikv_capture * cap, float * sum_out, float * last_out, int32_t n_cells);
int64_t epikv_capture_n_captured(const epikv_capture * cap);
const char * epikv_capture_probe_text(const epikv_capture * cap);
void epikv_diff_norms(const float * rows, int32_t n_rows, int32_t n_embd, float * prev, int32_t has_prev, float * out);
"""

# epikv_capture mode bits (native/epikv_capture.h)
MODE_IDLE, MODE_CAPTURE, MODE_PROBE, MODE_ATTN = 0, 1, 2, 4
# -- return codes: each one the package checks, named and explained (unused ones are not declared) --------
# llama_memory_seq_rm_pos (patches/0002): >= 0 cells removed; -1 this memory type cannot remove single
# positions (recurrent / hybrid memory); -2 bad arguments (n_pos < 0 or a null pointer)
SEQ_RM_POS_UNSUPPORTED = -1
SEQ_RM_POS_BAD_ARGS = -2
# llama_set_layer_capture kinds (enum llama_layer_capture, patches/0001)
CAPTURE_OUT = 0   # LLAMA_LAYER_CAPTURE_OUT: the layer's output hidden state ("l_out-<il>")
CAPTURE_K = 1     # LLAMA_LAYER_CAPTURE_K: the layer's keys after RoPE ("Kcur-<il>")
CAPTURE_Q = 2     # LLAMA_LAYER_CAPTURE_Q: the layer's queries after RoPE ("Qcur-<il>")
# llama_set_layer_capture: 0 ok; -1 layer out of range; -2 the last layer (its output keeps only output rows)
LAYER_CAPTURE_BAD_LAYER = -1
LAYER_CAPTURE_LAST_LAYER = -2
# llama_decode (llama.h): 0 ok; 1 no KV slot for the batch (after the kv-full hook, patches/0003, gave up);
# 2 aborted by the abort callback; -1 invalid batch; < -1 error. Only "no KV slot" has its own exception.
DECODE_NO_KV_SLOT = 1
DECODE_MEANINGS = {1: "no KV slot for the batch", 2: "aborted", -1: "invalid batch"}


def decode_failure(rc: int) -> str:
    """What a non-zero llama_decode return code means (llama.h)."""
    return DECODE_MEANINGS.get(rc, "error" if rc < -1 else "warning")


def _lib_names(stem: str) -> list[str]:
    if sys.platform == "darwin":
        return [f"lib{stem}.dylib"]
    if sys.platform == "win32":
        return [f"{stem}.dll", f"lib{stem}.dll"]
    return [f"lib{stem}.so"]


def _loaded_name(lib_dir: Path, stem: str) -> Path | None:
    """The file name under which libllama loaded ``lib<stem>`` (its soname, e.g. ``libggml.so.0``).

    Opening the unversioned ``libggml.so`` instead would map a *second* copy, with its own backend registry:
    a device registered there (an RPC server) would be invisible to llama.cpp."""
    # the shortest versioned name is the soname (libggml.so.0 beside libggml.so.0.25.3; libggml.0.dylib); a
    # wheel stores each of these names as a separate copy of the file, so the name decides which copy is used
    versioned = sorted(lib_dir.glob(f"lib{stem}.so.*") if sys.platform != "darwin" else lib_dir.glob(f"lib{stem}.*.dylib"),
                       key=lambda q: len(q.name))
    if versioned:
        return versioned[0]
    return next((lib_dir / n for n in _lib_names(stem) if (lib_dir / n).exists()), None)


def default_lib_dir() -> Path:
    """The directory holding libllama, ggml and libepikv_capture: ``$EPIKV_LIB_DIR`` or the package's lib/."""
    env = os.environ.get("EPIKV_LIB_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent / "lib"
    if here.is_dir():
        return here
    # imported from a source checkout: use the libraries of the installed distribution
    try:
        return Path(importlib.metadata.distribution("epikv-local").locate_file("epikv_local/lib"))
    except importlib.metadata.PackageNotFoundError:
        return here


class LlamaLog:
    """Our ``llama_log_set`` sink: keeps the last lines, prints only when verbose.

    llama-cpp-python's own logger maps levels with a stale table, so ours replaces it.
    """

    # ggml_log_level: 0 NONE, 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT
    NAMES = {0: "none", 1: "debug", 2: "info", 3: "warn", 4: "error", 5: "cont"}

    def __init__(self, verbose: bool = False, keep: int = 50):
        self.verbose = verbose
        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=keep)
        #: the last INFO lines (llama.cpp reports buffer sizes there, e.g. the KV cache's)
        self.info: collections.deque[str] = collections.deque(maxlen=keep)
        self._last_level = 2
        self._lock = threading.Lock()
        #: a Ctrl-C that arrived while llama.cpp was calling us: ctypes would print and drop it, so it is kept
        #: here and re-raised by :meth:`Native.check_interrupt` once the native call returns
        self.interrupted = False

    def __call__(self, level: int, text: bytes, _user_data: Any) -> None:
        try:
            msg = text.decode("utf-8", "replace") if text else ""
            with self._lock:
                if level == 5:  # continuation of the previous line
                    level = self._last_level
                self._last_level = level
                if level >= 3:
                    self.lines.append((level, msg.rstrip("\n")))
                elif level == 2:
                    self.info.append(msg.rstrip("\n"))
            if self.verbose or os.environ.get("EPIKV_VERBOSE"):
                sys.stderr.write(msg)
        except KeyboardInterrupt:
            self.interrupted = True

    def recent_errors(self, n: int = 3) -> str:
        with self._lock:
            errs = [m for lvl, m in self.lines if lvl >= 3 and m.strip()]
        return " | ".join(errs[-n:])

    def clear(self) -> None:
        with self._lock:
            self.lines.clear()


@dataclass
class Native:
    """Loaded libraries. ``llama`` is the ``llama_cpp`` ctypes module bound to our libllama."""

    lib_dir: Path
    llama: Any
    ffi: cffi.FFI
    lib: Any  # cffi handle of libllama (patched functions)
    cap: Any  # cffi handle of libepikv_capture
    log: LlamaLog
    _keep: list = field(default_factory=list)
    rpc: Any = None  # cffi handles of libggml-rpc + libggml (None when built without GGML_RPC)
    _rpc_servers: dict = field(default_factory=dict)  # endpoint -> (its ggml_backend_reg_t, its devices)
    _rpc_users: dict = field(default_factory=dict)  # endpoint -> open models that asked for it
    #: held while ggml's device registry changes and while a model or context is created (they read it;
    #: the registry itself has no lock)
    registry_lock: threading.RLock = field(default_factory=threading.RLock)

    def add_rpc_server(self, endpoint: str) -> int:
        """Register the devices of an ``rpc-server`` at ``host:port`` with ggml for one more model; models
        loaded meanwhile may offload layers to them. Returns the number of devices it has. Each call is paired
        with :meth:`release_rpc_server` when that model is freed."""
        if self.rpc is None:
            raise NativeError("this build has no RPC backend: rebuild with CMAKE_ARGS=\"-DGGML_RPC=ON\" "
                              "(rm -rf build first)")
        with self.registry_lock:
            if endpoint not in self._rpc_servers:
                g = self.rpc[1]
                reg = self.rpc[0].ggml_backend_rpc_add_server(endpoint.encode())
                if reg == self.ffi.NULL:
                    raise self.error(f"ggml_backend_rpc_add_server({endpoint}) failed")
                g.ggml_backend_register(reg)
                self._rpc_servers[endpoint] = (reg, [g.ggml_backend_reg_dev_get(reg, i)
                                                     for i in range(g.ggml_backend_reg_dev_count(reg))])
            self._rpc_users[endpoint] = self._rpc_users.get(endpoint, 0) + 1
            return len(self._rpc_servers[endpoint][1])

    def release_rpc_server(self, endpoint: str) -> None:
        """One model that asked for ``endpoint`` is freed; with the last, its devices leave ggml's registry.
        Why: ggml's registry is the process's, and a model loaded with llama.cpp's default device list (any
        other llama.cpp user in the process: llama-cpp-python's ``Llama``, a vocabulary-only load) asks every
        registered device for its memory, and an RPC device whose server is gone aborts the process."""
        with self.registry_lock:
            n = self._rpc_users.get(endpoint, 0) - 1
            if n > 0:
                self._rpc_users[endpoint] = n
                return
            self._rpc_users.pop(endpoint, None)
            entry = self._rpc_servers.pop(endpoint, None)
            if entry is None:
                return
            # ggml-rpc gives every server's devices the one global RPC registration as their owner, so
            # unloading the server's own registration leaves its devices listed: unload the global one (all
            # RPC devices, nothing is closed), put it back (it has no devices of its own: ``reg_by_name("RPC")``
            # keeps working), then list again the devices of the servers still in use
            rpc, g = self.rpc
            g.ggml_backend_unload(entry[0])
            g.ggml_backend_unload(rpc.ggml_backend_rpc_reg())
            g.ggml_backend_register(rpc.ggml_backend_rpc_reg())
            for _, devices in self._rpc_servers.values():
                for dev in devices:
                    g.ggml_backend_device_register(dev)

    def offload_devices(self, endpoints: list[str]) -> list[int] | None:
        """The devices a model may offload to (addresses for ``llama_model_params.devices``): the named RPC
        servers' devices, then the local GPUs; None (llama.cpp's default: every device) while no RPC server is
        registered. A server stays in ggml's registry while any model that asked for it is open, so a model
        that did not ask for it must be given an explicit list that leaves it out."""
        if not self._rpc_servers:
            return None
        g = self.rpc[1]
        remote = {self.address(d) for _, devs in self._rpc_servers.values() for d in devs}
        local = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
        gpus = [self.address(d) for d in local if g.ggml_backend_dev_type(d) == DEV_TYPE_GPU
                and self.address(d) not in remote]
        igpus = [self.address(d) for d in local if g.ggml_backend_dev_type(d) == DEV_TYPE_IGPU]
        wanted = [self.address(d) for ep in endpoints for d in self._rpc_servers[ep][1]]
        return wanted + (gpus or igpus)

    # -- pointer conversion between llama_cpp (ctypes) handles and cffi ------------------------------------
    def as_cffi(self, ctype: str, handle: Any) -> Any:
        addr = ctypes.cast(handle, ctypes.c_void_p).value if not isinstance(handle, int) else handle
        if not addr:
            raise NativeError(f"null {ctype}")
        return self.ffi.cast(ctype, addr)

    def address(self, cdata: Any) -> int:
        return int(self.ffi.cast("uintptr_t", cdata))

    def check_interrupt(self) -> None:
        """Re-raise a Ctrl-C that a native callback had to swallow (see ``LlamaLog.interrupted``)."""
        if self.log.interrupted:
            self.log.interrupted = False
            raise KeyboardInterrupt

    def create(self, make, free):
        """``make()`` a native object under :meth:`deferred_interrupt`; freed with ``free`` when a Ctrl-C arrived
        meanwhile (then re-raised). Returns the handle (possibly NULL: the caller reports the failure)."""
        handle = None
        try:
            with self.deferred_interrupt():
                handle = make()
        except KeyboardInterrupt:
            if handle:
                free(handle)
            raise
        return handle

    @contextlib.contextmanager
    def deferred_interrupt(self):
        """Around a native call that may call back into Python (llama.cpp's log): Ctrl-C only sets a flag and is
        raised once the call returns. Python raises KeyboardInterrupt wherever the main thread runs Python code,
        and inside a ctypes callback ctypes prints and drops it ("Exception ignored on calling ctypes callback"),
        so the run would go on. Only the main thread with Python's default handler is changed."""
        previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        if previous not in (signal.default_int_handler, interrupt_handler):
            yield
            self.check_interrupt()
            return
        signal.signal(signal.SIGINT, lambda signum, frame: INTERRUPTED.set())
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        if INTERRUPTED.is_set() or self.log.interrupted:
            INTERRUPTED.clear()  # raised now: nothing left for the generation loop's safety net
            self.log.interrupted = False
            raise KeyboardInterrupt

    def error(self, what: str) -> NativeError:
        detail = self.log.recent_errors()
        return NativeError(f"{what}" + (f" (llama.cpp: {detail})" if detail else ""))


_NATIVE: Native | None = None
_LOCK = threading.Lock()


def _check_llama_cpp_import(lib_dir: Path) -> None:
    mod = sys.modules.get("llama_cpp.llama_cpp")
    if mod is None:
        return
    loaded = Path(getattr(mod._lib, "_name", "")).resolve()
    if loaded.parent != lib_dir.resolve():
        raise NativeError(
            f"llama_cpp was imported before epikv_local and loaded {loaded}; epikv-local needs its patched "
            f"library in {lib_dir}. Import epikv_local before llama_cpp, or set LLAMA_CPP_LIB_PATH={lib_dir}."
        )


def load(lib_dir: Path | None = None, verbose: bool = False) -> Native:
    """Load the patched libllama (through llama_cpp) and the capture shim, once per process.

    Raises NativeError when the libraries are missing or ``llama_cpp`` already loaded another libllama.
    """
    global _NATIVE
    with _LOCK:
        if _NATIVE is not None:
            _NATIVE.log.verbose = _NATIVE.log.verbose or verbose
            return _NATIVE
        lib_dir = Path(lib_dir) if lib_dir else default_lib_dir()
        llama_path = next((lib_dir / n for n in _lib_names("llama") if (lib_dir / n).exists()), None)
        cap_path = next((lib_dir / n for n in _lib_names("epikv_capture") if (lib_dir / n).exists()), None)
        if llama_path is None or cap_path is None:
            raise NativeError(
                f"patched llama.cpp libraries not found in {lib_dir}; install the package "
                f"(bash scripts/install.sh) or set EPIKV_LIB_DIR"
            )
        _check_llama_cpp_import(lib_dir)
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
        import llama_cpp  # noqa: E402  (import after LLAMA_CPP_LIB_PATH is set)

        _check_llama_cpp_import(lib_dir)

        ffi = cffi.FFI()
        ffi.cdef(LLAMA_CDEF)
        ffi.cdef(CAPTURE_CDEF)
        lib = ffi.dlopen(str(llama_path))
        cap = ffi.dlopen(str(cap_path))
        rpc = None
        rpc_path = _loaded_name(lib_dir, "ggml-rpc")
        ggml_path = _loaded_name(lib_dir, "ggml")
        if rpc_path is not None and ggml_path is not None:
            ffi.cdef(RPC_CDEF)
            rpc = (ffi.dlopen(str(rpc_path)), ffi.dlopen(str(ggml_path)))

        log = LlamaLog(verbose=verbose)
        log_cb = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(log_cb, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _NATIVE = Native(lib_dir=lib_dir, llama=llama_cpp, ffi=ffi, lib=lib, cap=cap, log=log, _keep=[log_cb], rpc=rpc)
        return _NATIVE
