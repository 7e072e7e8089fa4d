"""End-to-end generation under a KV budget on the real model (SmolLM2-135M, flash attention on)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from epikv_local.engine.budget import BudgetConfig, BudgetError
from epikv_local.api.chat import apply_chat_template, tokenize_prompt
from epikv_local.api.generation import generate
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.policies import make_policy
from epikv_local.engine.selection import select_evictions
from epikv_local.engine.session import Session, SessionConfig

PROMPT = "Explain step by step how to compute 17 * 23, then check the result."


@pytest.fixture(scope="module")
def prompt_tokens(model):
    return tokenize_prompt(model, apply_chat_template(model, PROMPT))


def run(model, policy, budget, tokens, max_tokens, route="layer_out", record=False, ignore_eog=True, **kw):
    with Session(model, make_policy(policy), budget, SessionConfig(capture_route=route, **kw), record=record) as s:
        res = generate(s, tokens, max_tokens, SamplingConfig(), ignore_eog=ignore_eog)
        return res, SimpleNamespace(**vars(s.stats()), events=s.events)


@pytest.mark.parametrize("route", ["layer_out", "callback"])
def test_large_budget_is_token_identical_to_plain(model, prompt_tokens, route):
    budget = BudgetConfig(kv_budget=512)
    plain, pstats = run(model, "none", budget, prompt_tokens, 120)
    epikv, estats = run(model, "epikv", budget, prompt_tokens, 120, route=route)
    assert estats.n_evicted == 0 and pstats.n_evicted == 0
    assert epikv.tokens == plain.tokens
    assert epikv.stats.flash_attn and plain.stats.flash_attn


def test_small_budget_long_generation(model, prompt_tokens):
    B = 160
    budget = BudgetConfig(kv_budget=B, n_sink=4, n_recent=64, evict_chunk=16)
    res, stats = run(model, "epikv", budget, prompt_tokens, 2000, record=True)
    assert res.stats.n_generated_tokens == 2000
    assert stats.max_live <= B
    assert stats.n_evicted >= 2000 + len(prompt_tokens) - B
    assert res.stats.flash_attn
    n_prompt = len(prompt_tokens)
    for ev in stats.events:
        # protected: sinks, recent window, prompt
        newest = ev.positions.max()
        assert not np.isin(ev.evicted, np.arange(4)).any()
        assert not (ev.evicted > newest - 64).any()
        assert not (ev.evicted < n_prompt).any()
        # exactly the lowest-scoring unprotected positions (ties: older first)
        expect = select_evictions(ev.positions, ev.scores, ev.protected, len(ev.evicted))
        assert np.array_equal(expect, ev.evicted)
        cand = ~ev.protected
        kept_scores = ev.scores[cand & ~np.isin(ev.positions, ev.evicted)]
        if len(kept_scores) and len(ev.evicted):
            worst_kept = np.nanmin(kept_scores)
            evicted_scores = ev.scores[np.isin(ev.positions, ev.evicted)]
            assert np.all(np.nan_to_num(evicted_scores, nan=-np.inf) <= worst_kept)


def test_streaming_policy_evicts_oldest(model, prompt_tokens):
    budget = BudgetConfig(kv_budget=128, n_sink=4, n_recent=32, protect_prompt=False)
    res, stats = run(model, "streaming", budget, prompt_tokens, 300, record=True)
    assert stats.max_live <= 128
    for ev in stats.events:
        cand = np.sort(ev.positions[~ev.protected])
        assert np.array_equal(ev.evicted, cand[: len(ev.evicted)])


def test_unprotected_long_prompt_is_prefilled_in_chunks(model, dev_traces):
    tr = max(dev_traces[:5], key=lambda t: len(t["trace"]))
    toks = model.tokenize(tr["problem"] + "\n" + tr["trace"])[:700]
    assert len(toks) == 700
    budget = BudgetConfig(kv_budget=256, protect_prompt=False)
    res, stats = run(model, "epikv", budget, toks, 20)
    assert stats.max_live <= 256 and stats.n_evicted >= 700 - 256


def test_protected_prompt_too_long_is_a_clear_error(model, dev_traces):
    tr = max(dev_traces[:5], key=lambda t: len(t["trace"]))
    toks = model.tokenize(tr["trace"])[:400]
    assert len(toks) == 400
    with pytest.raises(BudgetError, match="does not fit kv_budget"):
        run(model, "epikv", BudgetConfig(kv_budget=256), toks, 5)


def test_policy_none_reports_full_budget(model, prompt_tokens):
    with pytest.raises(BudgetError, match="does not evict"):
        run(model, "none", BudgetConfig(kv_budget=96), prompt_tokens, 200)


def test_default_recent_window_yields_to_a_protected_prompt(model, prompt_tokens):
    """With recent_fraction (no explicit n_recent) the recent window shrinks to what the protected prompt
    leaves; an explicit n_recent that does not fit stays an error."""
    n_prompt = len(prompt_tokens)
    B = n_prompt + 40
    budget = BudgetConfig(kv_budget=B, recent_fraction=0.75)
    assert n_prompt + budget.recent_window + 1 > B  # would not fit as such
    res, stats = run(model, "epikv", budget, prompt_tokens, 120, record=True)
    assert stats.max_live <= B and stats.n_evicted > 0
    for ev in stats.events:
        assert not (ev.evicted < n_prompt).any()
    with pytest.raises(BudgetError, match="does not fit kv_budget"):
        run(model, "epikv", BudgetConfig(kv_budget=B, n_recent=60), prompt_tokens, 20)
