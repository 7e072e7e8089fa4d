"""Saving and restoring a sequence with holes (llama.cpp's sequence state API + the engine's bookkeeping)."""

from __future__ import annotations

import numpy as np
import pytest

from epikv_local.engine.sampling import Sampler, SamplingConfig
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import DataError
from epikv_local.policies import make_policy

BUDGET = BudgetConfig(kv_budget=64, n_recent=16)


def session(model, policy="epikv"):
    return Session(model, make_policy(policy), BUDGET, SessionConfig(n_threads=1))


def continue_greedy(s, model, n):
    """n greedy steps; returns the logits of each step and the tokens."""
    logits, toks = [], []
    with Sampler(model, SamplingConfig()) as smp:
        for _ in range(n):
            logits.append(s.logits().copy())
            t = s.sample(smp)
            toks.append(t)
            s.decode_chunk([t])
    return np.stack(logits), toks


def test_saved_conversation_continues_with_identical_logits(model, tmp_path):
    prompt = model.tokenize("Write a long story about a dragon who learns to count.")
    a = session(model)
    a.feed(prompt, is_prompt=True)
    continue_greedy(a, model, 120)  # well past the budget: the cache has holes
    st = a.stats()
    assert st.n_evicted > 0 and st.n_live <= 64
    path = tmp_path / "conv.epikv"
    a.save_state(path)
    turn = model.tokenize(" Then the dragon met a wizard.", add_special=False)
    a.feed(turn)  # the next turn arrives: its tokens are decoded, then the answer is generated
    ref_logits, ref_toks = continue_greedy(a, model, 24)
    a.close()

    b = session(model)
    b.load_state(path)
    assert b.stats().n_live == st.n_live and b.n_past == st.n_past
    cells = b.ctx.cell_positions()
    assert np.array_equal(b.live_positions(), np.sort(cells[cells >= 0]))  # the holes came back as holes
    b.feed(turn)
    logits, toks = continue_greedy(b, model, 24)
    b.close()
    assert toks == ref_toks
    np.testing.assert_array_equal(logits, ref_logits)


def test_bad_state_files_are_refused(model, tmp_path):
    a = session(model)
    a.feed(model.tokenize("Hello there, general."), is_prompt=True)
    good = tmp_path / "good.epikv"
    a.save_state(good)
    data = good.read_bytes()
    cases = {"truncated": data[: len(data) - 100], "foreign": b"PK\x03\x04" + data[4:], "empty": b"",
             "corrupted": data[:-10] + bytes(10)}
    for name, blob in cases.items():
        p = tmp_path / f"{name}.epikv"
        p.write_bytes(blob)
        with pytest.raises(DataError):
            a.load_state(p)
    with pytest.raises(DataError, match="not found|cannot read"):
        a.load_state(tmp_path / "missing.epikv")
    # the session is untouched by the refused files and still continues
    before = a.stats().n_live
    a.feed(model.tokenize(" More.", add_special=False))
    continue_greedy(a, model, 3)
    assert a.stats().n_live > before
    with pytest.raises(DataError, match="policy"):
        session(model, "streaming").load_state(good)
    a.close()


def test_llama_save_and_load_session(model_path, tmp_path):
    from epikv_local import Llama

    msgs = [{"role": "user", "content": "Write a long story about a dragon who learns to count."}]
    with Llama(model_path=str(model_path), kv_budget=64, n_threads=1) as a:
        a.create_chat_completion(messages=msgs, max_tokens=80, temperature=0)
        a.save_session(tmp_path / "chat.epikv")
        more = msgs + [{"role": "user", "content": "Go on."}]
        ref = a.create_chat_completion(messages=more, max_tokens=12, temperature=0)
    with Llama(model_path=str(model_path), kv_budget=64, n_threads=1) as b:
        b.load_session(tmp_path / "chat.epikv")
        got = b.create_chat_completion(messages=more, max_tokens=12, temperature=0)
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert got["epikv"]["prompt_tokens_reused"] == ref["epikv"]["prompt_tokens_reused"] > 0


# -- "Hostile inputs", row 1: a session file is data, checked whole before anything is applied --------------------
import ast
import hashlib
import json
import pickle
import struct
from pathlib import Path

from epikv_local.engine import state as state_mod


def split(data: bytes) -> tuple[dict, bytes]:
    """(header, arrays blob + kv blob) of a session file."""
    (n,) = struct.unpack("<Q", data[8:16])
    return json.loads(data[16:16 + n]), data[16 + n:-32]


def join(header: dict, rest: bytes) -> bytes:
    """A session file of ``header`` and the blobs ``rest``, framed and with its sha256 recomputed (what an
    attacker who edits a file does)."""
    head = json.dumps(header).encode()
    body = state_mod.MAGIC + struct.pack("<Q", len(head)) + head + rest
    return body + hashlib.sha256(body).digest()


class Payload:
    """Unpickling this writes ``marker``: any unpickle of a file's bytes would show."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def fingerprint(s) -> tuple:
    """What a refused load must leave unchanged: sequence, bookkeeping, cells, policy scores, capture rows."""
    live = s.live_positions()
    cells = s.ctx.cell_positions()
    cap = s.capture.state() or []
    return (s.n_past, tuple(s.tokens), json.dumps(s.engine.snapshot(), sort_keys=True),
            tuple(np.sort(cells[cells >= 0]).tolist()), s.policy.score(live).tobytes(),
            tuple(None if r is None else r.tobytes() for r in cap))


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """A session past its budget (holes in the cache), saved once; the session stays open for the tests."""
    d = tmp_path_factory.mktemp("state")
    a = session(model)
    a.feed(model.tokenize("Once upon a time a dragon learned to count the stars."), is_prompt=True)
    continue_greedy(a, model, 70)
    assert a.stats().n_evicted > 0
    path = d / "good.epikv"
    a.save_state(path)
    yield {"dir": d, "path": path, "data": path.read_bytes(), "session": a}
    a.close()


def array_ref(node, *attrs) -> int:
    """The arrays-table index of policy.state.<attrs...> (an encoded array)."""
    for a in attrs:
        node = node["attrs"][a]
    return node["$array"]


def test_row1_session_file_code_uses_no_unpickler():
    tree = ast.parse(Path(state_mod.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "importlib"}
    text = Path(state_mod.__file__).read_text()
    assert "np.load(" not in text and "allow_pickle" not in text and "__import__" not in text


def test_row1_malicious_pickle_is_never_executed(saved, model, tmp_path):
    a, good = saved["session"], saved["data"]
    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(marker))
    header, rest = split(good)
    kv = rest[header["blobs"]["arrays"]:]
    before = fingerprint(a)
    # the file: the pre-fix layout (format 2) whose pickled "running" blob is replaced, sha256 recomputed
    v2 = {k: header[k] for k in ("model", "kv_budget", "n_past", "tokens", "engine")}
    v2.update(version=2, policy=a.policy.name,
              blobs=[{"name": "running", "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
                     {"name": "kv", "bytes": len(kv), "sha256": hashlib.sha256(kv).hexdigest()}])
    head = json.dumps(v2).encode()
    files = {"format2": state_mod.MAGIC + struct.pack("<Q", len(head)) + head + payload + kv}
    # format 3 with the pickle in its arrays blob, its kv blob, and named by the state tree
    h = json.loads(json.dumps(header))
    h["blobs"]["arrays"] = len(payload)
    h["arrays"] = [{"dtype": "|u1", "shape": [len(payload)], "order": "C"}]
    files["pickle_as_arrays"] = join(h, payload + kv)
    h = json.loads(json.dumps(header))
    h["arrays"][0]["dtype"] = "|O"
    files["object_dtype"] = join(h, rest)
    h = json.loads(json.dumps(header))
    h["blobs"]["kv"] = len(payload)
    files["pickle_as_kv"] = join(h, rest[:header["blobs"]["arrays"]] + payload)
    for tag in ({"$object": "Payload", "attrs": {"marker": str(marker)}}, {"$function": "builtins.exec"},
                {"$frozen": "Payload", "fields": {}}, {"$rng": "PCG64", "state": payload.hex()},
                {"$pickle": payload.hex()}):
        h = json.loads(json.dumps(header))
        h["policy"]["state"]["attrs"]["_scores"] = tag
        files[f"tag {next(iter(tag))}"] = join(h, rest)
    for name, data in files.items():
        p = tmp_path / f"{name}.epikv"
        p.write_bytes(data)
        with pytest.raises(DataError) as e:
            a.load_state(p)
        assert str(p) in str(e.value), name
        assert not marker.exists(), f"{name}: the file's pickle ran"
        assert fingerprint(a) == before, name
    with pytest.raises(DataError, match="format 2.*reads only 3"):
        a.load_state(tmp_path / "format2.epikv")


def _edit(path_in_header, value):
    def f(h):
        node = h
        for k in path_in_header[:-1]:
            node = node[k]
        node[path_in_header[-1]] = value(h) if callable(value) else value
    return f


def _delete(*path_in_header):
    def f(h):
        node = h
        for k in path_in_header[:-1]:
            node = node[k]
        del node[path_in_header[-1]]
    return f


def _shift_into_hole(live):
    """Move one live position (not the newest) back into the hole before it: still a valid-looking list."""
    i = next(i for i in range(1, len(live) - 1) if live[i] - 1 > live[i - 1])
    live[i] -= 1


def _apply(*edits):
    def f(h):
        for e in edits:
            e(h)
    return f


EDITS = {
    # tokens: ids in 0..n_vocab-1, one per position
    "token_beyond_vocab": (_edit(("tokens", 3), lambda h: h["model"]["n_vocab"]), "tokens"),
    "token_negative": (_edit(("tokens", 0), -1), "tokens"),
    "token_float": (_edit(("tokens", 1), 1.5), "tokens"),
    "token_bool": (_edit(("tokens", 1), True), "tokens"),
    "token_text": (_edit(("tokens",), "hello"), "tokens"),
    "tokens_short": (lambda h: h["tokens"].pop(), "tokens"),
    # n_past: right after the newest live position
    "n_past_plus_one": (_apply(_edit(("n_past",), lambda h: h["n_past"] + 1), lambda h: h["tokens"].append(1)),
                        "n_past"),
    "n_past_minus_one": (_apply(_edit(("n_past",), lambda h: h["n_past"] - 1), lambda h: h["tokens"].pop()),
                         "engine.live"),
    "n_past_negative": (_edit(("n_past",), -1), "n_past"),
    "n_past_text": (_edit(("n_past",), "12"), "n_past"),
    # live positions: strictly increasing ints in 0..n_past-1, the cells of the kv blob
    "live_reversed": (lambda h: h["engine"]["live"].reverse(), "engine.live"),
    "live_duplicate": (_edit(("engine", "live", 1), lambda h: h["engine"]["live"][0]), "engine.live"),
    "live_negative": (_edit(("engine", "live", 0), -1), "engine.live"),
    "live_beyond_n_past": (_apply(_edit(("engine", "live", -1), lambda h: h["n_past"] + 5),
                                  _edit(("engine", "newest"), lambda h: h["n_past"] + 5)), "engine.live"),
    "live_not_int": (_edit(("engine", "live", 2), "7"), "engine.live"),
    "live_dropped": (lambda h: h["engine"]["live"].pop(5), "kv"),
    "live_shifted": (lambda h: _shift_into_hole(h["engine"]["live"]), "kv"),
    "live_over_budget": (_edit(("engine", "live"), lambda h: list(range(h["n_past"] - 65, h["n_past"]))),
                         "budget"),
    # newest: the last live position
    "newest_negative": (_edit(("engine", "newest"), -3), "engine.newest"),
    "newest_not_last": (_edit(("engine", "newest"), lambda h: h["engine"]["live"][-2]), "engine.newest"),
    "newest_float": (_edit(("engine", "newest"), lambda h: float(h["engine"]["newest"])), "engine.newest"),
    "prompt_end_beyond": (_edit(("engine", "prompt_end"), lambda h: h["n_past"] + 1), "engine.prompt_end"),
    "recent_window_huge": (_edit(("engine", "recent_window"), 10**6), "engine.recent_window"),
    "count_negative": (_edit(("engine", "stats", "n_evicted"), -1), "engine.stats.n_evicted"),
    # missing and unexpected keys
    **{f"missing_{k}": (_delete(k), f"lacks '{k}'") for k in state_mod.HEADER_KEYS},
    "missing_live": (_delete("engine", "live"), "engine lacks 'live'"),
    "missing_stats_count": (_delete("engine", "stats", "max_live"), "engine.stats lacks 'max_live'"),
    "missing_policy_state": (_delete("policy", "state"), "policy lacks 'state'"),
    "missing_model_arch": (_delete("model", "arch"), "another model"),
    "missing_blob_size": (_delete("blobs", "kv"), "blobs"),
    "unexpected_key": (_edit(("extra",), 1), "unexpected 'extra'"),
    "header_empty": (lambda h: h.clear(), "lacks 'version'"),
    # policy and its state
    "policy_renamed": (_edit(("policy", "name"), "streaming"), "policy"),
    "policy_setting": (_edit(("policy", "settings", "window"), 64), "policy.settings.window"),
    "state_setting": (_edit(("policy", "state", "attrs", "window", ), 64), "policy.state.window"),
    "state_attr_missing": (_delete("policy", "state", "attrs", "_scores"), "attributes differ"),
    "state_attr_extra": (_edit(("policy", "state", "attrs", "_evil"), 1), "attributes differ"),
    "state_wrong_type": (_edit(("policy", "state", "attrs", "_scorer", "attrs", "_n_seen"), "many"),
                         "policy.state._scorer._n_seen"),
    "state_negative_count": (_edit(("policy", "state", "attrs", "_scorer", "attrs", "_n_seen"), -4),
                             "policy.state._scorer._n_seen"),
    # an unknown tag (found by the fuzz test: it once reached the "$object" branch, an internal KeyError)
    "state_unknown_tag": (_edit(("policy", "state", "attrs", "_scorer"), {"$evil": "x"}),
                          "policy.state._scorer is not an encoded value"),
    "state_config_changed": (_edit(("policy", "state", "attrs", "_scorer", "attrs", "cfg", "fields", "window"), 7),
                             "policy.state._scorer.cfg.window"),
    "state_function_renamed": (_edit(("policy", "state", "attrs", "_scorer", "attrs", "_kernel", "$function"),
                                     "os.system"), "policy.state._scorer._kernel"),
    "state_array_dtype": (lambda h: h["arrays"][array_ref(h["policy"]["state"], "_scores", "values")].update(
        dtype="<f4", shape=[2 * h["arrays"][array_ref(h["policy"]["state"], "_scores", "values")]["shape"][0]]),
        "policy.state._scores.values"),
    "state_array_shape": (lambda h: h["arrays"][array_ref(h["policy"]["state"], "_scorer", "_buf")].update(
        shape=h["arrays"][array_ref(h["policy"]["state"], "_scorer", "_buf")]["shape"][::-1]),
        "policy.state._scorer._buf"),
    "array_referenced_twice": (_edit(("policy", "state", "attrs", "_scorer", "attrs", "_smooth_prefix"),
                                     lambda h: h["policy"]["state"]["attrs"]["_scorer"]["attrs"]["_buf"]),
                               "a second time"),
    "array_dtype_not_allowed": (_edit(("arrays", 0, "dtype"), "<U8"), "arrays[0].dtype"),
    "array_table_too_long": (lambda h: h["arrays"].append({"dtype": "<f8", "shape": [1], "order": "C"}), "arrays"),
    "capture_row_shape": (lambda h: h["arrays"][h["capture"][0]["$array"]].update(
        dtype="<f8", shape=[h["arrays"][h["capture"][0]["$array"]]["shape"][0] // 2]), "capture[0]"),
    "capture_too_many_rows": (lambda h: h["capture"].append(None), "capture"),
    "model_changed": (_edit(("model", "n_vocab"), 7), "another model"),
    "version_old": (_edit(("version",), 2), "format 2"),
    "version_text": (_edit(("version",), "3"), "format '3'"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_row1_edited_or_incomplete_headers_are_refused(saved, case, tmp_path):
    """Edited tokens / n_past / live / newest, missing keys and a tampered policy state: each is one DataError
    naming the file and the field, even with the sha256 recomputed, and the session is left as it was."""
    a, good = saved["session"], saved["data"]
    header, rest = split(good)
    edit, field = EDITS[case]
    edit(header)
    p = tmp_path / f"{case}.epikv"
    p.write_bytes(join(header, rest))
    before = fingerprint(a)
    with pytest.raises(DataError) as e:
        a.load_state(p)
    msg = str(e.value)
    assert str(p) in msg and field in msg, msg
    assert "internal check" not in msg, msg
    assert fingerprint(a) == before


def test_row1_refused_kv_blob_leaves_the_session_as_it_was(saved, model, tmp_path):
    """A kv blob whose cell table passes but that llama.cpp refuses (a layer header edited) is undone: the session
    keeps its cells and continues exactly as a fresh copy of the good file does."""
    a, good = saved["session"], saved["data"]
    header, rest = split(good)
    kv_at = header["blobs"]["arrays"]
    table_end = kv_at + 16 + 12 * len(header["engine"]["live"])  # magic, seq, streams, count, cells
    bad = bytearray(rest)
    bad[table_end] ^= 0x07  # v_trans
    p = tmp_path / "kv.epikv"
    p.write_bytes(join(header, bytes(bad)))
    before = fingerprint(a)
    with pytest.raises(DataError, match="kv llama.cpp refused"):
        a.load_state(p)
    assert fingerprint(a) == before
    turn = model.tokenize(" The end.", add_special=False)
    a.load_state(saved["path"])
    b = session(model)
    b.load_state(saved["path"])
    for s in (a, b):
        s.feed(turn)
    la, ta = continue_greedy(a, model, 6)
    lb, tb = continue_greedy(b, model, 6)
    b.close()
    a.load_state(saved["path"])  # back to the saved state for the other tests
    assert ta == tb
    np.testing.assert_array_equal(la, lb)


def test_save_refuses_state_that_is_not_data(model, tmp_path):
    s = session(model, "streaming")
    s.feed(model.tokenize("Hello there."), is_prompt=True)
    s.policy.extra = {1, 2}  # a set: not one of the data types a session file holds
    before = fingerprint(s)
    with pytest.raises(DataError, match=r"policy\.extra is a builtins\.set"):
        s.save_state(tmp_path / "x.epikv")
    assert not (tmp_path / "x.epikv").exists()
    assert fingerprint(s) == before
    s.close()


@pytest.mark.parametrize("name,options,flash", [
    ("random", {}, True),                                   # a numpy generator
    ("lagkv", {}, True),                                    # dicts keyed by numpy integers
    ("epikv_mix", {"w_triattention": 1.0}, True),           # sub-policies, position rows, online query statistics
    ("rkv", {}, False),                                     # a deque of attention rows (flash attention off)
    ("said_epikv", {}, True),                               # a base policy and the given/generated marks
    ("facts", {}, True),                                    # a base policy and the engine's digit marks
    ("said_words", {}, True),                               # the given marks and the template's
    ("said_words_deep", {}, True),                          # and the surprise order and the prompt still to come
])
def test_every_kind_of_policy_state_round_trips(model, tmp_path, name, options, flash):
    mk = lambda: Session(model, make_policy(name, **options), BudgetConfig(kv_budget=40, n_recent=8),
                         SessionConfig(n_threads=1, flash_attn=flash))
    a = mk()
    prompt = model.tokenize("A short story about counting stars:")
    a.feed(prompt, is_prompt=True, template=[i < 3 for i in range(len(prompt))])  # as a chat template's marks
    continue_greedy(a, model, 50)
    assert a.stats().n_evicted > 0
    a.save_state(tmp_path / "s.epikv")
    turn = model.tokenize(" And then?", add_special=False)
    a.feed(turn, is_prompt=True)  # a later turn: given text, marked as such
    ref, ref_toks = continue_greedy(a, model, 8)
    a.close()
    b = mk()
    b.load_state(tmp_path / "s.epikv")
    b.feed(turn, is_prompt=True)
    got, toks = continue_greedy(b, model, 8)
    b.close()
    assert toks == ref_toks
    np.testing.assert_array_equal(got, ref)
