"""Fuzzing of session files ("Hostile inputs", row 1): whatever the bytes, a load either succeeds with a valid
session or raises DataError leaving the session as it was, and never runs code.

The reference files are saved once per module (one per policy kind); each example only edits their bytes and
loads them. Cases: random byte flips and truncations (caught by the sha256), and, with the sha256 recomputed as an
attacker would, edits of the arrays and kv blobs, of any field of the JSON header (random JSON values, deletions,
unexpected keys, small integer shifts), of the arrays table, and wholly crafted headers. A malicious pickle (it
writes a marker file when unpickled) is planted among the values; an audit hook records any unpickling, exec,
compile or process spawn during a load.

Bounded: ``EPIKV_FUZZ_EXAMPLES`` examples per test (default 200), no deadline. A longer run:
``EPIKV_FUZZ_EXAMPLES=5000 pytest tests/engine/test_state_fuzz.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from epikv_local.engine import state as state_mod
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.sampling import Sampler, SamplingConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import DataError
from epikv_local.policies import make_policy

#: hostile values make the policies' numpy arithmetic overflow: expected, and not what is checked here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
EXAMPLES = int(os.environ.get("EPIKV_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
BUDGET = BudgetConfig(kv_budget=32, n_recent=8)
#: policies whose state covers every encoded kind: sub-policies, scorer, position scores and rows, online query
#: statistics, frozen configurations, functions (epikv_mix); a numpy generator (random); a deque (rkv)
KINDS = {"epikv_mix": ({"w_triattention": 1.0}, True), "random": ({}, True), "rkv": ({}, False)}
#: audit events that must never happen while a file is loaded
FORBIDDEN = {"pickle.find_class", "exec", "compile", "marshal.loads", "os.system", "os.exec", "os.posix_spawn",
             "os.spawn", "os.fork", "subprocess.Popen", "ctypes.dlopen", "os.remove", "os.rename"}
_AUDIT = {"on": False, "seen": []}


class Ref(dict):
    """The fixture's dict, with a short repr (hypothesis prints the arguments of a failing example)."""

    def __repr__(self):
        return f"<reference session file of {len(self['data'])} bytes>"


def _hook(event, args):
    if _AUDIT["on"] and event in FORBIDDEN:
        _AUDIT["seen"].append(event)


sys.addaudithook(_hook)


def split(data: bytes) -> tuple[dict, bytes, bytes]:
    (n,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16:16 + n])
    rest = data[16 + n:-32]
    return header, rest[:header["blobs"]["arrays"]], rest[header["blobs"]["arrays"]:]


def frame(head: bytes, rest: bytes) -> bytes:
    body = state_mod.MAGIC + struct.pack("<Q", len(head)) + head + rest
    return body + hashlib.sha256(body).digest()


def join(header, arrays: bytes, kv: bytes, fix_sizes: bool = True) -> bytes:
    if fix_sizes and isinstance(header, dict) and isinstance(header.get("blobs"), dict):
        header["blobs"].update(arrays=len(arrays), kv=len(kv))
    return frame(json.dumps(header).encode(), arrays + kv)


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def fingerprint(s) -> tuple:
    live = s.live_positions()
    cells = s.ctx.cell_positions()
    return (s.n_past, tuple(s.tokens), json.dumps(s.engine.snapshot(), sort_keys=True),
            tuple(np.sort(cells[cells >= 0]).tolist()), s.policy.score(live).tobytes(),
            tuple(None if r is None else r.tobytes() for r in (s.capture.state() or [])))


def assert_valid(s, model) -> None:
    """A session a file loaded into: consistent bookkeeping, cells, tokens; it scores and decodes on."""
    live = s.live_positions()
    cells = s.ctx.cell_positions()
    assert np.array_equal(np.sort(cells[cells >= 0]), live)
    assert len(s.tokens) == s.n_past and all(0 <= t < model.info.n_vocab for t in s.tokens)
    assert len(live) <= s.budget.kv_budget and (not len(live) or (live[0] >= 0 and live[-1] == s.n_past - 1))
    assert s.policy.score(live).shape == live.shape
    s.decode_chunk([s.tokens[-1] if s.tokens else 1])


@pytest.fixture(scope="module", params=sorted(KINDS))
def ref(request, model, tmp_path_factory):
    """(session, reference file bytes, work dir, marker, payload): a session past its budget, saved once."""
    options, flash = KINDS[request.param]
    d = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    s = Session(model, make_policy(request.param, **options), BUDGET, SessionConfig(n_threads=1, flash_attn=flash))
    s.feed(model.tokenize("The dragon counted the stars, one by one, all night long."), is_prompt=True)
    with Sampler(model, SamplingConfig()) as smp:
        for _ in range(40):
            s.decode_chunk([s.sample(smp)])
    assert s.stats().n_evicted > 0
    s.save_state(d / "ref.epikv")
    marker = d / "marker"
    yield Ref({"session": s, "data": (d / "ref.epikv").read_bytes(), "dir": d, "marker": marker,
           "payload": pickle.dumps(Payload(marker)), "model": model})
    s.close()
    assert not marker.exists()


def check_load(ref, data: bytes) -> str:
    """Load ``data`` into the reference session: success with a valid session, or DataError and nothing changed.
    Returns "ok" or "refused"."""
    s, p = ref["session"], ref["dir"] / "fuzzed.epikv"
    p.write_bytes(data)
    before = fingerprint(s)
    _AUDIT["on"], _AUDIT["seen"] = True, []
    try:
        s.load_state(p)
    except DataError as e:
        outcome = "refused"
        msg = str(e)
        assert str(p) in msg and "internal check failed" not in msg, msg
        assert fingerprint(s) == before, msg
    else:
        outcome = "ok"
    finally:
        _AUDIT["on"] = False
    assert not _AUDIT["seen"], f"a load ran {_AUDIT['seen']}"
    assert not ref["marker"].exists(), "a pickle in the file was run"
    if outcome == "ok":
        assert_valid(s, ref["model"])
    return outcome


# -- raw bytes: the sha256 catches these ---------------------------------------------------------------------
@pytest.mark.parametrize("ref", ["epikv_mix"], indirect=True)  # stopped by the sha256: one kind is enough
@FUZZ
@given(data=st.data())
def test_fuzz_byte_flips(ref, data):
    raw = bytearray(ref["data"])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.one_of(st.integers(0, 4096), st.integers(0, len(raw) - 1)).filter(lambda i: i < len(raw)))
        raw[i] ^= data.draw(st.integers(1, 255))
    assume(bytes(raw) != ref["data"])  # two flips of one byte can cancel out
    assert check_load(ref, bytes(raw)) == "refused"


@pytest.mark.parametrize("ref", ["epikv_mix"], indirect=True)  # stopped by the sha256: one kind is enough
@FUZZ
@given(data=st.data())
def test_fuzz_truncations_and_appends(ref, data):
    raw = ref["data"]
    cut = data.draw(st.one_of(st.integers(0, 64), st.integers(0, len(raw) - 1)))
    tail = data.draw(st.one_of(st.just(b""), st.binary(max_size=64), st.just(ref["payload"])))
    out = raw[:cut] + tail
    assume(out != raw)
    assert check_load(ref, out) == "refused"


# -- the sha256 recomputed: everything behind it is checked too ----------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzz_redigested_blob_edits(ref, data):
    header, arrays, kv = split(ref["data"])
    which = data.draw(st.sampled_from(["arrays", "kv", "kv_head", "replace", "resize"]))
    arrays, kv = bytearray(arrays), bytearray(kv)
    if which == "replace":
        blob = data.draw(st.one_of(st.just(ref["payload"]), st.binary(max_size=256)))
        if data.draw(st.booleans()):
            arrays = blob
        else:
            kv = blob
    elif which == "resize":
        k = data.draw(st.integers(-64, 64))
        kv = kv[:len(kv) + k] if k < 0 else kv + bytes(k)
    else:
        buf = arrays if which == "arrays" else kv
        hi = min(len(buf), 16 + 16 * len(header["engine"]["live"]) + 64) if which == "kv_head" else len(buf)
        for _ in range(data.draw(st.integers(1, 6))):
            i = data.draw(st.integers(0, hi - 1))
            buf[i] ^= data.draw(st.integers(1, 255))
    check_load(ref, join(header, bytes(arrays), bytes(kv)))


def json_values(payload: bytes):
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                        st.sampled_from(["$array", "$object", "$function", "PCG64", "|O", "<f8", "epikv_mix",
                                         "builtins.exec", "os.system", payload.hex(), payload.decode("latin-1")]))
    tags = st.one_of(
        st.builds(lambda i: {"$array": i}, st.integers(-2, 40)),
        st.builds(lambda i: {"$scalar": i}, st.integers(-2, 40)),
        st.builds(lambda n: {"$object": n, "attrs": {}}, st.sampled_from(["PositionRows", "QueryStats", "Payload",
                                                                          "EpikvPolicy", "PositionScores"])),
        st.builds(lambda n: {"$function": n}, st.sampled_from(["builtins.exec", "os.system", "posix.system"])),
        st.builds(lambda v: {"$tuple": v}, st.lists(scalars, max_size=3)),
        st.builds(lambda v: {"$deque": v, "maxlen": 2}, st.lists(scalars, max_size=3)),
        st.builds(lambda v: {"$dict": [[v, v]]}, scalars),
    )
    return st.recursive(st.one_of(scalars, tags),
                        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


def paths(node, at=()):
    """Every path into a JSON tree (long lists: their first, last and a few middle items)."""
    yield at
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, at + (k,))
    elif isinstance(node, list):
        idx = range(len(node)) if len(node) <= 8 else sorted({0, 1, len(node) // 2, len(node) - 2, len(node) - 1})
        for i in idx:
            yield from paths(node[i], at + (i,))


@FUZZ
@given(data=st.data())
def test_fuzz_header_field_edits(ref, data):
    header, arrays, kv = split(ref["data"])
    where = data.draw(st.sampled_from(sorted(set(paths(header)), key=repr)))
    op = data.draw(st.sampled_from(["replace", "replace", "shift", "delete", "add"]))
    parent = header
    for k in where[:-1]:
        parent = parent[k]
    if not where:
        header = data.draw(json_values(ref["payload"]))
    elif op == "shift" and type(parent[where[-1]]) is int:
        parent[where[-1]] += data.draw(st.integers(-3, 3))
    elif op == "delete":
        del parent[where[-1]]
    elif op == "add" and isinstance(parent[where[-1]], dict):
        parent[where[-1]][data.draw(st.text(max_size=8))] = data.draw(json_values(ref["payload"]))
    elif op == "add" and isinstance(parent[where[-1]], list):
        parent[where[-1]].append(data.draw(json_values(ref["payload"])))
    else:
        parent[where[-1]] = data.draw(json_values(ref["payload"]))
    check_load(ref, join(header, arrays, kv, fix_sizes=data.draw(st.booleans())))


DTYPE_NAMES = sorted(state_mod.DTYPES) + ["|O", "O", "<U8", "|S4", "|V8", ">f8", "float64", "<M8[s]", "", None, 3]


@FUZZ
@given(data=st.data())
def test_fuzz_crafted_headers(ref, data):
    header, arrays, kv = split(ref["data"])
    kind = data.draw(st.sampled_from(["table", "table", "sizes", "random_header", "raw_header"]))
    if kind == "table":  # a crafted arrays table over the same bytes
        entry = st.fixed_dictionaries({
            "dtype": st.sampled_from(DTYPE_NAMES),
            "shape": st.one_of(st.lists(st.integers(-1, 300), max_size=4), st.lists(st.integers(0, 2**40), max_size=2),
                               st.just([len(arrays) // 8])),
            "order": st.sampled_from(["C", "F", "X"])})
        i = data.draw(st.integers(0, len(header["arrays"])))
        table = header["arrays"]
        if i < len(table) and data.draw(st.booleans()):
            table[i] = data.draw(entry)
        else:
            table.insert(i, data.draw(entry))
        check_load(ref, join(header, arrays, kv))
    elif kind == "sizes":  # blob sizes that split the same bytes elsewhere
        total = len(arrays) + len(kv)
        a = data.draw(st.integers(0, total))
        header["blobs"] = {"arrays": a, "kv": total - a}
        rest = arrays + kv
        check_load(ref, join(header, rest[:a], rest[a:], fix_sizes=False))
    elif kind == "random_header":  # any JSON where the header should be, framing and sha256 right
        check_load(ref, join(data.draw(json_values(ref["payload"])), arrays, kv, fix_sizes=False))
    else:  # bytes that are not JSON (or not UTF-8), or deeply nested
        head = data.draw(st.one_of(st.binary(max_size=64), st.just(b"[" * 100000), st.just(b'{"version": NaN}'),
                                   st.just(b'{"version": 3, "blobs": {"arrays": 1e400, "kv": -1}}'),
                                   st.just(ref["payload"])))
        assert check_load(ref, frame(head, arrays + kv)) == "refused"


def test_fuzz_reference_file_loads(ref):
    """The unedited reference file loads (the fuzz runs against a file that is valid to begin with)."""
    assert check_load(ref, ref["data"]) == "ok"
