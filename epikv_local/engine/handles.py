"""Model and context handles over the patched llama.cpp (explicit ownership: both are context managers).

``Model`` owns a ``llama_model``; ``Context`` owns a ``llama_context`` (flash attention requested as
``LLAMA_FLASH_ATTN_TYPE_ENABLED``), its batch, and optionally an eval-callback capture handle. Every llama.cpp
return code is checked here and turned into an :class:`~epikv_local.errors.EpikvError` (``NativeError``,
``KVFullError``, ``ModelError``, ``ConfigError``). A closed handle refuses every use, and a model refuses to
close while a context on it is open (the context holds a reference to it, llama-cpp-python's
``_internals`` style), so no call can reach freed native memory.

One module of ~770 lines on purpose: the two handles and their ownership rule (``_Owned``: in-flight calls,
close from another thread) are one contract, and every llama.h call that touches a model or context passes
here, where its return code becomes an exception.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import ConfigError, KVFullError, ModelError, NativeError
from ..policies.base import ModelShape
from .budget import MAX_CELLS
from .native import (
    CAPTURE_K,
    CAPTURE_OUT,
    DECODE_NO_KV_SLOT,
    LAYER_CAPTURE_BAD_LAYER,
    LAYER_CAPTURE_LAST_LAYER,
    SEQ_RM_POS_BAD_ARGS,
    SEQ_RM_POS_UNSUPPORTED,
    Native,
    decode_failure,
    load,
)

GGUF_MAGIC = b"GGUF"
#: KV cache element types: name -> (enum ggml_type value in ggml.h, bytes per element; quantized blocks of 32).
#: The values are ggml.h's own (llama-cpp-python's module lacks some, e.g. GGML_TYPE_BF16).
KV_TYPES = {
    "f32": (0, 4.0),
    "f16": (1, 2.0),
    "bf16": (30, 2.0),
    "q8_0": (8, 34 / 32),
    "q5_1": (7, 24 / 32),
    "q5_0": (6, 22 / 32),
    "q4_1": (3, 20 / 32),
    "q4_0": (2, 18 / 32),
}


def kv_type(value, what: str = "KV cache type") -> str:
    """A KV cache type given as a name ("q8_0") or as llama-cpp-python's / ggml's GGML_TYPE_* integer, as its
    name; None is "f16". ConfigError naming ``what`` for anything else."""
    if value is None:
        return "f16"
    if isinstance(value, str) and value in KV_TYPES:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        for name, (ggml_type, _) in KV_TYPES.items():
            if ggml_type == value:
                return name
    raise ConfigError(f"{what} must be one of {', '.join(KV_TYPES)} (or its GGML_TYPE_* value), got {value!r}")


def parse_rpc_servers(servers: list[str] | str | None) -> list[str]:
    """``"host:port,host:port"`` (or a list) -> endpoints, each checked to answer a TCP connection now, so that
    an unreachable server is one clear error instead of a failure deep inside llama.cpp."""
    import socket

    if not servers:
        return []
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = []
    for item in (x.strip() for x in items):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"RPC server must be host:port, got {item!r}")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as e:
            raise ModelError(f"cannot reach the RPC server {item}: {e.strerror or e}") from None
        out.append(item)
    return out


def resolve_threads(n_threads: int | None) -> int:
    """Threads for llama.cpp: ``n_threads`` checked against this machine, or the default.

    Default: one less than the CPUs this process may run on (its affinity mask), at most 8. llama.cpp's CPU
    threads meet at a barrier after every graph node, spinning (OpenMP); with every core taken, one busy
    neighbour (a desktop always has one) deschedules a thread and stalls all the others at each barrier:
    decoding fell from 61.5 to 0.35 tok/s on 2 cores with one busy (results/busy_core.json).
    """
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n_threads is None:
        return max(1, min(8, avail - 1))
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 1 <= n_threads <= 4 * avail:
        raise ConfigError(f"n_threads must be an integer in 1..{4 * avail} (this machine runs {avail} CPUs), "
                          f"got {n_threads!r}")
    return n_threads


def check_gguf(path: str | os.PathLike) -> Path:
    """Return the path if it is a readable GGUF file, else raise ModelError naming the problem."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {p}")
    return p


@dataclass(frozen=True)
class ModelInfo:
    """Shapes of a loaded model (counts)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    desc: str
    rope_type: str = "norm"
    rope_dims: int = 0
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0

    @property
    def shape(self) -> ModelShape:
        """What a policy may know of the model (see ``Policy.bind``)."""
        return ModelShape(n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head, n_head_kv=self.n_head_kv,
                          rope_type=self.rope_type, rope_dims=self.rope_dims, rope_freq_base=self.rope_freq_base,
                          rope_freq_scale=self.rope_freq_scale)


#: llama.h's enum llama_rope_type -> ModelShape.rope_type (M-RoPE and vision variants: "other")
_ROPE_TYPES = {-1: "none", 0: "norm", 2: "neox"}


def _meta_float(text: str | None, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except ValueError:
        return default


class Closing:
    """``with`` support for objects with a ``close()``; ``__del__`` closes as a last resort (prefer ``with``)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit, or while a context still holds the model
            pass


class _Owned(Closing):
    """An owned native handle: ``handle`` raises once closed; ``close()`` frees it once (``_free``).

    Methods that call into the native object are marked :func:`native_call`: each call counts as a use, and
    ``close()`` from another thread waits until no use is in flight before it frees anything (later calls
    raise NativeError "... is closed"), so a thread can never free native memory under another thread's call.
    """

    _what = "handle"
    _handle = None

    @property
    def handle(self):
        if self._handle is None:
            raise NativeError(f"{self._what} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _uses(self) -> tuple[threading.Condition, dict]:
        guard = self.__dict__.get("_guard")
        if guard is None:  # created on first use: subclasses need not call a base __init__
            guard = self.__dict__.setdefault("_guard", threading.Condition())
            self.__dict__.setdefault("_users", {})
        return guard, self.__dict__["_users"]

    @contextlib.contextmanager
    def using(self):
        """One native call on this object (re-entrant: a callback inside the call may make more)."""
        guard, users = self._uses()
        me = threading.get_ident()
        with guard:
            if self._handle is None or self.__dict__.get("_closing"):
                raise NativeError(f"{self._what} is closed")
            users[me] = users.get(me, 0) + 1
        try:
            yield self._handle
        finally:
            with guard:
                users[me] -= 1
                if not users[me]:
                    del users[me]
                guard.notify_all()

    def close(self) -> None:
        if self._handle is None:
            return
        guard, users = self._uses()
        with guard:
            if threading.get_ident() in users:
                raise NativeError(f"cannot close the {self._what} from inside one of its own calls")
            self._closing = True
            try:
                while users:  # another thread's call is in flight: it finishes first
                    guard.wait()
                if self._handle is not None:
                    self._free()
                    self._handle = None
            finally:
                self._closing = False

    def _free(self) -> None:
        raise NotImplementedError


def native_call(method):
    """Mark a method of an :class:`_Owned` object that calls into its native handle (see ``_Owned``)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.using():
            return method(self, *args, **kwargs)
    return call


class Model(_Owned):
    """A loaded GGUF model. Use as a context manager; ``close()`` frees it.

    n_gpu_layers: layers offloaded to a GPU backend (0 on CPU builds; -1 = all).
    """

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = -1, native: Native | None = None,
                 rpc_servers: list[str] | str | None = None):
        self.path = check_gguf(path)
        self.nat = native or load()
        endpoints = parse_rpc_servers(rpc_servers)
        self._endpoints: list[str] = []  # RPC servers registered for this model (released when it is freed)
        try:
            for endpoint in endpoints:
                self.nat.add_rpc_server(endpoint)
                self._endpoints.append(endpoint)
            self._load(endpoints, n_gpu_layers)
        except BaseException:
            if self._handle is not None:
                self.close()  # frees the model, then releases its servers
            self._release_rpc()
            raise

    def _load(self, endpoints: list[str], n_gpu_layers: int) -> None:
        ll = self.nat.llama
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        with self.nat.registry_lock:  # the device list stays the registry's until the model is loaded
            devices = self.nat.offload_devices(endpoints)
            if devices is not None:  # NULL-terminated ggml_backend_dev_t array, alive until the model is loaded
                dev_array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
                params.devices = ctypes.cast(dev_array, ctypes.c_void_p).value
            self.nat.log.clear()
            handle = self.nat.create(lambda: ll.llama_model_load_from_file(str(self.path).encode(), params),
                                     ll.llama_model_free)
        if not handle:
            raise ModelError(f"llama.cpp could not load {self.path}: {self.nat.log.recent_errors() or 'unknown error'}")
        self._handle = handle
        self._contexts: set[int] = set()  # ids of the open Contexts on this model
        self._vocab = ll.llama_model_get_vocab(handle)
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(handle, buf, 256)
        self.info = ModelInfo(
            arch=self.meta("general.architecture") or "unknown",
            n_layer=ll.llama_model_n_layer(handle),
            n_embd=ll.llama_model_n_embd(handle),
            n_head=ll.llama_model_n_head(handle),
            n_head_kv=ll.llama_model_n_head_kv(handle),
            n_vocab=ll.llama_vocab_n_tokens(self.vocab),
            desc=buf.value.decode("utf-8", "replace"),
        )
        arch = self.info.arch
        n_rot = self.meta(f"{arch}.rope.dimension_count")
        self.info = dataclasses.replace(
            self.info, rope_type=_ROPE_TYPES.get(int(ll.llama_model_rope_type(handle)), "other"),
            rope_dims=int(_meta_float(n_rot, 0)),
            rope_freq_base=_meta_float(self.meta(f"{arch}.rope.freq_base"), 10000.0),
            rope_freq_scale=float(ll.llama_model_rope_freq_scale_train(handle)))

    _what = "model"

    # -- ownership --------------------------------------------------------------------------------------
    @property
    def vocab(self):
        self.handle  # raises when closed: the vocabulary lives inside the model
        return self._vocab

    def __exit__(self, *exc) -> None:
        # leaving a ``with`` block never raises: with contexts still open the model is freed by the last one
        if self._contexts:
            self._close_pending = True
        else:
            self.close()

    def _free(self) -> None:
        """Refused (NativeError) while a context on the model is open: close the sessions first."""
        if self._contexts:
            raise NativeError(f"model {self.path.name} still has {len(self._contexts)} open context(s) "
                              "(sessions); close them before the model")
        self.nat.llama.llama_model_free(self._handle)
        self._vocab = None
        self._release_rpc()

    def _release_rpc(self) -> None:
        for endpoint in self._endpoints:
            self.nat.release_rpc_server(endpoint)
        self._endpoints = []

    # -- metadata, tokens --------------------------------------------------------------------------------
    @native_call
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.nat.llama.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.nat.llama.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    @native_call
    def metadata(self) -> dict[str, str]:
        """Every GGUF metadata key/value pair as strings (as llama-cpp-python's ``Llama.metadata``)."""
        ll, h = self.nat.llama, self.handle
        out = {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(ll.llama_model_meta_count(h)):
            if ll.llama_model_meta_key_by_index(h, i, buf, len(buf)) < 0:
                continue
            key = buf.value.decode("utf-8", "replace")
            n = ll.llama_model_meta_val_str_by_index(h, i, buf, len(buf))
            if n < 0:
                continue
            if n >= len(buf):
                big = ctypes.create_string_buffer(n + 1)
                ll.llama_model_meta_val_str_by_index(h, i, big, len(big))
                out[key] = big.value.decode("utf-8", "replace")
            else:
                out[key] = buf.value.decode("utf-8", "replace")
        return out

    @native_call
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> token ids (llama_tokenize). ConfigError for text that is not valid Unicode (e.g. undecodable
        bytes from a command line, which Python keeps as lone surrogates)."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"text is not valid UTF-8 (undecodable bytes at characters {e.start}..{e.end - 1})") \
                from None
        cap = len(data) + 16
        arr = (ctypes.c_int32 * cap)()
        n = self.nat.llama.llama_tokenize(self.vocab, data, len(data), arr, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            arr = (ctypes.c_int32 * cap)()
            n = self.nat.llama.llama_tokenize(self.vocab, data, len(data), arr, cap, add_special, parse_special)
            if n < 0:
                raise NativeError(f"llama_tokenize failed ({n})")
        return list(arr[:n])

    @native_call
    def max_piece_bytes(self) -> int | None:
        """The most bytes of text one token can stand for (computed once, about a second for a 150k
        vocabulary): the longest piece (byte-level BPE: the input bytes) or, for SPM, the longest stored token
        text (its U+2581 is 3 bytes of input for the 1-byte space of the piece); special tokens included. None
        where one token may stand for unbounded text: WPM and UGM vocabularies (an unknown word is one token)
        and special tokens that strip the whitespace beside them (lstrip / rstrip attributes). Otherwise a text
        of B bytes tokenizes to at least B / this many tokens, so a prompt over a token limit can be refused
        without tokenizing it (tokenizing megabytes is seconds of uninterruptible work)."""
        if not hasattr(self, "_max_piece"):
            self._max_piece = self._longest_token_text()
        return self._max_piece

    def _longest_token_text(self) -> int | None:
        ll = self.nat.llama
        kind = int(ll.llama_vocab_type(self.vocab))
        if kind not in (ll.LLAMA_VOCAB_TYPE_SPM, ll.LLAMA_VOCAB_TYPE_BPE):
            return None
        spm = kind == ll.LLAMA_VOCAB_TYPE_SPM  # byte-level BPE: the piece is the input bytes; SPM: the stored text
        strip = ll.LLAMA_TOKEN_ATTR_LSTRIP | ll.LLAMA_TOKEN_ATTR_RSTRIP
        buf, longest = ctypes.create_string_buffer(256), 1
        for token in range(self.info.n_vocab):
            if int(ll.llama_vocab_get_attr(self.vocab, token)) & strip:
                return None
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            text = (ll.llama_vocab_get_text(self.vocab, token) or b"") if spm else b""
            longest = max(longest, n if n >= 0 else -n, len(text))  # -n: the piece needs n bytes
        return longest

    @native_call
    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token's piece (may be a partial UTF-8 sequence)."""
        buf = ctypes.create_string_buffer(64)
        n = self.nat.llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.nat.llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    @native_call
    def digit_mask(self) -> np.ndarray:
        """(n_vocab,) bool: True for the tokens whose piece holds a decimal digit 0-9 (computed once, about
        a second for a 150k vocabulary; special tokens are not rendered, so never True)."""
        if not hasattr(self, "_digits"):
            self._digits = np.array([any(48 <= b <= 57 for b in self.token_bytes(t)) for t in range(self.info.n_vocab)],
                                    dtype=bool)
        return self._digits

    @native_call
    def is_eog(self, token: int) -> bool:
        return bool(self.nat.llama.llama_vocab_is_eog(self.vocab, token))

    @native_call
    def token_text(self, token: int) -> str:
        return self.nat.llama.llama_vocab_get_text(self.vocab, token).decode("utf-8", "replace")

    @native_call
    def token_eos(self) -> int:
        return int(self.nat.llama.llama_vocab_eos(self.vocab))

    @native_call
    def token_bos(self) -> int:
        return int(self.nat.llama.llama_vocab_bos(self.vocab))

    @native_call
    def bos_text(self) -> str:
        tok = self.nat.llama.llama_vocab_bos(self.vocab)
        return self.token_text(tok) if tok >= 0 else ""

    @native_call
    def eos_text(self) -> str:
        tok = self.nat.llama.llama_vocab_eos(self.vocab)
        return self.token_text(tok) if tok >= 0 else ""


class Context(_Owned):
    """A llama_context (flash attention requested as ENABLED), for sequence 0 unless n_seq_max > 1.

    n_ctx: KV cells allocated (the eviction engine sizes it as budget + one ubatch).
    n_batch: the largest number of tokens one ``decode`` call may take (== n_ubatch).
    capture: optional eval-callback capture handle (``capture.EvalCallbackCapture``) whose C callback is
    installed as ``cb_eval``; it must outlive the context.
    n_seq_max: sequences the context holds; with more than one the KV cache is unified (cells shared across
    sequences, so ``seq_copy`` is cheap: used to branch a prefix, e.g. for counterfactual labels).
    embeddings: the context outputs embeddings (read with :meth:`embeddings_seq` / :meth:`embeddings_ith`);
    pooling_type: llama.h's ``enum llama_pooling_type`` (None: unspecified, i.e. the model's own).
    """

    def __init__(self, model: Model, n_ctx: int, n_batch: int = 64, flash_attn: bool = True,
                 n_threads: int | None = None, cb_eval=None, cb_eval_user_data: int = 0,
                 type_k: str = "f16", type_v: str = "f16", n_seq_max: int = 1, embeddings: bool = False,
                 pooling_type: int | None = None):
        if not 1 <= n_ctx <= MAX_CELLS:
            raise ConfigError(f"n_ctx must be in 1..{MAX_CELLS}, got {n_ctx}")
        if not 1 <= n_batch <= MAX_CELLS:
            raise ConfigError(f"n_batch must be in 1..{MAX_CELLS}, got {n_batch}")
        if n_seq_max < 1:
            raise ConfigError(f"n_seq_max must be >= 1, got {n_seq_max}")
        self.model = model
        self.nat = model.nat
        ll = self.nat.llama
        p = ll.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_seq_max = n_seq_max
        p.kv_unified = n_seq_max > 1
        threads = resolve_threads(n_threads)
        p.n_threads = threads
        p.n_threads_batch = threads
        self.n_threads = threads
        p.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        p.embeddings = bool(embeddings)
        if pooling_type is not None:
            p.pooling_type = int(pooling_type)
        self.embeddings = bool(embeddings)
        type_k, type_v = kv_type(type_k, "type_k"), kv_type(type_v, "type_v")
        p.type_k = KV_TYPES[type_k][0]
        p.type_v = KV_TYPES[type_v][0]
        self.type_k, self.type_v = type_k, type_v
        if cb_eval is not None:
            p.cb_eval = ll.ggml_backend_sched_eval_callback(cb_eval)
            p.cb_eval_user_data = ctypes.c_void_p(cb_eval_user_data)
        self.flash_attn_requested = flash_attn
        self.nat.log.clear()
        with self.nat.registry_lock:
            handle = self.nat.create(lambda: ll.llama_init_from_model(model.handle, p), ll.llama_free)
        if not handle:
            raise NativeError(f"llama_init_from_model failed: {self.nat.log.recent_errors() or 'unknown error'}")
        self._handle = handle
        self._params = p  # keeps the ctypes callback object alive
        self.n_ctx = ll.llama_n_ctx(handle)
        self.n_batch = n_batch
        self.mem = ll.llama_get_memory(handle)
        self._mem_c = self.nat.as_cffi("llama_memory_t", self.mem)
        self._ctx_c = self.nat.as_cffi("struct llama_context *", handle)
        self._batch = ll.llama_batch_init(n_batch, 0, n_seq_max)
        self._kv_full_cb = None
        self._hook_error: BaseException | None = None  # raised by the kv-full hook, re-raised by decode()
        model._contexts.add(id(self))

    _what = "context"

    # -- ownership --------------------------------------------------------------------------------------
    def _free(self) -> None:
        ll = self.nat.llama
        self.set_kv_full_callback(None)
        ll.llama_batch_free(self._batch)
        ll.llama_free(self._handle)
        self.model._contexts.discard(id(self))
        if getattr(self.model, "_close_pending", False) and not self.model._contexts:
            self.model.close()

    # -- decode -----------------------------------------------------------------------------------------
    @native_call
    def decode(self, tokens: list[int], positions: list[int] | np.ndarray, logits_last: bool = True,
               logits_all: bool = False, seq_id: "int | list[int] | np.ndarray" = 0,
               outputs: "list[bool] | None" = None) -> None:
        """Decode tokens at the given positions of ``seq_id`` (positions need not be dense). ``seq_id`` may be
        one id per token: one batch then extends several sequences (e.g. counterfactual branches, or the
        streams of a ``SequencePool``). ``outputs``: one flag per token, which tokens get an output row
        (overrides ``logits_last`` / ``logits_all``).

        Raises KVFullError when no KV slot was found (llama_decode returned 1 after the kv-full hook),
        NativeError on any other failure, ValueError on bad arguments.
        """
        handle = self.handle  # raises when closed, before the (freed) batch is touched
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ConfigError(f"decode takes 1..{self.n_batch} tokens, got {n}")
        if len(positions) != n:
            raise ConfigError(f"{n} tokens but {len(positions)} positions")
        seqs = [int(seq_id)] * n if isinstance(seq_id, (int, np.integer)) else [int(x) for x in seq_id]
        if len(seqs) != n:
            raise ConfigError(f"{n} tokens but {len(seqs)} sequence ids")
        if outputs is not None and len(outputs) != n:
            raise ConfigError(f"{n} tokens but {len(outputs)} output flags")
        b = self._batch
        for i in range(n):
            b.token[i] = int(tokens[i])
            b.pos[i] = int(positions[i])
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seqs[i]
            if outputs is not None:
                b.logits[i] = 1 if outputs[i] else 0
            else:
                b.logits[i] = 1 if (logits_all or (logits_last and i == n - 1)) else 0
        b.n_tokens = n
        with self.nat.deferred_interrupt():
            rc = self.nat.llama.llama_decode(handle, b)
        hook_error, self._hook_error = self._hook_error, None
        if hook_error is not None:  # the kv-full hook raised inside llama_decode: that is the failure
            raise hook_error
        if rc == DECODE_NO_KV_SLOT:
            raise KVFullError(f"llama_decode: no KV slot for {n} tokens (n_ctx={self.n_ctx})")
        if rc != 0:
            raise self.nat.error(f"llama_decode failed with code {rc} ({decode_failure(rc)})")

    def prefill_chunks(self, tokens, start: int = 0, chunk: int | None = None, seq_id: int = 0,
                       logits_from: int | None = None) -> Iterator[np.ndarray]:
        """Decode ``tokens`` at the dense positions ``start, start + 1, ...`` of ``seq_id`` in chunks of ``chunk``
        tokens (default and at most ``n_batch``), yielding after each decode the (n,) int64 positions it
        decoded: the chunk's captured rows and output logits are readable until the next one.

        logits_from: a chunk that reaches a position >= it gets an output row per token (``logits_all``);
        None: only the final token of the last chunk has one. No eviction happens here: the caller sizes the
        context (``Session.feed`` is the budgeted path).
        """
        chunk = self.n_batch if chunk is None else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= self.n_batch:
            raise ConfigError(f"chunk must be an integer in 1..{self.n_batch}, got {chunk!r}")
        n = len(tokens)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            want = logits_from is not None and start + j > logits_from
            pos = np.arange(start + i, start + j, dtype=np.int64)
            part = tokens[i:j]
            self.decode(part.tolist() if isinstance(part, np.ndarray) else list(part), pos,
                        logits_last=(logits_from is None and j == n), logits_all=want, seq_id=seq_id)
            yield pos

    def prefill(self, tokens, start: int = 0, chunk: int | None = None, seq_id: int = 0,
                logits_from: int | None = None) -> None:
        """:meth:`prefill_chunks` run to the end (nothing read between chunks)."""
        for _ in self.prefill_chunks(tokens, start, chunk, seq_id, logits_from):
            pass

    @native_call
    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output row i of the last decode, shape (n_vocab,), float32 (a view; copy to keep)."""
        ptr = self.nat.llama.llama_get_logits_ith(self.handle, i)
        if not ptr:
            raise self.nat.error(f"no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.info.n_vocab,))

    # -- embeddings (a context created with embeddings=True) ---------------------------------------------
    @native_call
    def pooling_type(self) -> int:
        """The pooling type in effect (llama.h's ``enum llama_pooling_type``: the requested one, or the model's)."""
        return int(self.nat.llama.llama_pooling_type(self.handle))

    def _embedding_width(self) -> int:
        ll = self.nat.llama
        if self.pooling_type() == 4:  # LLAMA_POOLING_TYPE_RANK: the classifier's outputs, not n_embd
            return int(ll.llama_model_n_cls_out(self.model.handle))
        return self.model.info.n_embd

    @native_call
    def embeddings_seq(self, seq_id: int = 0) -> np.ndarray:
        """The pooled embedding of ``seq_id`` after the last decode: (n_embd,) float32 (a copy), or (n_cls_out,)
        with RANK pooling. NativeError when there is none (pooling NONE, or not an embeddings context)."""
        if not self.embeddings:
            raise ConfigError("this context was not created with embeddings=True")
        ptr = self.nat.llama.llama_get_embeddings_seq(self.handle, seq_id)
        if not ptr:
            raise self.nat.error(f"no pooled embedding for sequence {seq_id} (pooling type {self.pooling_type()})")
        return np.ctypeslib.as_array(ptr, shape=(self._embedding_width(),)).copy()

    @native_call
    def embeddings_ith(self, i: int) -> np.ndarray:
        """The embedding of output row ``i`` of the last decode (negative: from the end): (n_embd,) float32 (a
        copy). NativeError when the row has none."""
        if not self.embeddings:
            raise ConfigError("this context was not created with embeddings=True")
        ptr = self.nat.llama.llama_get_embeddings_ith(self.handle, i)
        if not ptr:
            raise self.nat.error(f"no embedding for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.info.n_embd,)).copy()

    # -- memory -----------------------------------------------------------------------------------------
    @native_call
    def seq_rm_positions(self, positions: np.ndarray, seq_id: int = 0) -> int:
        """Remove the listed positions of seq_id in one pass (patched llama_memory_seq_rm_pos).

        Returns the number of cells removed; raises NativeError if the memory type cannot do it.
        """
        self.handle
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        ffi = self.nat.ffi
        n = self.nat.lib.llama_memory_seq_rm_pos(self._mem_c, seq_id, ffi.from_buffer("llama_pos[]", pos), len(pos))
        if n == SEQ_RM_POS_UNSUPPORTED:
            raise NativeError(
                f"this model's memory ({self.model.info.arch}) cannot remove single positions "
                "(recurrent or hybrid memory): KV eviction is not supported for it")
        if n == SEQ_RM_POS_BAD_ARGS:
            raise NativeError(f"llama_memory_seq_rm_pos refused its arguments ({len(pos)} positions)")
        if n < 0:
            raise NativeError(f"llama_memory_seq_rm_pos failed with code {n}")
        return n

    @native_call
    def seq_rm_range(self, p0: int, p1: int, seq_id: int = 0) -> None:
        """Remove positions [p0, p1) of seq_id (stock llama_memory_seq_rm)."""
        self.handle
        if not self.nat.llama.llama_memory_seq_rm(self.mem, seq_id, p0, p1):
            raise NativeError(f"llama_memory_seq_rm({seq_id}, {p0}, {p1}) failed")

    @native_call
    def seq_copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make seq ``dst`` share the cells of ``src`` in [p0, p1) (llama_memory_seq_cp; no data copy when unified)."""
        self.handle
        self.nat.llama.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    @native_call
    def seq_state(self, seq_id: int = 0) -> bytes:
        """The KV cells of ``seq_id`` (positions, K and V) as llama.cpp serialises them
        (``llama_state_seq_get_data``); holes left by evictions are kept."""
        ll = self.nat.llama
        n = ll.llama_state_seq_get_size(self.handle, seq_id)
        buf = (ctypes.c_uint8 * max(1, n))()
        got = ll.llama_state_seq_get_data(self.handle, buf, n, seq_id)
        if got != n:
            raise self.nat.error(f"llama_state_seq_get_data wrote {got} of {n} bytes")
        return bytes(buf[:n])

    @native_call
    def set_seq_state(self, data: bytes, seq_id: int = 0) -> None:
        """Replace ``seq_id`` with a state from :meth:`seq_state` (same model and cache types);
        NativeError when llama.cpp refuses it (wrong model, cache types, too few cells)."""
        ll = self.nat.llama
        self.seq_rm_range(-1, -1, seq_id)
        buf = (ctypes.c_uint8 * max(1, len(data))).from_buffer_copy(data) if data else (ctypes.c_uint8 * 1)()
        self.nat.log.clear()
        got = ll.llama_state_seq_set_data(self.handle, buf, len(data), seq_id)
        if got != len(data) or got == 0:
            raise self.nat.error(f"llama.cpp refused the sequence state ({got} of {len(data)} bytes read)")

    @native_call
    def clear(self) -> None:
        """Empty the KV cache (all sequences)."""
        self.handle
        self.nat.llama.llama_memory_clear(self.mem, True)

    def set_kv_full_callback(self, fn) -> None:
        """Install fn(n_tokens) -> bool as the kv-full hook (None removes it). An exception raised by fn cannot
        cross llama.cpp's C frames: the hook then answers False (llama_decode gives up) and :meth:`decode`
        re-raises that exception as itself once llama_decode has returned."""
        ffi = self.nat.ffi
        if fn is None:
            if self._kv_full_cb is not None and not self.closed:
                self.nat.lib.llama_set_kv_full_callback(self._ctx_c, ffi.NULL, ffi.NULL)
            self._kv_full_cb = None
            return

        @ffi.callback("bool(struct llama_context *, int32_t, void *)")
        def _cb(_ctx, n_tokens, _ud):
            try:
                return bool(fn(int(n_tokens)))
            except BaseException as e:  # noqa: BLE001  (kept for decode() to re-raise, see above)
                self._hook_error = e
                return False

        self._kv_full_cb = _cb
        self.nat.lib.llama_set_kv_full_callback(self._ctx_c, _cb, ffi.NULL)

    # -- capture (patched API) --------------------------------------------------------------------------
    @native_call
    def set_layer_capture(self, il: int, enable: bool = True, kind: int = CAPTURE_OUT) -> None:
        """Capture layer il's output (kind=CAPTURE_OUT, "l_out"), keys (CAPTURE_K, "Kcur") or queries (CAPTURE_Q,
        "Qcur") from now on."""
        self.handle
        rc = self.nat.lib.llama_set_layer_capture(self._ctx_c, kind, il, enable)
        if rc == LAYER_CAPTURE_BAD_LAYER:
            raise ConfigError(f"layer {il} is out of range for a {self.model.info.n_layer}-layer model")
        if rc == LAYER_CAPTURE_LAST_LAYER:
            raise ConfigError(f"layer {il} is the last layer, whose output keeps only output rows: not capturable")
        if rc != 0:
            raise NativeError(f"llama_set_layer_capture failed with code {rc}")

    def set_layer_out(self, il: int, enable: bool = True) -> None:
        self.set_layer_capture(il, enable, CAPTURE_OUT)

    @native_call
    def layer_capture(self, il: int, n_tokens: int, kind: int = CAPTURE_OUT) -> np.ndarray | None:
        """Captured rows of layer il for the last decode, shape (n_tokens, n_row) float32 view (valid until the
        next decode); None when the graph had no such tensor."""
        self.handle
        ffi = self.nat.ffi
        n_row = ffi.new("int32_t *")
        ptr = self.nat.lib.llama_get_layer_capture(self._ctx_c, kind, il, n_row)
        if ptr == ffi.NULL:
            return None
        buf = ffi.buffer(ptr, n_tokens * n_row[0] * 4)
        return np.frombuffer(buf, dtype=np.float32).reshape(n_tokens, n_row[0])

    def layer_out(self, il: int, n_tokens: int) -> np.ndarray | None:
        return self.layer_capture(il, n_tokens, CAPTURE_OUT)

    def layer_keys(self, il: int, n_tokens: int) -> np.ndarray | None:
        """Keys after RoPE of layer il for the last decode: (n_tokens, n_head_kv * head_dim) float32 view."""
        return self.layer_capture(il, n_tokens, CAPTURE_K)

    @native_call
    def cell_positions(self, seq_id: int = 0) -> np.ndarray:
        """Position held by each KV cell for seq_id, -1 for cells not holding it: (n_cells,) int32."""
        self.handle
        out = np.empty(self.n_ctx, dtype=np.int32)
        n = self.nat.lib.llama_memory_seq_cell_pos(self._mem_c, seq_id, self.nat.ffi.from_buffer("llama_pos[]", out),
                                                  len(out))
        if n < 0:
            raise NativeError(f"llama_memory_seq_cell_pos failed with code {n}")
        if n > len(out):
            out = np.empty(n, dtype=np.int32)
            self.nat.lib.llama_memory_seq_cell_pos(self._mem_c, seq_id, self.nat.ffi.from_buffer("llama_pos[]", out), n)
        return out[:n]

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for the KV cache (n_ctx cells, all layers, K and V)."""
        info = self.model.info
        row = info.n_head_kv * (info.n_embd // info.n_head)  # floats of one cell's K (or V) row per layer
        return int(self.n_ctx * info.n_layer * row * (KV_TYPES[self.type_k][1] + KV_TYPES[self.type_v][1]))
