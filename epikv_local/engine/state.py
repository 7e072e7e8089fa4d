"""Save a session's sequence to a file and restore it: KV cells (with the holes evictions left), the engine's
bookkeeping, the tokens, the policy's and the capture's running state.

A session file is *data only*: nothing in it is ever unpickled, imported or called, and no class is ever
constructed from a name it holds. Layout (format 3, all integers little endian)::

    b"EPIKVST1"          8 bytes, the magic
    header length        8 bytes (unsigned)
    header               UTF-8 JSON (strict: no NaN/Infinity literals)
    arrays blob          the numeric arrays of the policy and capture state, back to back
    kv blob              llama.cpp's sequence state (``llama_state_seq_get_data``)
    sha256               32 bytes, the digest of everything before it (header included)

The header holds the format version, the model identity (model file size, architecture, shapes, KV cache
types), the policy's registered name, its settings and its running state, the capture's running state, the
budget, the tokens, the engine's bookkeeping (``EvictionEngine.snapshot()``), the table of the arrays (dtype
from an allow-list of numeric dtypes, shape, memory order) and the sizes of the two blobs.

Running state is encoded by one generic, explicit encoder (:class:`_Encoder`): JSON scalars and lists, tagged
tuples, dicts, deques, numeric arrays and scalars (references into the arrays table), numpy's PCG64 generator
state, frozen configuration dataclasses and functions (saved by name only to be *compared* with the fresh
policy's own), and the attributes of the policy and of the few helper classes policies keep their state in
(:data:`_HOLDERS`). Anything else is refused at save time with a DataError naming the attribute.

Loading (:func:`load`) checks the whole file (magic, version, sizes, the sha256 over header and blobs), then
validates every field against the model and the session *before anything is applied*: the header's shape,
the model identity, the policy name and settings, the tokens (ints in 0..n_vocab-1, one per position), the
engine's bookkeeping (live positions strictly increasing in 0..n_past-1 and within the budget, newest the last
live position with n_past right after it, prompt end, recent window and counts in range), the arrays table
against the arrays blob, the policy state against a freshly constructed and bound policy of the same class and
settings (same attributes, types, dtypes and shapes; the helpers' invariants; a throwaway copy of the restored
policy must score the live positions, then take the signals of one more decode shaped as this session's capture
gives them and score again), the capture rows (float32, n_embd each) and the KV blob's cell table (exactly the live
positions). Any problem is one DataError naming the file and the field; the session is left as it was (a KV
blob that llama.cpp refuses, or that restores other cells than the header says, is undone before the error).
Written atomically (temporary file + rename). Saving also re-lays the saved session's cells the way a restore
does, so that the original and every restored copy continue with bit-identical logits.

One module of ~830 lines on purpose: the format, its encoder and its validator must change together (a field
the encoder writes and the validator does not check is a hole).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import struct
import types
import warnings
from collections import deque
from pathlib import Path

import numpy as np

from ..errors import DataError, EpikvError, first_line
from ..fileio import write_atomic
from ..policies._keys import PositionRows
from ..policies.base import Observation, Policy, PositionScores
from ..policies.scoring import StreamingScorer
from ..policies.triattention import QueryStats
from .budget import MAX_CELLS

MAGIC = b"EPIKVST1"
#: 3: data only (JSON header + raw numeric arrays, sha256 over the whole file); 2 pickled the running state
VERSION = 3
DIGEST_BYTES = 32
#: numeric dtypes an array of a session file may have (little endian)
DTYPES = frozenset({"|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8",
                    "<c16"})
MAX_NDIM = 8
#: nesting of the encoded running state (policy -> helper -> container -> ...)
MAX_DEPTH = 32
INT64 = (-(2**63), 2**63 - 1)
HEADER_KEYS = ("version", "model", "policy", "capture", "kv_budget", "n_past", "tokens", "engine", "arrays",
               "blobs")
ENGINE_KEYS = ("live", "newest", "prompt_end", "recent_window", "stats")
STATS_KEYS = ("n_evicted", "n_rounds", "max_live")


class _Refused(Exception):
    """A field of the file is invalid: (field, message); :func:`load` turns it into one DataError."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field, self.message = field, message


# -- the helper classes policies keep running state in -------------------------------------------------------
def _check_position_scores(obj, before, where):
    if obj.values.ndim != 1:
        raise _Refused(f"{where}.values", "must be one-dimensional")


def _check_position_rows(obj, before, where):
    pos, rows = obj.pos, obj.rows
    if pos.dtype != np.int64 or pos.ndim != 1:
        raise _Refused(f"{where}.pos", "must be a one-dimensional int64 array")
    if len(pos) and (pos[0] < 0 or np.any(np.diff(pos) <= 0)):
        raise _Refused(f"{where}.pos", "must be strictly increasing positions >= 0")
    if rows is None:
        if len(pos):
            raise _Refused(f"{where}.rows", f"is missing for {len(pos)} positions")
    elif type(rows) is not np.ndarray:
        raise _Refused(f"{where}.rows", f"must be an array, got a {_kind(rows)}")
    elif rows.ndim < 2 or rows.shape[0] != len(pos) or rows.dtype.kind not in "fc":
        raise _Refused(f"{where}.rows", f"must be float or complex rows, one per position ({len(pos)}), got "
                                        f"{rows.dtype} {rows.shape}")


def _check_streaming_scorer(obj, before, where):
    if obj.layers != before["layers"]:
        raise _Refused(f"{where}.layers", f"are {obj.layers}, this session's policy scores {before['layers']}")
    for name in ("_buf", "_smooth_prefix"):
        if getattr(obj, name).shape != before[name].shape:
            raise _Refused(f"{where}.{name}", f"has shape {getattr(obj, name).shape}, expected {before[name].shape}")
    if obj._n_seen < 0:
        raise _Refused(f"{where}._n_seen", "must be >= 0")


def _check_query_stats(obj, before, where):
    s, a = obj.sum, obj.sum_abs
    if not all(type(x) is int for x in obj.layers):
        raise _Refused(f"{where}.layers", "must be layer indices")
    if s.dtype != np.complex128 or a.dtype != np.float64 or s.ndim != 3 or a.shape != s.shape \
            or s.shape[0] != len(obj.layers):
        raise _Refused(f"{where}.sum", f"must be (layers, heads, pairs) complex128 and float64 arrays, got "
                                       f"{s.dtype} {s.shape} and {a.dtype} {a.shape}")
    if before["sum"].size and s.shape != before["sum"].shape:
        raise _Refused(f"{where}.sum", f"has shape {s.shape}, expected {before['sum'].shape}")
    if obj.count < 0:
        raise _Refused(f"{where}.count", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class _Holder:
    """How a helper class's attributes are checked: ``free`` arrays may have any shape (``check`` validates
    them); ``make`` builds an empty one when the fresh policy holds None there (e.g. statistics created on the
    first decode)."""

    check: object = None
    free: frozenset = frozenset()
    make: object = None


#: the tags of an encoded value (``_Encoder.encode`` writes them, ``_Decoder.value`` reads them)
_TAGS = frozenset({"$float", "$array", "$scalar", "$tuple", "$deque", "$dict", "$rng", "$function", "$frozen",
                   "$object"})

#: the helper classes a policy's state may hold (matched by exact class), beside Policy subclasses
_HOLDERS = {
    PositionScores: _Holder(_check_position_scores, frozenset({"values"}), PositionScores),
    PositionRows: _Holder(_check_position_rows, frozenset({"pos", "rows"}), PositionRows),
    StreamingScorer: _Holder(_check_streaming_scorer),
    QueryStats: _Holder(_check_query_stats, frozenset({"sum", "sum_abs"}), lambda: QueryStats((), 0, 0)),
}
_MAKE = {cls.__name__: h.make for cls, h in _HOLDERS.items() if h.make is not None}
_POLICY_HOLDER = _Holder()


def _holder(obj) -> _Holder | None:
    if isinstance(obj, Policy):
        return _POLICY_HOLDER
    return _HOLDERS.get(type(obj))


def _settings(policy) -> list[str]:
    """The policy's settings: its dataclass init fields."""
    return [f.name for f in dataclasses.fields(policy) if f.init]


def _kind(v) -> str:
    if isinstance(v, np.ndarray):
        return f"{v.dtype} array"
    return type(v).__name__


def _fn_name(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _is_frozen_dataclass(v) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type) and v.__dataclass_params__.frozen


# -- encoding --------------------------------------------------------------------------------------------------
class _Encoder:
    """Running state -> JSON-able tree + numeric arrays (``self.arrays``); DataError for anything else."""

    def __init__(self):
        self.arrays: list[np.ndarray] = []

    def _array(self, a: np.ndarray, where: str) -> int:
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder not in ("|", "<") else a.dtype
        if dt.str not in DTYPES:
            raise DataError(f"cannot save the session: {where} is a {a.dtype} array (a session file holds "
                            "numeric arrays only)")
        if a.ndim > MAX_NDIM:
            raise DataError(f"cannot save the session: {where} has {a.ndim} dimensions (at most {MAX_NDIM})")
        self.arrays.append(a.astype(dt, copy=False))
        return len(self.arrays) - 1

    def encode(self, v, where: str, depth: int = 0):
        if depth > MAX_DEPTH:
            raise DataError(f"cannot save the session: {where} is nested more than {MAX_DEPTH} levels deep")
        t = type(v)
        if v is None or t in (bool, str):
            return v
        if t is int:
            if not INT64[0] <= v <= INT64[1]:
                raise DataError(f"cannot save the session: {where} = {v} is beyond 64 bits")
            return v
        if t is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if t is np.ndarray:
            return {"$array": self._array(v, where)}
        if isinstance(v, np.generic) and t is type(np.asarray(v)[()]):
            return {"$scalar": self._array(np.asarray(v), where)}
        if t is tuple:
            return {"$tuple": [self.encode(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if t is list:
            return [self.encode(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
        if t is dict:
            return {"$dict": [[self.encode(k, f"{where} key", depth + 1), self.encode(x, f"{where}[{k!r}]", depth + 1)]
                              for k, x in v.items()]}
        if t is deque:
            return {"$deque": [self.encode(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)],
                    "maxlen": v.maxlen}
        if t is np.random.Generator:
            bg = v.bit_generator
            if type(bg) is not np.random.PCG64:
                raise DataError(f"cannot save the session: {where} is a {type(bg).__name__} generator (a session "
                                "file holds PCG64 ones)")
            return {"$rng": "PCG64", "state": bg.state}
        if _is_frozen_dataclass(v):
            return {"$frozen": t.__name__, "fields": {f.name: self.encode(getattr(v, f.name), f"{where}.{f.name}",
                                                                          depth + 1)
                                                      for f in dataclasses.fields(v)}}
        if t is types.FunctionType:
            return {"$function": _fn_name(v)}
        if _holder(v) is not None:
            return {"$object": t.__name__, "attrs": {k: self.encode(x, f"{where}.{k}", depth + 1)
                                                     for k, x in vars(v).items()}}
        raise DataError(f"cannot save the session: {where} is a {t.__module__}.{t.__qualname__}, which a session "
                        "file cannot hold (data only: numbers, strings, numeric arrays, tuples, lists, dicts and "
                        "the policies' state helpers)")


# -- decoding --------------------------------------------------------------------------------------------------
def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b,
                                                                                                   equal_nan=True)
    if type(a) in (tuple, list) and type(b) is type(a):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _check_pcg64_state(st, where: str) -> dict:
    keys = {"bit_generator", "state", "has_uint32", "uinteger"}
    if type(st) is not dict or set(st) != keys or st["bit_generator"] != "PCG64" or type(st["state"]) is not dict \
            or set(st["state"]) != {"state", "inc"}:
        raise _Refused(where, "is not a PCG64 generator state")
    for name, v, hi in (("state", st["state"]["state"], 2**128), ("inc", st["state"]["inc"], 2**128),
                        ("has_uint32", st["has_uint32"], 2), ("uinteger", st["uinteger"], 2**32)):
        if type(v) is not int or not 0 <= v < hi:
            raise _Refused(where, f"has an invalid {name}")
    return st


class _Decoder:
    """The JSON tree + arrays back into values, guided by a template (the fresh policy's own values): a value
    takes the template's type, dtype, dimensions and (unless its holder says otherwise) shape; objects are only
    filled in, never constructed from the file (except the empty helpers of :data:`_HOLDERS` with a ``make``)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.used: set[int] = set()

    def take(self, ref, where: str) -> np.ndarray:
        if type(ref) is not int or not 0 <= ref < len(self.arrays):
            raise _Refused(where, f"refers to array {ref!r}, the file has {len(self.arrays)}")
        if ref in self.used:
            raise _Refused(where, f"refers to array {ref} a second time")
        self.used.add(ref)
        return self.arrays[ref]

    def value(self, enc, tmpl, where: str, depth: int = 0, free: bool = False):
        if depth > MAX_DEPTH:
            raise _Refused(where, f"is nested more than {MAX_DEPTH} levels deep")
        v = self._value(enc, tmpl, where, depth)
        if tmpl is None:
            return v
        if type(v) is not type(tmpl):
            raise _Refused(where, f"is a {_kind(v)}, this session's policy holds a {_kind(tmpl)} there")
        if isinstance(v, (np.ndarray, np.generic)) and v.dtype != tmpl.dtype:
            raise _Refused(where, f"is a {v.dtype} {'array' if v.ndim else 'scalar'}, expected {tmpl.dtype}")
        if type(v) is np.ndarray:
            if v.ndim != tmpl.ndim:
                raise _Refused(where, f"has {v.ndim} dimensions, expected {tmpl.ndim}")
            # a fresh policy's empty array grows along its first axis; any other array keeps its shape
            if not free and (v.shape[1:] != tmpl.shape[1:] or (tmpl.shape[0] and v.shape[0] != tmpl.shape[0])):
                raise _Refused(where, f"has shape {v.shape}, expected {tmpl.shape}")
        return v

    def _value(self, enc, tmpl, where, depth):
        t = type(enc)
        if enc is None or t in (bool, str, float):
            return enc
        if t is int:
            if not INT64[0] <= enc <= INT64[1]:
                raise _Refused(where, "is an integer beyond 64 bits")
            return enc
        if t is list:
            sub = tmpl if type(tmpl) is list and len(tmpl) == len(enc) else [None] * len(enc)
            return [self.value(x, s, f"{where}[{i}]", depth + 1) for i, (x, s) in enumerate(zip(enc, sub))]
        if t is not dict or len(enc) not in (1, 2):
            raise _Refused(where, f"is not an encoded value ({type(enc).__name__})")
        tag = next((k for k in enc if type(k) is str and k.startswith("$")), None)
        rest = {"$deque": {"maxlen"}, "$rng": {"state"}, "$frozen": {"fields"}, "$object": {"attrs"}}.get(tag, set())
        if tag not in _TAGS or set(enc) != {tag} | rest:  # (an unknown tag once reached the "$object" branch)
            raise _Refused(where, f"is not an encoded value (keys {sorted(map(str, enc))})")
        body = enc[tag]
        if tag in ("$float", "$rng", "$function", "$frozen", "$object") and type(body) is not str:
            raise _Refused(where, f"is not an encoded value ({tag} {_short(body)})")
        if tag == "$float":
            if body not in ("nan", "inf", "-inf"):
                raise _Refused(where, f"is not a float ({body!r})")
            return float(body)
        if tag == "$array":
            return self.take(body, where)
        if tag == "$scalar":
            a = self.take(body, where)
            if a.ndim != 0:
                raise _Refused(where, f"is a scalar stored as an array of shape {a.shape}")
            return a[()]
        if tag in ("$tuple", "$deque", "$dict") and type(body) is not list:
            raise _Refused(where, f"is not a list ({tag})")
        if tag == "$tuple":
            sub = tmpl if type(tmpl) is tuple and len(tmpl) == len(body) else (None,) * len(body)
            return tuple(self.value(x, s, f"{where}[{i}]", depth + 1) for i, (x, s) in enumerate(zip(body, sub)))
        if tag == "$deque":
            maxlen = enc["maxlen"]
            if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
                raise _Refused(f"{where}.maxlen", "must be None or an integer >= 0")
            if type(tmpl) is deque and maxlen != tmpl.maxlen:
                raise _Refused(f"{where}.maxlen", f"is {maxlen}, this session's policy keeps {tmpl.maxlen}")
            if maxlen is not None and len(body) > maxlen:
                raise _Refused(where, f"holds {len(body)} items, more than its maxlen {maxlen}")
            return deque((self.value(x, None, f"{where}[{i}]", depth + 1) for i, x in enumerate(body)), maxlen)
        if tag == "$dict":
            return self._dict(body, tmpl, where, depth)
        if tag == "$rng":
            if body != "PCG64" or type(tmpl) is not np.random.Generator or type(tmpl.bit_generator) is not \
                    np.random.PCG64:
                raise _Refused(where, "holds a random generator where this session's policy has none (or another)")
            rng = copy.deepcopy(tmpl)
            try:
                rng.bit_generator.state = _check_pcg64_state(enc["state"], where)
            except (ValueError, TypeError, OverflowError, KeyError):
                raise _Refused(where, "is not a valid PCG64 generator state") from None
            return rng
        if tag == "$function":
            if type(tmpl) is not types.FunctionType or body != _fn_name(tmpl):
                raise _Refused(where, f"names function {body!r}, this session's policy uses "
                                      f"{_fn_name(tmpl) if type(tmpl) is types.FunctionType else _kind(tmpl)}")
            return tmpl
        if tag == "$frozen":
            return self._frozen(body, enc["fields"], tmpl, where, depth)
        return self._object(body, enc["attrs"], tmpl, where, depth)

    def _dict(self, body, tmpl, where, depth):
        out = {}
        for i, item in enumerate(body):
            if type(item) is not list or len(item) != 2:
                raise _Refused(f"{where}[{i}]", "is not a [key, value] pair")
            k = self.value(item[0], None, f"{where} key {i}", depth + 1)
            if isinstance(k, np.ndarray) or not isinstance(k, (str, int, float, bool, np.generic, tuple, type(None))):
                raise _Refused(f"{where} key {i}", f"is a {_kind(k)}, not a valid key")
            try:
                hash(k)
            except TypeError:
                raise _Refused(f"{where} key {i}", "is not hashable") from None
            if k in out:
                raise _Refused(f"{where} key {i}", f"{k!r} appears twice")
            sub = tmpl.get(k) if type(tmpl) is dict else None
            out[k] = self.value(item[1], sub, f"{where}[{k!r}]", depth + 1)
        if type(tmpl) is dict and tmpl and set(out) != set(tmpl):
            raise _Refused(where, f"has keys {sorted(map(repr, out))}, this session's policy has "
                                  f"{sorted(map(repr, tmpl))}")
        return out

    def _frozen(self, name, fields, tmpl, where, depth):
        if not _is_frozen_dataclass(tmpl) or type(tmpl).__name__ != name:
            raise _Refused(where, f"is a {name!r} configuration, this session's policy holds a {_kind(tmpl)}")
        names = [f.name for f in dataclasses.fields(tmpl)]
        if type(fields) is not dict or set(fields) != set(names):
            raise _Refused(where, f"must have the fields {names}")
        for f in names:
            got = self.value(fields[f], getattr(tmpl, f), f"{where}.{f}", depth + 1)
            if not _equal(got, getattr(tmpl, f)):
                raise _Refused(f"{where}.{f}", f"is {got!r}, this session's policy has {getattr(tmpl, f)!r}")
        return tmpl  # derived from the settings and the model: the fresh policy's own

    def _object(self, name, attrs, tmpl, where, depth):
        if tmpl is None and name in _MAKE:
            tmpl = _MAKE[name]()
        spec = _holder(tmpl)
        if spec is None or type(tmpl).__name__ != name:
            raise _Refused(where, f"is a {name!r} object, this session's policy holds a {_kind(tmpl)} there")
        if type(attrs) is not dict:
            raise _Refused(where, "has no attribute table")
        before = dict(vars(tmpl))
        if set(attrs) != set(before):
            missing, extra = sorted(set(before) - set(attrs)), sorted(set(attrs) - set(before))
            raise _Refused(where, f"attributes differ from this session's {name} (missing {missing}, unexpected "
                                  f"{extra})")
        for k in before:
            vars(tmpl)[k] = self.value(attrs[k], before[k], f"{where}.{k}", depth + 1, free=k in spec.free)
        if spec.check is not None:
            spec.check(tmpl, before, where)
        return tmpl


# -- the file --------------------------------------------------------------------------------------------------
def _model_identity(session) -> dict:
    info = session.model.info
    return {"desc": info.desc, "arch": info.arch, "n_layer": info.n_layer, "n_embd": info.n_embd,
            "n_vocab": info.n_vocab, "file_size": session.model.path.stat().st_size,
            "type_k": session.cfg.type_k, "type_v": session.cfg.type_v}


def save(session, path: str | os.PathLike) -> Path:
    """Write the session's sequence to ``path`` (atomically). DataError (before anything is changed) when the
    policy holds state a session file cannot hold."""
    eng, policy = session.engine, session.policy
    enc = _Encoder()
    settings = {k: enc.encode(getattr(policy, k), f"policy.{k}") for k in _settings(policy)}
    running = enc.encode(policy, "policy")
    capture = enc.encode(session.capture.state(), "capture")
    # an F-ordered array keeps its order (as pickle did): numpy's reductions may sum in memory order
    table = [{"dtype": a.dtype.str, "shape": list(a.shape),
              "order": "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"} for a in enc.arrays]
    blob = b"".join(a.tobytes(order=t["order"]) for a, t in zip(enc.arrays, table))
    kv = session.ctx.seq_state(session.seq_id)
    # lay the live cells out as a restore does (position order): flash attention accumulates over the cells
    # in their physical order (in f16 on the CPU), so only the same layout continues with identical logits
    session.ctx.set_seq_state(kv, session.seq_id)
    header = {
        "version": VERSION, "model": _model_identity(session),
        "policy": {"name": policy.name, "settings": settings, "state": running},
        "capture": capture, "kv_budget": eng.cfg.kv_budget, "n_past": session.n_past, "tokens": session.tokens,
        "engine": eng.snapshot(), "arrays": table, "blobs": {"arrays": len(blob), "kv": len(kv)},
    }
    head = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<Q", len(head)) + head + blob + kv
    return write_atomic(path, body + hashlib.sha256(body).digest(), error=DataError, what="session state",
                        make_parents=False)


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def read(path: str | os.PathLike) -> tuple[dict, dict[str, bytes]]:
    """The header and the blobs ("arrays", "kv") of a state file, after checking its framing, version and
    sha256; DataError when it is not one, truncated, corrupted or of another format version."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read session state {path}: {e.strerror or e}") from None
    if data[:8] != MAGIC:
        raise DataError(f"{path} is not an epikv-local session state file")
    if len(data) < 16:
        raise DataError(f"{path} is truncated")
    (n,) = struct.unpack("<Q", data[8:16])
    if 16 + n > len(data):
        raise DataError(f"{path} is truncated (header: {len(data) - 16} of {n} bytes)")
    try:
        header = json.loads(data[16:16 + n].decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise DataError(f"{path} is truncated or corrupted (unreadable header)") from None
    if type(header) is not dict or "version" not in header:
        raise DataError(f"{path} is refused: header lacks 'version'")
    version = header["version"]
    if version != VERSION or type(version) is not int:
        hint = " (written by an older epikv-local, which pickled the running state: save it again with this one)" \
            if type(version) is int and version < VERSION else ""
        raise DataError(f"{path} has session state format {version!r}, this version reads only {VERSION}{hint}")
    if "blobs" not in header:
        raise DataError(f"{path} is refused: header lacks 'blobs'")
    blobs = header["blobs"]
    sizes = [blobs.get(k) for k in ("arrays", "kv")] if type(blobs) is dict and set(blobs) == {"arrays", "kv"} \
        else None
    if sizes is None or any(type(s) is not int or s < 0 for s in sizes):
        raise DataError(f"{path} is refused: blobs must give the byte sizes of 'arrays' and 'kv'")
    total = 16 + n + sizes[0] + sizes[1] + DIGEST_BYTES
    if len(data) < total:
        raise DataError(f"{path} is truncated ({len(data)} of {total} bytes)")
    if len(data) > total:
        raise DataError(f"{path} is corrupted ({len(data) - total} bytes after its end)")
    if hashlib.sha256(data[:-DIGEST_BYTES]).digest() != data[-DIGEST_BYTES:]:
        raise DataError(f"{path} is corrupted (checksum mismatch)")
    at = 16 + n
    return header, {"arrays": data[at:at + sizes[0]], "kv": data[at + sizes[0]:total - DIGEST_BYTES]}


def _int(v, field: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Refused(field, f"must be an integer in {lo}..{hi}, got {_short(v)}")
    return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _keys(d, field: str, keys) -> dict:
    if type(d) is not dict:
        raise _Refused(field, f"must be an object, got {_short(d)}")
    missing, extra = [k for k in keys if k not in d], sorted(k for k in d if k not in keys)
    if missing:
        raise _Refused(field, f"lacks {', '.join(map(repr, missing))}")
    if extra:
        raise _Refused(field, f"has unexpected {', '.join(map(repr, extra))}")
    return d


def _arrays(table, blob: bytes) -> list[np.ndarray]:
    """The arrays of the arrays blob, as the header's table describes them (the table must cover it exactly)."""
    if type(table) is not list:
        raise _Refused("arrays", "must be a list")
    out, at = [], 0
    for i, t in enumerate(table):
        where = f"arrays[{i}]"
        _keys(t, where, ("dtype", "shape", "order"))
        if type(t["dtype"]) is not str or t["dtype"] not in DTYPES:
            raise _Refused(f"{where}.dtype", f"{_short(t['dtype'])} is not an allowed numeric dtype")
        shape = t["shape"]
        if type(shape) is not list or len(shape) > MAX_NDIM or any(type(d) is not int or d < 0 for d in shape):
            raise _Refused(f"{where}.shape", f"must be at most {MAX_NDIM} sizes >= 0, got {_short(shape)}")
        if type(t["order"]) is not str or t["order"] not in ("C", "F"):
            raise _Refused(f"{where}.order", "must be 'C' or 'F'")
        dt = np.dtype(t["dtype"])
        nbytes = math.prod(shape) * dt.itemsize
        if at + nbytes > len(blob):
            raise _Refused(where, f"needs {nbytes} bytes, the arrays blob has {len(blob) - at} left")
        raw = np.frombuffer(blob, dtype=np.uint8 if dt.kind == "b" else dt, count=math.prod(shape), offset=at) \
            if nbytes else np.empty(0, dtype=np.uint8 if dt.kind == "b" else dt)
        if dt.kind == "b":
            if raw.size and raw.max() > 1:
                raise _Refused(where, "holds booleans other than 0 and 1")
            raw = raw.view(np.bool_)
        a = raw.reshape(shape, order=t["order"])
        out.append(np.array(a, dtype=dt.newbyteorder("="), order="F" if t["order"] == "F" and a.ndim > 1 else "C"))
        at += nbytes
    if at != len(blob):
        raise _Refused("arrays", f"describe {at} bytes, the arrays blob holds {len(blob)}")
    return out


def _check_engine(snap, session, n_past: int) -> dict:
    """The engine's bookkeeping against the session's budget: DataError-ready _Refused on the first problem."""
    want = session.engine.snapshot()
    if set(want) != set(ENGINE_KEYS) or set(want["stats"]) != set(STATS_KEYS):
        raise _Refused("engine", "this engine's bookkeeping has fields this version does not validate")
    _keys(snap, "engine", ENGINE_KEYS)
    live = snap["live"]
    cfg = session.budget
    if type(live) is not list or not all(type(p) is int for p in live):
        raise _Refused("engine.live", "must be a list of integer positions")
    if len(live) > cfg.kv_budget:
        raise _Refused("engine.live", f"holds {len(live)} live cells, more than this session's budget "
                                      f"{cfg.kv_budget}")
    if any(b <= a for a, b in zip(live, live[1:])):
        raise _Refused("engine.live", "positions must be strictly increasing")
    if live and (live[0] < 0 or live[-1] >= n_past):
        raise _Refused("engine.live", f"positions must lie in 0..n_past-1 = 0..{n_past - 1}")
    newest = snap["newest"]
    if type(newest) is not int or newest != (live[-1] if live else -1):
        raise _Refused("engine.newest", f"is {_short(newest)}, the newest live position is "
                                        f"{live[-1] if live else -1}")
    if newest + 1 != n_past:
        raise _Refused("n_past", f"is {n_past}, the sequence continues after its newest live position {newest}")
    if snap["prompt_end"] is not None:
        _int(snap["prompt_end"], "engine.prompt_end", 0, n_past)
    _int(snap["recent_window"], "engine.recent_window", 0, max(0, cfg.kv_budget - cfg.n_sink - 1))
    stats = _keys(snap["stats"], "engine.stats", STATS_KEYS)
    for k in STATS_KEYS:
        _int(stats[k], f"engine.stats.{k}", 0, INT64[1])
    return snap


def _check_kv_cells(kv: bytes, own: bytes, live: list[int]) -> None:
    """The KV blob's cell table must list exactly the live positions (llama.cpp's sequence state: magic, seq
    id, stream count as this context writes them, then the cell count and per cell its position, one sequence
    id (0) and, for some models, a 12-byte cell extension)."""
    if len(kv) < 16 or kv[:12] != own[:12]:
        raise _Refused("kv", "is not a sequence state of this context (magic, sequence or stream count differ)")
    (count,) = struct.unpack("<I", kv[12:16])
    if count != len(live):
        raise _Refused("kv", f"holds {count} cells, the header lists {len(live)} live positions")
    if not count:
        return
    want = np.asarray(live, dtype=np.int64)
    for stride in (12, 24):  # pos, n_seq_id, [ext,] seq_id: 4-byte fields
        if 16 + count * stride > len(kv):
            continue
        cells = np.frombuffer(kv, dtype="<i4", count=count * stride // 4, offset=16).reshape(count, stride // 4)
        if np.array_equal(np.sort(cells[:, 0].astype(np.int64)), want) and np.all(cells[:, 1] == 1) \
                and np.all(cells[:, -1] == 0):
            return
    raise _Refused("kv", "cell table does not hold exactly the live positions of the header")


def _fresh_policy(session):
    """A newly constructed policy of the session's class and settings, bound to this model."""
    cur = session.policy
    fresh = type(cur)(**{k: getattr(cur, k) for k in _settings(cur)})
    if "name" in vars(cur):
        fresh.name = cur.name
    fresh.bind(session.model.info.shape)
    return fresh


def _check_policy(pol, session, decoder: _Decoder):
    cur = session.policy
    _keys(pol, "policy", ("name", "settings", "state"))
    if pol["name"] != cur.name:
        raise DataError(f"was saved with policy {_short(pol['name'])}, this session runs {cur.name!r}")
    names = _settings(cur)
    settings = _keys(pol["settings"], "policy.settings", names)
    for k in names:
        got = decoder.value(settings[k], None, f"policy.settings.{k}")
        if not _equal(got, getattr(cur, k)):
            raise _Refused(f"policy.settings.{k}", f"is {_short(got)}, this session's policy {cur.name!r} has "
                                                   f"{getattr(cur, k)!r}")
    try:
        fresh = _fresh_policy(session)
    except EpikvError as e:
        raise _Refused("policy", f"cannot be rebuilt for this session ({first_line(e)})") from None
    if type(pol["state"]) is not dict or "$object" not in pol["state"]:
        raise _Refused("policy.state", "is not an encoded policy")
    decoder.value(pol["state"], fresh, "policy.state")
    for k in names + (["name"] if "name" in vars(cur) else []):
        if not _equal(getattr(fresh, k), getattr(cur, k)):
            raise _Refused(f"policy.state.{k}", f"is {_short(getattr(fresh, k))}, the settings say "
                                                f"{getattr(cur, k)!r}")
    return fresh


def _probe_observation(session, live: list[int], n_past: int) -> Observation:
    """The signals of one more decode (at position n_past) as this session's capture would hand them over, with
    neutral values: the rows a policy appends must fit the ones it restored. Key rows: n_head_kv x the head size
    llama.cpp uses (the GGUF ``attention.key_length``, default n_embd / n_head)."""
    info, plan = session.model.info, session.capture.plan
    head = info.n_embd // max(1, info.n_head)
    key_length = session.model.metadata().get(f"{info.arch}.attention.key_length")
    if key_length is not None and key_length.isdigit():
        head = int(key_length)
    obs = Observation(positions=np.array([n_past], dtype=np.int64))
    if plan.layers:
        obs.g = np.ones((1, len(plan.layers)))
    if plan.key_layers:
        obs.keys = np.ones((1, len(plan.key_layers), info.n_head_kv * head), dtype=np.float32)
    if plan.query_layers:
        obs.queries = np.ones((1, len(plan.query_layers), info.n_head * head), dtype=np.float32)
    if session.pool.digits is not None:
        obs.numeric = np.zeros(1, dtype=bool)
    if session.pool.signals.surprise:
        obs.surprise = np.zeros(1)
    if plan.attention_layers:
        n_ctx = max(session.ctx.n_ctx, len(live) + 1)
        obs.cell_pos = np.full(n_ctx, -1, dtype=np.int32)
        obs.cell_pos[:len(live) + 1] = live + [n_past]
        obs.attn_received = np.full(n_ctx, 1.0 / (len(live) + 1), dtype=np.float32)
        obs.attn_last = obs.attn_received.copy()
    return obs


def _mixed_dict(obj, where: str, depth: int = 0) -> str | None:
    """Where a dict of the policy's state holds arrays of different dtypes or shapes (per-chunk arrays grow one
    entry per chunk, all alike: after the probe's decode added one of the real shape, a crafted entry stands out)."""
    if depth > MAX_DEPTH:
        return None
    if type(obj) is dict:
        arrays = {(a.dtype.str, a.shape) for a in obj.values() if type(a) is np.ndarray}
        if len(arrays) > 1:
            return f"{where} holds arrays of different dtypes or shapes {sorted(arrays)}"
        items = obj.items()
    elif type(obj) in (list, tuple, deque):
        items = enumerate(obj)
    elif _holder(obj) is not None:
        items = vars(obj).items()
    else:
        return None
    for k, v in items:
        problem = _mixed_dict(v, f"{where}.{k}" if type(k) is str else f"{where}[{k!r}]", depth + 1)
        if problem:
            return problem
    return None


def _scores_ok(policy, positions: np.ndarray, obs: Observation | None) -> str | None:
    """None when (a throwaway copy of) ``policy`` rates ``positions``, then takes ``obs`` and rates them and the
    new position; otherwise what went wrong."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            p = copy.deepcopy(policy)
            if obs is not None:
                p.observe(obs)
                positions = np.append(positions, obs.positions)
                mixed = _mixed_dict(p, "policy.state")
                if mixed:
                    return mixed
            s = np.asarray(p.score(positions))
            if s.shape != positions.shape or s.dtype.kind not in "fiu":
                return f"scores {len(positions)} positions as a {s.dtype} {s.shape} array"
    except Exception as e:  # noqa: BLE001 - whatever the saved state makes the policy raise, the file is refused
        return f"{type(e).__name__}: {first_line(e)}"
    return None


def _check_scores(fresh, session, live: list[int], n_past: int) -> None:
    """The restored policy (throwaway copies) must rate the live positions, and take the signals of the next
    decode and rate again (when a fresh policy of this session does: the probe's signals suit this model)."""
    if not fresh.evicts:
        return
    pos = np.asarray(live, dtype=np.int64)
    problem = _scores_ok(fresh, pos, None) if len(pos) else None
    if problem:
        raise _Refused("policy.state", f"cannot score the live positions ({problem})")
    obs = _probe_observation(session, live, n_past)
    if _scores_ok(_fresh_policy(session), pos[:0], obs) is None:
        problem = _scores_ok(fresh, pos, obs)
        if problem:
            raise _Refused("policy.state", f"does not fit this session's next decode ({problem})")


def _check_capture(enc, session, decoder: _Decoder):
    got = decoder.value(enc, None, "capture")
    cur = session.capture.state()
    if got is None:
        return None
    n_embd = session.model.info.n_embd
    if type(got) is not list or cur is None or len(got) != len(cur):
        raise _Refused("capture", f"must be null or {len(cur) if cur is not None else 'no'} rows (one per captured "
                                  "layer) for this session")
    for i, r in enumerate(got):
        if r is not None and (type(r) is not np.ndarray or r.dtype != np.float32 or r.shape != (n_embd,)):
            got_kind = f"{_kind(r)} {r.shape}" if type(r) is np.ndarray else _short(r)
            raise _Refused(f"capture[{i}]", f"must be null or a float32 row of {n_embd}, got a {got_kind}")
    return got


def _validate(session, header: dict, blobs: dict[str, bytes], own_kv: bytes):
    _keys(header, "header", HEADER_KEYS)
    want = _model_identity(session)
    model = header["model"]
    if type(model) is not dict or model != want:
        diff = sorted(k for k in want if type(model) is not dict or model.get(k) != want[k])
        raise DataError(f"was saved with another model or cache ({', '.join(diff) or 'identity'} differ)")
    _int(header["kv_budget"], "kv_budget", 1, MAX_CELLS)
    n_past = _int(header["n_past"], "n_past", 0, MAX_CELLS)
    tokens = header["tokens"]
    n_vocab = session.model.info.n_vocab
    if type(tokens) is not list or len(tokens) != n_past:
        raise _Refused("tokens", f"must be a list of n_past = {n_past} tokens")
    bad = next((i for i, t in enumerate(tokens) if type(t) is not int or not 0 <= t < n_vocab), None)
    if bad is not None:
        raise _Refused(f"tokens[{bad}]", f"= {_short(tokens[bad])} is not a token id in 0..{n_vocab - 1}")
    snap = _check_engine(header["engine"], session, n_past)
    _check_kv_cells(blobs["kv"], own_kv, snap["live"])
    decoder = _Decoder(_arrays(header["arrays"], blobs["arrays"]))
    policy = _check_policy(header["policy"], session, decoder)
    capture = _check_capture(header["capture"], session, decoder)
    if len(decoder.used) != len(decoder.arrays):
        raise _Refused("arrays", f"{len(decoder.arrays) - len(decoder.used)} of them are referenced nowhere")
    _check_scores(policy, session, snap["live"], n_past)
    return snap, list(tokens), n_past, policy, capture


def _try_kv(session, kv: bytes, live: list[int], own_kv: bytes) -> None:
    """The KV blob goes through llama.cpp's own reader: try it on this context, and put this session's own
    cells back when llama.cpp refuses it or restores other cells than the header says."""
    try:
        session.ctx.set_seq_state(kv, session.seq_id)
        cells = session.ctx.cell_positions(session.seq_id)
        if np.array_equal(np.sort(cells[cells >= 0]).astype(np.int64), np.asarray(live, dtype=np.int64)):
            return
        problem = "llama.cpp restored other cells than the live positions of the header"
    except EpikvError as e:
        problem = f"llama.cpp refused it ({first_line(e)})"
    try:
        if session.engine.n_live:
            session.ctx.set_seq_state(own_kv, session.seq_id)
        else:
            session.ctx.seq_rm_range(-1, -1, session.seq_id)
    except EpikvError as e:
        session.reset()
        problem += f"; this session's own cells could not be put back ({first_line(e)}), so it was reset"
    raise _Refused("kv", problem)


def load(session, path: str | os.PathLike) -> None:
    """Replace the session's sequence with the one saved in ``path``: everything is checked first; DataError
    naming the file and the field otherwise, with the session left as it was."""
    header, blobs = read(path)
    own_kv = session.ctx.seq_state(session.seq_id)
    try:
        try:
            snap, tokens, n_past, policy, capture = _validate(session, header, blobs, own_kv)
        except (_Refused, DataError):
            raise
        except Exception as e:  # noqa: BLE001 - a check this module missed still refuses the file, never crashes
            raise _Refused("state", f"could not be checked (internal check failed: {type(e).__name__}: "
                                    f"{first_line(e)})") from None
        _try_kv(session, blobs["kv"], snap["live"], own_kv)
    except _Refused as e:
        raise DataError(f"{path} is refused: {e.field} {e.message}") from None
    except DataError as e:
        raise DataError(f"{path} {e}") from None
    session.reset()
    try:
        session.ctx.set_seq_state(blobs["kv"], session.seq_id)
    except EpikvError as e:  # it was just accepted by this context: not expected
        session.reset()
        raise DataError(f"{path} is refused: kv llama.cpp refused it on the second read ({first_line(e)}); this "
                        "session was reset") from None
    session.engine.restore(snap)
    session.tokens = tokens
    session.n_past = n_past
    vars(session.policy).clear()
    vars(session.policy).update(vars(policy))
    session.capture.set_state(capture)
