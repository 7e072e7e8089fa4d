"""The ``facts`` policy: numbers and the tokens beside them outrank the rest; unit tests on synthetic marks, then
a counted prompt on the real model where the prompt's numbers survive evictions that EPIKV makes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from epikv_local.errors import ConfigError
from epikv_local.policies import ModelShape, Observation, make_policy

SHAPE = ModelShape(n_layer=30, n_embd=576, n_head=9, n_head_kv=3)


def fed(policy, n: int, numeric: list[int], chunk: int = 4):
    """Observe positions 0..n-1 in chunks, ``numeric`` marked; returns the policy."""
    policy.bind(SHAPE)
    for start in range(0, n, chunk):
        pos = np.arange(start, min(n, start + chunk), dtype=np.int64)
        policy.observe(Observation(positions=pos, numeric=np.isin(pos, numeric)))
    return policy


def test_numbers_and_their_neighbours_outrank_the_rest():
    # 7 and 8 are numeric (a two-digit number split over a chunk boundary), 15 alone
    s = fed(make_policy("facts", base="streaming"), 20, [7, 8, 15]).score(np.arange(20))
    tier = [6, 7, 8, 9, 14, 15, 16]
    assert np.flatnonzero(s >= 2.0).tolist() == tier
    assert np.all(np.diff(s[tier]) < 0)  # oldest kept longest
    rest = [i for i in range(20) if i not in tier]
    assert np.all(np.diff(s[rest]) > 0)  # the streaming base: newer = keep
    assert s[rest].max() <= 1.0


def test_context_zero_marks_only_the_numbers_and_base_order_follows_the_base():
    s = fed(make_policy("facts", base="streaming", context=0, order="base"), 20, [7, 8, 15]).score(np.arange(20))
    assert np.flatnonzero(s >= 2.0).tolist() == [7, 8, 15]
    assert s[15] > s[8] > s[7]  # the base's order within the tier


def test_share_bounds_the_tier():
    s = fed(make_policy("facts", base="streaming", share=0.2), 20, [2, 5, 8, 11]).score(np.arange(20))
    assert np.flatnonzero(s >= 2.0).tolist() == [1, 2, 3, 4]  # round(0.2 * 20) = 4, the oldest first


def test_without_marks_it_is_its_base():
    p = make_policy("facts", base="streaming")
    p.bind(SHAPE)
    p.observe(Observation(positions=np.arange(10, dtype=np.int64)))  # numeric None: nothing marked
    s = p.score(np.arange(10))
    assert np.array_equal(np.argsort(s), np.arange(10)) and s.max() <= 1.0


def test_a_redecoded_position_is_marked_afresh_and_state_copies():
    p = fed(make_policy("facts", base="streaming", context=0), 8, [5])
    p.observe(Observation(positions=np.array([5], dtype=np.int64), numeric=np.array([False])))
    assert p.score(np.arange(8)).max() <= 1.0
    q = make_policy("facts", base="streaming", context=0)
    q.bind(SHAPE)
    vars(q).update(copy.deepcopy(vars(p)))
    assert np.array_equal(q.score(np.arange(8)), p.score(np.arange(8)))


def test_it_asks_for_the_digit_marks():
    assert make_policy("facts").bind(SHAPE).numbers
    assert not make_policy("epikv").bind(SHAPE).numbers


@pytest.mark.parametrize("bad", [{"base": "h2o"}, {"share": 1.5}, {"context": -1}, {"order": "newest"}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError, match="facts"):
        make_policy("facts", **bad)


def test_the_prompts_numbers_survive_where_epikv_evicts_them(model, kept_of_counted_prompt):
    """A counted prompt with numbers early in it, then 200 generated tokens at a budget of 96 cells: ``facts``
    keeps every digit of the prompt (and the engine marked exactly the tokens whose text has a digit); EPIKV
    evicts some of them."""
    prompt = model.tokenize("A farm has 37 cows and 52 sheep; each cow eats 9 kg a day. "
                            "Tell me a long story about the farm and its animals.")
    digits = [i for i, t in enumerate(prompt) if any(c.isdigit() for c in model.token_bytes(t).decode("utf-8", "replace"))]
    assert len(digits) >= 3
    kept = {name: kept_of_counted_prompt(name, prompt, digits) for name in ("facts", "epikv")}
    assert kept["facts"] == 1.0
    assert kept["epikv"] < 1.0
