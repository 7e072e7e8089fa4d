"""Eviction on quantized KV caches (q8_0, q4_0 need flash attention on for V, which EPIKV keeps)."""

from __future__ import annotations

import pytest

from epikv_local.api.chat import apply_chat_template, tokenize_prompt
from epikv_local.api.generation import generate
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import ConfigError
from epikv_local.policies import make_policy


@pytest.fixture(scope="module")
def prompt(model):
    return tokenize_prompt(model, apply_chat_template(model, "Write a long story about a dragon."))


def run(model, prompt, policy, budget, kv_type, n=160):
    with Session(model, make_policy(policy), budget, SessionConfig(type_k=kv_type, type_v=kv_type, n_threads=1)) as s:
        res = generate(s, prompt, n, SamplingConfig(), ignore_eog=True)
        return res, s.stats()


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("policy", ["epikv", "streaming", "keydiff"])
def test_eviction_holds_the_budget_on_a_quantized_cache(model, prompt, policy, kv_type):
    res, st = run(model, prompt, policy, BudgetConfig(kv_budget=96, n_recent=32), kv_type)
    assert res.stats.n_generated_tokens == 160 and st.n_evicted > 0 and st.max_live <= 96
    assert st.flash_attn
    f16_bytes = run(model, prompt, policy, BudgetConfig(kv_budget=96, n_recent=32), "f16", n=4)[1].kv_bytes
    assert st.kv_bytes < f16_bytes * (0.6 if kv_type == "q8_0" else 0.35)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_large_budget_is_token_identical_to_no_eviction_at_the_same_type(model, prompt, kv_type):
    plain, _ = run(model, prompt, "none", BudgetConfig(kv_budget=512), kv_type, n=80)
    ours, st = run(model, prompt, "epikv", BudgetConfig(kv_budget=512), kv_type, n=80)
    assert st.n_evicted == 0 and ours.tokens == plain.tokens


def test_attention_policy_refuses_a_quantized_v_cache(model):
    with pytest.raises(ConfigError, match="quantizes the V cache"):
        Session(model, make_policy("h2o"), BudgetConfig(kv_budget=96),
                SessionConfig(flash_attn=False, type_v="q8_0", n_threads=1))
