"""The ``surprise`` policy: unit tests of its window score on synthetic surprisal; the engine's
``Observation.surprise`` against stock llama-cpp-python's logits; a surprising span of a counted prompt kept
where StreamingLLM evicts it."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from epikv_local.api.generation import generate
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import ConfigError
from epikv_local.policies import ModelShape, Observation, make_policy

SHAPE = ModelShape(n_layer=30, n_embd=576, n_head=9, n_head_kv=3)


def fed(policy, nll: np.ndarray, chunk: int = 4):
    """Observe positions 0..len(nll)-1 in chunks with surprisal ``nll``; returns the policy."""
    policy.bind(SHAPE)
    for start in range(0, len(nll), chunk):
        pos = np.arange(start, min(len(nll), start + chunk), dtype=np.int64)
        policy.observe(Observation(positions=pos, surprise=nll[pos]))
    return policy


def reference(nll: np.ndarray, positions: np.ndarray, w: int) -> np.ndarray:
    """The documented score, written out as loops."""
    def mean(q):
        vals = [nll[j] for j in range(q - w, q + w + 1) if 0 <= j < len(nll) and not np.isnan(nll[j])]
        return np.mean(vals) if vals else -np.inf
    out = np.array([max(mean(q) for q in range(p - w, p + w + 1)) for p in positions])
    return np.where(np.isfinite(out), out, np.nan)


@pytest.mark.parametrize("w", [0, 1, 3, 8])
def test_score_is_the_best_window_mean_covering_each_position(w):
    rng = np.random.default_rng(w)
    nll = rng.exponential(0.5, 60)
    nll[[0, 17, 18]] = np.nan  # a sequence's first token; two unknown
    p = fed(make_policy("surprise", window=w), nll)
    live = np.sort(rng.choice(60, 25, replace=False))
    assert np.allclose(p.score(live), reference(nll, live, w), equal_nan=True)


def test_a_surprising_span_is_kept_whole_with_its_unsurprising_head():
    nll = np.full(80, 0.2)
    nll[40:46] = [0.3, 4.0, 3.5, 3.8, 4.2, 3.9]  # the head of a code can be expected ("is 8" after "code")
    s = fed(make_policy("surprise", window=4), nll).score(np.arange(80))
    top = set(np.argsort(-s)[:14].tolist())
    assert set(range(40, 46)) <= top  # the whole span outranks the predictable text
    assert s[39] > s[10] and s[60] == pytest.approx(0.2)


def test_evicted_positions_keep_their_surprisal_and_unknown_scores_nan():
    nll = np.full(30, 1.0)
    p = fed(make_policy("surprise", window=2), nll)
    assert np.allclose(p.score(np.array([0, 15, 29])), 1.0)  # reach beyond the live set still counts
    assert np.isnan(p.score(np.array([100]))).all()  # never decoded, nothing in reach
    q = make_policy("surprise", window=2)
    q.bind(SHAPE)
    vars(q).update(copy.deepcopy(vars(p)))
    assert np.array_equal(q.score(np.arange(30)), p.score(np.arange(30)))
    p.reset()
    assert np.isnan(p.score(np.arange(30))).all()


def test_it_asks_for_surprisal_and_nothing_else():
    sig = make_policy("surprise").bind(SHAPE)
    assert sig.surprise and not (sig.g_layers or sig.key_layers or sig.query_layers or sig.attention_layers)
    assert not make_policy("epikv").bind(SHAPE).surprise


@pytest.mark.parametrize("bad", [{"window": -1}, {"window": 1.5}, {"window": 1000}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError, match="surprise"):
        make_policy("surprise", **bad)


class Recorder:
    """Wraps a policy's observe to keep every Observation's positions and surprisal."""

    def __init__(self, policy):
        self.seen: dict[int, float] = {}
        inner = policy.observe

        def observe(obs):
            self.seen.update(zip(obs.positions.tolist(), obs.surprise.tolist()))
            inner(obs)
        policy.observe = observe


def recorded_session(model):
    """(policy, its Recorder, a Session) of ``surprise`` at 128 cells, chunks of 8 tokens, the prompt counted."""
    policy = make_policy("surprise")
    rec = Recorder(policy)
    budget = BudgetConfig(kv_budget=128, n_recent=32, evict_chunk=8, protect_prompt=False)
    return policy, rec, Session(model, policy, budget, SessionConfig(n_threads=2, n_batch=8))


def test_engine_surprisal_matches_stock_llama_cpp(model, model_path):
    """Prompt tokens fed in chunks, then greedy tokens one by one: each token's Observation.surprise is
    -log softmax of the logits before it, as stock llama-cpp-python computes them (logits_all), within
    0.05 nats (two builds of the same source; flash attention on in both)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    text = "The cat sat on the mat. The secret code is 83921. The cat sat on the mat. The dog ran."
    prompt = model.tokenize(text)
    policy, rec, s = recorded_session(model)
    with s:
        s.feed(prompt, is_prompt=True)
        with s.sampling(SamplingConfig(temperature=0.0)) as sampler:
            for _ in range(6):
                s.feed([s.sample(sampler)])
        tokens = list(s.tokens)
    assert sorted(rec.seen) == list(range(len(tokens)))
    assert np.isnan(rec.seen[0])  # nothing before a sequence's first token
    stock = llama_cpp.Llama(model_path=str(model_path), n_ctx=256, logits_all=True, n_threads=2, verbose=False,
                            flash_attn=True)
    try:
        stock.eval(tokens)
        logits = np.asarray(stock.scores[:len(tokens)], dtype=np.float64)
    finally:
        stock.close()
    top = logits.max(axis=1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    want = lse[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]]
    got = np.array([rec.seen[i] for i in range(1, len(tokens))])
    assert np.abs(got - want).max() < 0.05, np.abs(got - want).max()
    assert got[len(prompt) - 1:].max() < got.max()  # greedy tokens are the expected ones; the code is not


def kept_in_counted_prompt(model, name: str, prompt: list[int], positions: list[int]) -> float:
    """The share of ``positions`` live after ``prompt`` is decoded counted against 96 cells (16 recent, chunks
    of 16 tokens, so the scorer chooses among most of the cache) and 100 greedy tokens follow."""
    budget = BudgetConfig(kv_budget=96, n_recent=16, evict_chunk=8, protect_prompt=False)
    with Session(model, make_policy(name), budget, SessionConfig(n_threads=2, n_batch=16)) as s:
        generate(s, prompt, 100, SamplingConfig(), ignore_eog=True)
        assert s.stats().max_live <= 96 and s.stats().n_evicted > 0
        return float(np.isin(positions, s.live_positions()).mean())


@pytest.mark.parametrize("name", ["surprise", "said_prompt_surprise"])
def test_a_surprising_span_of_a_counted_prompt_survives_where_streaming_evicts_it(model, name):
    """A counted prompt of predictable text (one sentence repeated) with a random code in its first half, then
    100 generated tokens at a budget of 96 cells: ``surprise`` keeps every digit of the code, StreamingLLM
    none. So does ``said_prompt_surprise`` (the prompt's tier ordered by surprise, EPIKV for the rest): the
    engine serves it EPIKV's captured rows and every token's logits together."""
    filler = "The cat sat on the mat. " * 8
    prompt = model.tokenize(filler + "The secret code is 83921. Remember it. " + filler * 2)
    text = [model.token_bytes(t).decode("utf-8", "replace") for t in prompt]
    digits = [i for i, t in enumerate(text) if any(c.isdigit() for c in t)]
    assert len(digits) >= 2 and len(prompt) > 150
    assert kept_in_counted_prompt(model, name, prompt, digits) == 1.0
    assert kept_in_counted_prompt(model, "streaming", prompt, digits) == 0.0


def test_a_rewind_that_drops_tokens_forgets_the_logits_and_the_dropped_branch(model):
    """After ``rewind_to_prefix`` drops tokens, the first token decoded again has no known logits before it (NaN,
    not the dropped branch's), and the policy no longer reads the dropped positions; a rewind to the very prompt
    fed last continues from the prompt's kept logits (a finite surprisal, equal to the first run's)."""
    prompt = model.tokenize("The cat sat on the mat. The secret code is 83921. The dog ran.")
    policy, rec, s = recorded_session(model)
    with s:
        s.feed(prompt, is_prompt=True)
        with s.sampling(SamplingConfig(temperature=0.0)) as sampler:
            first = s.sample(sampler)
            s.feed([first])
            s.feed([s.sample(sampler)])
            after_prompt = rec.seen[len(prompt)]
            assert np.isfinite(after_prompt)
            assert s.rewind_to_prefix(prompt) == len(prompt)  # the prompt fed last: its logits are kept
            s.feed([s.sample(sampler)])
            assert rec.seen[len(prompt)] == pytest.approx(after_prompt, abs=1e-4)
            assert not np.isnan(policy._nll.get(np.array([len(prompt)]))).any()
            assert np.isnan(policy._nll.get(np.array([len(prompt) + 1]))).all()  # the dropped branch's token
            k = len(prompt) - 4
            start = s.rewind_to_prefix(prompt[:k] + model.tokenize(" A bird sang.", add_special=False))
            assert start <= k
            rec.seen.clear()
            s.feed(model.tokenize(" A bird sang.", add_special=False))
            assert np.isnan(rec.seen[start]) and np.isfinite(rec.seen[start + 1])
