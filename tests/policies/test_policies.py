"""Every registered policy, kvpress-style: a unit matrix on synthetic observations, then end to end on the
real model (SmolLM2-135M) under a small budget, the attention policies with flash attention off."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from epikv_local.engine.budget import BudgetConfig
from epikv_local.api.chat import apply_chat_template, tokenize_prompt
from epikv_local.api.generation import generate
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.errors import ConfigError
from epikv_local.policies import REGISTRY, ModelShape, Observation, make_policy
from epikv_local.engine.selection import select_evictions
from epikv_local.engine.session import Session, SessionConfig

N_LAYER = 30
D_K = 192  # SmolLM2-135M: 3 KV heads x 64
SHAPE = ModelShape(n_layer=N_LAYER, n_embd=576, n_head=9, n_head_kv=3)
ALL = sorted(n for n in REGISTRY if not REGISTRY[n].from_calibration)  # "calibrated" needs a model file
EVICTING = [n for n in ALL if n != "none"]


# -- synthetic observations ---------------------------------------------------------------------------------
def synth_obs(policy, positions, rng, cells: np.ndarray | None = None) -> Observation:
    """An Observation carrying exactly the signals ``policy`` declares, with random content."""
    positions = np.asarray(positions, dtype=np.int64)
    T = len(positions)
    obs = Observation(positions=positions)
    layers = policy.bound.g_layers
    if layers:
        obs.g = rng.gamma(2.0, 1.0, size=(T, len(layers)))
    key_layers = policy.bound.key_layers
    if key_layers:
        obs.keys = rng.normal(size=(T, len(key_layers), D_K)).astype(np.float32)
    query_layers = policy.bound.query_layers
    if query_layers:
        obs.queries = rng.normal(size=(T, len(query_layers), SHAPE.n_embd)).astype(np.float32)
    if policy.needs_attention:
        cell_pos = np.full(len(cells) + 3, -1, dtype=np.int32)  # a few empty cells too
        cell_pos[: len(cells)] = cells
        rng.shuffle(cell_pos)
        obs.cell_pos = cell_pos
        obs.attn_received = rng.random(len(cell_pos)).astype(np.float32)
        obs.attn_last = rng.random(len(cell_pos)).astype(np.float32)
    if policy.bound.surprise:
        obs.surprise = rng.exponential(1.0, size=T)
    return obs


def feed_synthetic(name, seed=0, **kw):
    """Three decodes (8 tokens, then 1, then 1) of synthetic signals; returns the policy and live positions."""
    policy = make_policy(name, **kw)
    rng = np.random.default_rng(seed)
    policy.bind(SHAPE)
    live = np.zeros(0, dtype=np.int64)
    for chunk in (np.arange(0, 8), np.array([8]), np.array([9])):
        live = np.concatenate([live, chunk])
        policy.observe(synth_obs(policy, chunk, rng, cells=live))
    return policy, live


@pytest.mark.parametrize("name", ALL)
def test_scores_shape_dtype_determinism(name):
    p1, live = feed_synthetic(name)
    s1 = p1.score(live)
    assert isinstance(s1, np.ndarray) and s1.dtype == np.float64 and s1.shape == live.shape
    np.testing.assert_array_equal(s1, p1.score(live))       # score() is repeatable
    p2, _ = feed_synthetic(name)
    np.testing.assert_array_equal(s1, p2.score(live))       # same inputs -> same scores
    sub = live[2:7]
    assert p1.score(sub).shape == sub.shape
    assert p1.name == name


def test_registry_and_families():
    assert set(ALL) == {"none", "streaming", "random", "knorm", "keydiff", "lagkv", "epikv", "epikv_lag",
                        "epikv_raw", "epikv_single", "epikv_span", "h2o", "tova", "snapkv", "epikv_mix", "triattention",
                        "rkv_redundancy", "rkv", "said", "said_epikv", "said_prompt", "said_facts", "said_surprise", "facts",
                        "surprise", "said_prompt_surprise", "said_words", "said_words_surprise", "said_words_either",
                        "said_words_deep"}
    # traits are class attributes, read from the registry's classes
    assert {n for n in ALL if REGISTRY[n].cls.needs_attention} == {"h2o", "tova", "snapkv", "rkv"}
    assert {n for n in ALL if REGISTRY[n].cls.calibratable} == {"epikv", "epikv_lag", "epikv_raw", "epikv_single", "epikv_span",
                                                                "epikv_mix", "triattention", "said_epikv",
                                                                "said_prompt", "said_facts", "said_prompt_surprise",
                                                                "said_words", "said_words_surprise", "said_words_either",
                                                                "said_words_deep"}
    assert [n for n in ALL if not REGISTRY[n].cls.evicts] == ["none"]
    # variants are named configurations of one class, not copies
    assert make_policy("epikv_lag").normalization == "lag"
    assert make_policy("epikv_raw").normalization == "raw"
    assert make_policy("epikv_single").bind(SHAPE).g_layers == (9,)
    assert make_policy("epikv").normalization == "zscore" and make_policy("epikv").bind(SHAPE).g_layers == (9, 20)
    assert make_policy("epikv", layers=(19,)).bind(SHAPE).g_layers == (19,)
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("h3o")


def test_span_lifts_each_token_to_the_best_score_within_span_positions():
    # EPIKV's scores peak a few tokens after what made them (causal smoothing): a span keeps a code's leading
    # digits with its trailing ones. Scores set directly: the pooling is over stored per-position scores, so an
    # evicted neighbour still lifts a live token and a never-decoded one (NaN) lifts nothing.
    p = make_policy("epikv_span")
    p._scores.set(np.arange(10), np.array([0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, -1.0, np.nan]))
    s = p.score(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12]))
    assert s.tolist()[:9] == [0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0, 3.0, 0.0]
    assert s[9] == 0.0 and np.isnan(s[10])  # 9 never scored: lifted by 7; 12: nothing within 2
    plain = make_policy("epikv")
    plain._scores.set(np.arange(10), p._scores.get(np.arange(10)))
    assert np.array_equal(plain.score(np.arange(9)), p._scores.get(np.arange(9)))  # span 0: the scores as stored


@pytest.mark.parametrize("name,options,match", [
    ("streaming", {"layers": (3,)}, "has no setting 'layers'"),
    ("epikv", {"window": 0}, "window"),
    ("epikv", {"layers": (3, 3)}, "distinct"),
    ("epikv", {"normalization": "l2"}, "normalization"),
    ("epikv", {"span": -1}, "span"),
    ("epikv_span", {"span": 17}, "span"),
    ("random", {"seed": -1}, "seed"),
    ("snapkv", {"kernel": 0}, "kernel"),
    ("lagkv", {"chunk": 1}, "chunk"),
    ("knorm", {"n_key_layers": 0}, "n_key_layers"),
    ("said", {"base": "h2o"}, "base must be one of"),
    ("said", {"share": 1.5}, "share"),
])
def test_settings_are_validated_on_construction(name, options, match):
    with pytest.raises(ConfigError, match=match):
        make_policy(name, **options)


def test_bind_rejects_layers_beyond_the_model():
    with pytest.raises(ConfigError, match="beyond"):
        make_policy("epikv", layers=(29,)).bind(SHAPE)  # the last layer keeps only output rows


# -- hand-made rankings ---------------------------------------------------------------------------------------
def keys_obs(policy, rows):
    """rows: (T, d) one key per token, repeated over the policy's key layers."""
    rows = np.asarray(rows, dtype=np.float32)
    sig = getattr(policy, "bound", None) or policy.bind(SHAPE)
    L = len(sig.key_layers)
    return np.repeat(rows[:, None, :], L, axis=1)


def test_random_is_seed_deterministic():
    pos = np.arange(50)
    a, b, c = (make_policy("random", seed=s) for s in (0, 0, 1))
    for p in (a, b, c):
        p.observe(Observation(positions=pos))
    np.testing.assert_array_equal(a.score(pos), b.score(pos))
    assert not np.array_equal(a.score(pos), c.score(pos))
    # scored once: later decodes do not change earlier scores; reset replays the same draws
    before = a.score(pos)
    a.observe(Observation(positions=np.array([50])))
    np.testing.assert_array_equal(a.score(pos), before)
    a.reset()
    a.observe(Observation(positions=pos))
    np.testing.assert_array_equal(a.score(pos), before)


def test_knorm_keeps_small_norm_keys():
    p = make_policy("knorm")
    assert p.bind(SHAPE).key_layers == tuple(range(N_LAYER))
    rng = np.random.default_rng(0)
    base = rng.normal(size=(3, D_K))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    rows = base * np.array([[1.0], [5.0], [0.2]])  # pos 0: norm 1, pos 1: norm 5, pos 2: norm 0.2
    p.observe(Observation(positions=np.arange(3), keys=keys_obs(p, rows)))
    s = p.score(np.arange(3))
    assert np.argsort(-s).tolist() == [2, 0, 1]
    np.testing.assert_allclose(s, [-1.0, -5.0, -0.2], rtol=1e-5)
    # per-head variant ranks the same way
    ph = make_policy("knorm", n_head_kv=3, n_key_layers=4)
    assert len(ph.bind(SHAPE).key_layers) == 4
    ph.observe(Observation(positions=np.arange(3), keys=keys_obs(ph, rows)))
    assert np.argsort(-ph.score(np.arange(3))).tolist() == [2, 0, 1]


def test_keydiff_keeps_keys_orthogonal_to_the_mean():
    p = make_policy("keydiff")
    assert len(p.bind(SHAPE).key_layers) == 4
    e = np.eye(D_K)
    rows = np.stack([e[0], e[0], e[0] * 2, e[1]])  # three keys along e0 (the mean), one orthogonal
    p.observe(Observation(positions=np.arange(4), keys=keys_obs(p, rows)))
    s = p.score(np.arange(4))
    assert s[3] > s[0] and s[3] > s[1] and s[3] > s[2]
    np.testing.assert_allclose(s[:3], s[0])
    # evicted positions are forgotten: with 0 and 1 gone, the mean moves towards e1
    s2 = p.score(np.array([2, 3]))
    np.testing.assert_allclose(s2, [-np.sqrt(0.5), -np.sqrt(0.5)], rtol=1e-6)
    assert np.isnan(p.score(np.array([0]))).all()


def test_lagkv_scores_a_chunk_once_the_next_is_complete():
    c = 4
    p = make_policy("lagkv", chunk=c)
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(12, D_K))
    for t in range(12):
        p.observe(Observation(positions=np.array([t]), keys=keys_obs(p, keys[t:t + 1])))
        s = p.score(np.arange(t + 1))
        n_scored = (t + 1) // c * c - c if t + 1 >= 2 * c else 0
        assert np.isfinite(s[:n_scored]).all(), t
        assert np.isposinf(s[n_scored:]).all(), t
    # chunk 0 normalised by the min/max of chunk 1, per channel; score = std over channels
    lo, hi = keys[4:8].min(axis=0), keys[4:8].max(axis=0)
    expect = ((keys[:4] - lo) / (hi - lo + 1e-6)).std(axis=1)
    np.testing.assert_allclose(p.score(np.arange(4)), expect, rtol=1e-5)
    # a key far outside its successors' range varies more across channels -> ranked higher
    q = make_policy("lagkv", chunk=c)
    ks = rng.normal(size=(8, D_K)) * 0.1
    ks[1] = rng.normal(size=D_K) * 10.0
    q.observe(Observation(positions=np.arange(8), keys=keys_obs(q, ks)))
    assert np.argmax(q.score(np.arange(4))) == 1


def attn_obs(positions, cell_pos, received=None, last=None):
    cell_pos = np.asarray(cell_pos, dtype=np.int32)
    z = np.zeros(len(cell_pos), dtype=np.float32)
    return Observation(positions=np.asarray(positions, dtype=np.int64), cell_pos=cell_pos,
                       attn_received=z if received is None else np.asarray(received, dtype=np.float32),
                       attn_last=z if last is None else np.asarray(last, dtype=np.float32))


def test_h2o_accumulates_attention_received():
    p = make_policy("h2o")
    cells = [2, -1, 0, 1]  # cell -> position (cell 1 empty)
    p.observe(attn_obs([0, 1, 2], cells, received=[0.5, 9.0, 2.0, 0.5]))
    p.observe(attn_obs([3], cells + [3], received=[0.1, 9.0, 0.6, 0.1, 0.2]))
    s = p.score(np.arange(4))
    np.testing.assert_allclose(s, [2.6, 0.6, 0.6, 0.2], rtol=1e-6)
    assert np.argmax(s) == 0


def test_tova_follows_the_newest_query():
    p = make_policy("tova")
    p.observe(attn_obs([0, 1, 2], [1, 0, 2], last=[0.7, 0.1, 0.2]))
    np.testing.assert_allclose(p.score(np.arange(3)), [0.1, 0.7, 0.2], rtol=1e-6)
    p.observe(attn_obs([3], [1, 0, 2, 3], last=[0.05, 0.6, 0.1, 0.25]))
    s = p.score(np.arange(5))  # position 4 not seen by the newest query: keep
    np.testing.assert_allclose(s[:4], [0.6, 0.05, 0.1, 0.25], rtol=1e-6)
    assert np.isposinf(s[4])


def test_snapkv_windowed_sum_then_max_pool():
    p = make_policy("snapkv", window=2, kernel=3)
    cells = np.arange(8)
    p.observe(attn_obs(np.arange(7), cells[:7], received=[9, 9, 9, 9, 9, 9, 9]))  # falls out of the window
    r1 = np.zeros(8); r1[5] = 1.0
    p.observe(attn_obs([7], cells, last=r1))
    r2 = np.zeros(9); r2[1] = 0.5; r2[5] = 0.25
    p.observe(attn_obs([8], np.arange(9), last=r2))
    live = np.array([0, 1, 2, 4, 5, 6, 8])
    s = p.score(live)
    # raw: pos1 0.5, pos5 1.25; pooled with neighbours in the sorted live list
    np.testing.assert_allclose(s, [0.5, 0.5, 0.5, 1.25, 1.25, 1.25, 0.0])
    p1 = make_policy("snapkv", window=2, kernel=1)
    p1.observe(attn_obs([7], cells, last=r1))
    np.testing.assert_allclose(p1.score(np.array([4, 5, 6])), [0.0, 1.0, 0.0])


# -- end to end on the real model -------------------------------------------------------------------------------
PROMPT = "Explain step by step how to compute 17 * 23, then check the result."


@pytest.fixture(scope="module")
def prompt_tokens(model):
    return tokenize_prompt(model, apply_chat_template(model, PROMPT))


@pytest.mark.parametrize("name", EVICTING)
def test_policy_end_to_end(model, prompt_tokens, name):
    B, n_sink, n_recent = 96, 4, 32
    budget = BudgetConfig(kv_budget=B, n_sink=n_sink, n_recent=n_recent, protect_prompt=False, evict_chunk=8)
    policy = make_policy(name)
    fa = not REGISTRY[name].cls.needs_attention
    with Session(model, policy, budget, SessionConfig(flash_attn=fa), record=True) as s:
        res = generate(s, prompt_tokens, 160, SamplingConfig(), ignore_eog=True)
        stats, events = s.stats(), s.events
    assert res.stats.n_generated_tokens == 160
    assert res.stats.policy == name
    assert res.stats.flash_attn is fa
    assert stats.max_live <= B
    assert stats.n_evicted > 0 and events
    for ev in events:
        assert len(ev.scores) == len(ev.positions)
        assert not np.isin(ev.evicted, ev.positions[ev.protected]).any()
        newest = ev.positions.max()
        assert not (ev.evicted < n_sink).any() and not (ev.evicted > newest - n_recent).any()
        expect = select_evictions(ev.positions, ev.scores, ev.protected, len(ev.evicted))
        assert np.array_equal(expect, ev.evicted)


def test_attention_policy_refuses_flash_attention(model):
    with pytest.raises(ValueError, match="flash attention"):
        Session(model, make_policy("h2o"), BudgetConfig(kv_budget=96), SessionConfig(flash_attn=True))


# -- CLI ----------------------------------------------------------------------------------------------------------
def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "epikv_local.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_attention_policy_needs_no_flash_attn(model_path):
    r = cli("generate", "--model", str(model_path), "--prompt", "hi", "--policy", "h2o")
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("epikv-local: error:"), r.stderr
    assert "flash attention" in lines[0] and "--no-flash-attn" in lines[0]


def test_cli_attention_policy_runs_without_flash_attn(model_path):
    r = cli("generate", "--model", str(model_path), "--prompt", "Count from one to twenty, in words:",
            "--policy", "h2o", "--no-flash-attn", "--json", "--max-tokens", "40", "--kv-budget", "64",
            "--n-recent", "16", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["policy"] == "h2o" and out["flash_attn"] is False
    assert out["n_generated_tokens"] == 40 and out["max_live_cells"] <= 64


def test_cli_accepts_every_policy():
    from epikv_local.cli import build_parser

    for name in ALL:
        args = build_parser()[0].parse_args(["generate", "--model", "m.gguf", "--prompt", "x", "--policy", name])
        assert args.policy == name and args.no_flash_attn is False
