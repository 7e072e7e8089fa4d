"""The attention-free rivals and the EPIKV variant: RoPE undone exactly, TriAttention's trigonometric score,
R-KV's redundancy, EPIKV-mix's rank mixing (synthetic), then the pre-RoPE claims on the real model."""

from __future__ import annotations

import numpy as np
import pytest

from epikv_local.errors import ConfigError, DataError
from epikv_local.policies import ModelShape, Observation, make_policy
from epikv_local.policies.base import rank01
from epikv_local.policies.rope import frequencies, to_complex
from epikv_local.policies.triattention import QueryStats

SHAPE = ModelShape(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, rope_type="norm", rope_dims=64,
                   rope_freq_base=100000.0)


def rope_forward(x: np.ndarray, pos: np.ndarray, shape: ModelShape) -> np.ndarray:
    """llama.cpp's RoPE written out independently (ggml_rope NORM / NEOX): x (T, H, head_dim) float."""
    hd = x.shape[-1]
    dims = shape.rope_dims or hd
    out = x.copy()
    for i in range(dims // 2):
        theta = pos * shape.rope_freq_scale * shape.rope_freq_base ** (-2.0 * i / dims)
        a, b = (2 * i, 2 * i + 1) if shape.rope_type == "norm" else (i, i + dims // 2)
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        out[:, :, a] = x[:, :, a] * c - x[:, :, b] * s
        out[:, :, b] = x[:, :, a] * s + x[:, :, b] * c
    return out


@pytest.mark.parametrize("rope_type", ["norm", "neox"])
def test_to_complex_undoes_rope(rope_type):
    sh = ModelShape(n_layer=4, n_embd=128, n_head=2, n_head_kv=2, rope_type=rope_type, rope_dims=48,
                    rope_freq_base=10000.0, rope_freq_scale=0.5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 2, 64))
    pos = np.array([0, 3, 17, 400, 9000])
    rotated = rope_forward(x, pos, sh).reshape(5, 128)
    c = to_complex(rotated, pos, sh, 2)
    assert c.shape == (5, 2, 24)
    a, b = (x[..., 0:48:2], x[..., 1:48:2]) if rope_type == "norm" else (x[..., :24], x[..., 24:48])
    np.testing.assert_allclose(c, a + 1j * b, atol=1e-9)
    # extra axes between T and the heads (layers) broadcast the same positions
    c2 = to_complex(np.stack([rotated, rotated], axis=1), pos, sh, 2)
    np.testing.assert_allclose(c2[:, 1], c, atol=1e-12)


def test_triattention_prefers_keys_aligned_with_the_query_centre():
    p = make_policy("triattention", n_key_layers=1)
    sig = p.bind(SHAPE)
    assert sig.query_layers == sig.key_layers  # no offline statistics: queries captured online
    hd, F = 64, 32
    rng = np.random.default_rng(1)
    centre = rng.normal(size=(SHAPE.n_head, hd))
    q_pre = centre[None] + 0.05 * rng.normal(size=(40, SHAPE.n_head, hd))
    kv_centre = centre.reshape(3, 3, hd).sum(axis=1)        # the group's query heads summed per KV head
    k_pre = np.stack([kv_centre, -kv_centre, rng.normal(size=(3, hd)) * 0.01])   # aligned, opposed, tiny
    k_pre = np.concatenate([k_pre, rng.normal(size=(37, 3, hd))])
    pos = np.arange(40)
    obs = Observation(positions=pos,
                      keys=rope_forward(k_pre, pos, SHAPE).reshape(40, 1, 192).astype(np.float32),
                      queries=rope_forward(q_pre, pos, SHAPE).reshape(40, 1, 576).astype(np.float32))
    p.observe(obs)
    s = p.score(pos)
    assert s[0] > s[2] > s[1]
    assert s[0] == s.max() and s[1] == s.min()
    assert frequencies(SHAPE).shape == (F,)


def test_triattention_offline_statistics_roundtrip(tmp_path):
    qs = QueryStats((0, 9, 29), n_head=9, n_pairs=32)
    rng = np.random.default_rng(2)
    qs.update(rng.normal(size=(10, 3, 9, 32)) + 1j * rng.normal(size=(10, 3, 9, 32)))
    path = tmp_path / "q.npz"
    qs.save(path)
    back = QueryStats.load(path)
    np.testing.assert_allclose(back.sum, qs.sum)
    assert back.count == 10 and back.layers == (0, 9, 29)
    c, r = back.select((9,)).per_kv_head(3)
    assert c.shape == r.shape == (1, 3, 32) and (r >= 0).all()
    p = make_policy("triattention", n_key_layers=1, query_stats=str(path))  # spaced_layers(30, 1) = (15,)
    with pytest.raises(DataError, match="no layer"):
        p.bind(SHAPE)
    p = make_policy("triattention", n_key_layers=3, query_stats=str(path))   # (0, 14, 29): 14 missing
    with pytest.raises(DataError, match="no layer"):
        p.bind(SHAPE)
    with pytest.raises(DataError, match="cannot read"):
        make_policy("triattention", query_stats=str(tmp_path / "missing.npz")).bind(SHAPE)
    with pytest.raises(ConfigError, match="plain RoPE"):
        make_policy("triattention").bind(ModelShape(n_layer=30, n_embd=576, n_head=9, n_head_kv=3,
                                                    rope_type="other"))
    with pytest.raises(ConfigError, match="offsets"):
        make_policy("triattention", offsets=(-1,))


def test_rkv_redundancy_evicts_the_older_duplicate():
    p = make_policy("rkv_redundancy", n_key_layers=1)
    p.bind(SHAPE)
    e = np.eye(192)
    rows = np.stack([e[0] + e[64] + e[128], e[0] + e[64] + e[128], e[1] + e[65] + e[129], e[2] + e[66] + e[130]])
    p.observe(Observation(positions=np.arange(4), keys=rows[:, None, :].astype(np.float32)))
    s = p.score(np.arange(4))
    assert s[0] < s[1] and s[0] < s[2] and s[0] < s[3]          # the older copy of a duplicate pair is redundant
    np.testing.assert_allclose(s[1:], s[1])                     # the newer copy is as safe as a unique key
    # once the newer copy is evicted, the older one is unique again
    s2 = p.score(np.array([0, 2, 3]))
    np.testing.assert_allclose(s2, s2[0])
    with pytest.raises(ConfigError, match="threshold"):
        make_policy("rkv_redundancy", threshold=1.5)


def test_rkv_mixes_importance_and_redundancy():
    p = make_policy("rkv", n_key_layers=1, lam=1.0)
    p.bind(SHAPE)
    rng = np.random.default_rng(3)
    cells = np.arange(5, dtype=np.int32)
    att = np.array([0.1, 0.5, 0.2, 0.15, 0.05], dtype=np.float32)
    p.observe(Observation(positions=np.arange(5), keys=rng.normal(size=(5, 1, 192)).astype(np.float32),
                          cell_pos=cells, attn_received=att, attn_last=att))
    np.testing.assert_allclose(p.score(np.arange(5)), att / att.sum(), rtol=1e-6)
    with pytest.raises(ConfigError, match="lam"):
        make_policy("rkv", lam=2)


def test_epikv_mix_ranks_and_weights():
    np.testing.assert_allclose(rank01(np.array([3.0, np.nan, 1.0, 2.0])), [1.0, 0.0, 1 / 3, 2 / 3])
    rng = np.random.default_rng(4)
    only_keydiff = make_policy("epikv_mix", w_epikv=0.0, w_keydiff=1.0)
    kd = make_policy("keydiff")
    sig = only_keydiff.bind(SHAPE)
    assert sig.g_layers == () and sig.key_layers == kd.bind(SHAPE).key_layers
    obs = Observation(positions=np.arange(30), keys=rng.normal(size=(30, 4, 192)).astype(np.float32))
    only_keydiff.observe(obs)
    kd.observe(obs)
    live = np.arange(30)
    assert np.argsort(only_keydiff.score(live)).tolist() == np.argsort(kd.score(live)).tolist()
    both = make_policy("epikv_mix")
    sig = both.bind(SHAPE)
    assert sig.g_layers == (9, 20) and len(sig.key_layers) == 4 and not sig.query_layers
    with pytest.raises(ConfigError, match="at least one"):
        make_policy("epikv_mix", w_epikv=0, w_keydiff=0)
    with pytest.raises(ConfigError, match="w_keydiff"):
        make_policy("epikv_mix", w_keydiff=-1)


# -- the real model ------------------------------------------------------------------------------------------
def test_model_shape_reports_rope(model):
    sh = model.info.shape
    assert (sh.rope_type, sh.rope_dims, sh.rope_freq_base, sh.head_dim) == ("norm", 64, 100000.0, 64)


@pytest.mark.parametrize("kind", ["keys", "queries"])
def test_layer0_projections_are_position_free_once_rope_is_undone(model, kind):
    """Layer 0's keys and queries depend on the token alone (no position in the embeddings): after undoing
    RoPE, the same token at three positions gives the same pre-RoPE vector. A wrong pairing, frequency or
    sign would leave them rotated apart."""
    from epikv_local.engine.handles import Context
    from epikv_local.engine.native import CAPTURE_K, CAPTURE_Q

    kind_id, heads = (CAPTURE_K, 3) if kind == "keys" else (CAPTURE_Q, 9)
    the, cat, dog = (model.tokenize(w)[-1] for w in (" the", " cat", " dog"))
    toks = [the, cat, the, dog, cat, cat, the]
    at = [0, 2, 6]
    with Context(model, n_ctx=64, n_batch=64) as ctx:
        ctx.set_layer_capture(0, True, kind_id)
        ctx.decode(toks, np.arange(len(toks)), logits_last=True)
        rows = ctx.layer_capture(0, len(toks), kind_id).copy()
    c = to_complex(rows[at], np.array(at), model.info.shape, heads)
    assert not np.allclose(rows[at[0]], rows[at[1]], atol=1e-3)        # after RoPE they differ
    np.testing.assert_allclose(c[1], c[0], atol=2e-3 * np.abs(c[0]).max())
    np.testing.assert_allclose(c[2], c[0], atol=2e-3 * np.abs(c[0]).max())
