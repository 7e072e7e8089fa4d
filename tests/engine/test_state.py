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
