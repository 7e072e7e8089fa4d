"""Tests for epikv_local.scoring (pure numpy; no native code)."""

import math
import sys

import numpy as np
import pytest

from epikv_local.policies.scoring import (
    ScoringConfig,
    StreamingScorer,
    causal_moving_average,
    diff_norms,
    epikv_scores,
    lag_normalize,
    normalize,
    rolling_zscore,
)


# ---------------------------------------------------------------- references


def ref_zscore(g, window, min_history=8, eps=1e-6, z_clip=10.0):
    out = []
    for t in range(len(g)):
        ref = [v for v in g[max(0, t - window):t] if not math.isnan(v)]
        if math.isnan(g[t]) or len(ref) < min_history:
            out.append(0.0)
            continue
        mu = sum(ref) / len(ref)
        sigma = math.sqrt(sum((v - mu) ** 2 for v in ref) / len(ref))
        z = (g[t] - mu) / (sigma + eps)
        out.append(min(max(z, -z_clip), z_clip))
    return np.array(out)


def ref_lag(g, window, min_history=8, eps=1e-6, z_clip=10.0):
    out = []
    for t in range(len(g)):
        ref = sorted(v for v in g[max(0, t - window):t] if not math.isnan(v))
        if math.isnan(g[t]) or len(ref) < min_history:
            out.append(0.0)
            continue
        med = float(np.median(ref))
        mad = float(np.median([abs(v - med) for v in ref]))
        z = (g[t] - med) / (mad * 1.4826 + eps)
        out.append(min(max(z, -z_clip), z_clip))
    return np.array(out)


def ref_cma(x, k):
    return np.array([sum(x[max(0, t - k + 1):t + 1]) / len(x[max(0, t - k + 1):t + 1])
                     for t in range(len(x))])


def random_g(rng, T, nan_frac=0.1):
    g = rng.gamma(2.0, 3.0, size=T)
    g[rng.random(T) < nan_frac] = np.nan
    g[0] = np.nan
    return g


# ---------------------------------------------------------------- rolling_zscore


@pytest.mark.parametrize("T,window,min_history", [
    (200, 16, 4), (50, 128, 8), (300, 7, 2), (40, 40, 40), (1, 8, 8), (0, 8, 8),
])
def test_rolling_zscore_matches_reference(T, window, min_history):
    rng = np.random.default_rng(T * 1000 + window)
    g = random_g(rng, T) if T else np.zeros(0)
    got = rolling_zscore(g, window, min_history)
    exp = ref_zscore(list(g), window, min_history)
    assert got.shape == (T,)
    np.testing.assert_allclose(got, exp, rtol=1e-9, atol=1e-9)


def test_rolling_zscore_large_offset_no_cancellation():
    rng = np.random.default_rng(1)
    g = 1e6 + rng.normal(0, 1e-2, size=500)
    np.testing.assert_allclose(rolling_zscore(g, 64, 8), ref_zscore(list(g), 64, 8),
                               rtol=1e-7, atol=1e-7)


def test_rolling_zscore_long_sequence_blocks():
    rng = np.random.default_rng(2)
    g = random_g(rng, 9000)
    got = rolling_zscore(g, 32, 8)
    idx = np.r_[0:50, 4080:4110, 8950:9000]
    exp = ref_zscore(list(g), 32, 8)
    np.testing.assert_allclose(got[idx], exp[idx], rtol=1e-9, atol=1e-9)


def test_first_tokens_zero_until_min_history():
    g = np.arange(1.0, 31.0) ** 1.5
    z = rolling_zscore(g, window=16, min_history=5)
    assert np.all(z[:5] == 0.0)
    assert np.all(z[5:] != 0.0)


def test_first_token_nan_counts_as_missing():
    g = np.arange(1.0, 21.0)
    g[0] = np.nan
    z = rolling_zscore(g, window=16, min_history=5)
    assert np.all(z[:6] == 0.0)  # t=5 only has 4 valid past values
    assert z[6] != 0.0


def test_constant_g_gives_zero():
    g = np.full(100, 3.7)
    z = rolling_zscore(g, window=32, min_history=4)
    assert np.all(np.isfinite(z))
    np.testing.assert_allclose(z, 0.0, atol=1e-9)


def test_spike_after_constant_run_is_clipped():
    g = np.full(50, 2.0)
    g[40] = 5.0
    z = rolling_zscore(g, window=32, min_history=4, z_clip=7.5)
    assert z[40] == 7.5
    g[40] = -1.0
    assert rolling_zscore(g, window=32, min_history=4, z_clip=7.5)[40] == -7.5


def test_nan_g_gives_zero_and_is_excluded():
    rng = np.random.default_rng(3)
    g = rng.random(60)
    g[30] = np.nan
    z = rolling_zscore(g, window=10, min_history=4)
    assert z[30] == 0.0
    # t=35: reference = g[25:35] without g[30]
    ref = np.delete(g[25:35], 5)
    exp = (g[35] - ref.mean()) / (ref.std() + 1e-6)
    assert z[35] == pytest.approx(exp, rel=1e-12)


def test_window_excludes_current_token():
    g = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    z = rolling_zscore(g, window=4, min_history=4, z_clip=1e9)
    ref = g[:4]
    assert z[4] == pytest.approx((100.0 - ref.mean()) / (ref.std() + 1e-6), rel=1e-12)


def test_rolling_zscore_invalid_args():
    g = np.ones(5)
    with pytest.raises(ValueError, match="window"):
        rolling_zscore(g, 1)
    with pytest.raises(ValueError, match="min_history"):
        rolling_zscore(g, 4, min_history=5)
    with pytest.raises(ValueError, match="eps"):
        rolling_zscore(g, 4, min_history=2, eps=0.0)
    with pytest.raises(ValueError, match="z_clip"):
        rolling_zscore(g, 4, min_history=2, z_clip=-1.0)
    with pytest.raises(ValueError, match="shape"):
        rolling_zscore(np.ones((3, 2)), 4, min_history=2)


# ---------------------------------------------------------------- lag / raw


@pytest.mark.parametrize("T,window,min_history", [(150, 16, 4), (40, 64, 8), (120, 5, 3)])
def test_lag_normalize_matches_reference(T, window, min_history):
    rng = np.random.default_rng(T + window)
    g = random_g(rng, T)
    np.testing.assert_allclose(lag_normalize(g, window, min_history),
                               ref_lag(list(g), window, min_history),
                               rtol=1e-9, atol=1e-9)


def test_lag_constant_and_spike():
    g = np.full(40, 2.0)
    g[30] = 3.0
    z = lag_normalize(g, window=16, min_history=4, z_clip=5.0)
    assert np.all(z[:30] == 0.0)
    assert z[30] == 5.0


def test_normalize_dispatch():
    rng = np.random.default_rng(4)
    g = random_g(rng, 80)
    cfg = ScoringConfig(window=16, min_history=4)
    np.testing.assert_array_equal(normalize(g, cfg), rolling_zscore(g, 16, 4))
    cfg_lag = ScoringConfig(window=16, min_history=4, normalization="lag")
    np.testing.assert_array_equal(normalize(g, cfg_lag), lag_normalize(g, 16, 4))
    cfg_raw = ScoringConfig(normalization="raw")
    np.testing.assert_array_equal(normalize(g, cfg_raw), np.nan_to_num(g, nan=0.0))


# ---------------------------------------------------------------- diff_norms


def test_diff_norms_vs_linalg():
    rng = np.random.default_rng(5)
    h = rng.normal(size=(12, 33)).astype(np.float32)
    prev = rng.normal(size=33).astype(np.float32)
    g = diff_norms(h, prev)
    assert g.dtype == np.float64 and g.shape == (12,)
    exp0 = np.linalg.norm(h[0].astype(np.float64) - prev.astype(np.float64))
    assert g[0] == pytest.approx(exp0, rel=1e-12)
    for i in range(1, 12):
        exp = np.linalg.norm(h[i].astype(np.float64) - h[i - 1].astype(np.float64))
        assert g[i] == pytest.approx(exp, rel=1e-12)
    g2 = diff_norms(h, None)
    assert np.isnan(g2[0])
    np.testing.assert_array_equal(g2[1:], g[1:])


def test_diff_norms_shapes():
    assert diff_norms(np.zeros((0, 4), np.float32), None).shape == (0,)
    with pytest.raises(ValueError, match="h must"):
        diff_norms(np.zeros(4), None)
    with pytest.raises(ValueError, match="prev must"):
        diff_norms(np.zeros((3, 4)), np.zeros(5))


def test_diff_norms_chunking_consistent():
    rng = np.random.default_rng(6)
    h = rng.normal(size=(20, 8)).astype(np.float32)
    whole = diff_norms(h, None)
    parts = np.concatenate([diff_norms(h[:7], None), diff_norms(h[7:], h[6])])
    np.testing.assert_array_equal(whole, parts)


# ---------------------------------------------------------------- moving average


@pytest.mark.parametrize("k", [1, 2, 4, 9, 50])
def test_causal_moving_average_vs_loop(k):
    rng = np.random.default_rng(k)
    x = rng.normal(size=37)
    np.testing.assert_allclose(causal_moving_average(x, k), ref_cma(list(x), k),
                               rtol=1e-12, atol=1e-12)


def test_causal_moving_average_invalid():
    with pytest.raises(ValueError, match="k"):
        causal_moving_average(np.ones(3), 0)


# ---------------------------------------------------------------- config / layers


def test_layers_for_depth():
    cfg = ScoringConfig()
    assert cfg.layers_for_depth(32) == (10, 21)
    assert cfg.layers_for_depth(30) == (9, 20)
    assert cfg.layers_for_depth(24) == (8, 16)
    assert ScoringConfig(layer_b=None).layers_for_depth(2) == (0,)
    assert ScoringConfig(layer_b=None).layers_for_depth(32) == (10,)
    with pytest.raises(ValueError, match="collide"):
        cfg.layers_for_depth(2)
    with pytest.raises(ValueError, match="n_layer"):
        cfg.layers_for_depth(1)
    with pytest.raises(ValueError, match="n_layer"):
        cfg.layers_for_depth(0)


def test_layers_for_depth_clamps_to_second_last():
    cfg = ScoringConfig(layer_a=0, layer_b=31)
    assert cfg.layers_for_depth(32) == (0, 30)
    assert cfg.layers_for_depth(16) == (0, 14)


@pytest.mark.parametrize("kwargs,field", [
    ({"window": 1}, "window"),
    ({"min_history": 1}, "min_history"),
    ({"window": 8, "min_history": 9}, "min_history"),
    ({"smooth": 0}, "smooth"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-3}, "eps"),
    ({"z_clip": 0.0}, "z_clip"),
    ({"layer_a": -1}, "layer_a"),
    ({"layer_b": -2}, "layer_b"),
    ({"layer_a": 5, "layer_b": 5}, "layer_b"),
    ({"ref_depth": 0}, "ref_depth"),
    ({"normalization": "minmax"}, "normalization"),
    ({"window": 2.5}, "window"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field) as ei:
        ScoringConfig(**kwargs)
    bad = list(kwargs.values())[-1]
    assert repr(bad) in str(ei.value)


def test_config_defaults_valid():
    cfg = ScoringConfig()
    assert (cfg.layer_a, cfg.layer_b, cfg.ref_depth, cfg.window) == (10, 21, 32, 128)
    ScoringConfig(window=2, min_history=2, smooth=1, normalization="raw", layer_b=None)


# ---------------------------------------------------------------- epikv_scores


def test_epikv_scores_formula():
    rng = np.random.default_rng(7)
    ga, gb = random_g(rng, 100), random_g(rng, 100)
    cfg = ScoringConfig(window=16, min_history=4, smooth=3)
    s = epikv_scores({10: ga, 21: gb}, cfg, (10, 21))
    exp = ref_cma(list(ref_zscore(list(ga), 16, 4) - ref_zscore(list(gb), 16, 4)), 3)
    np.testing.assert_allclose(s, exp, rtol=1e-9, atol=1e-9)
    s2 = epikv_scores(np.stack([ga, gb], axis=1), cfg, (10, 21))
    np.testing.assert_array_equal(s, s2)


def test_epikv_scores_single_band():
    rng = np.random.default_rng(8)
    ga = random_g(rng, 60)
    cfg = ScoringConfig(window=16, min_history=4, smooth=2, layer_b=None)
    s = epikv_scores({9: ga}, cfg, (9,))
    np.testing.assert_allclose(s, ref_cma(list(ref_zscore(list(ga), 16, 4)), 2),
                               rtol=1e-9, atol=1e-9)


def test_epikv_scores_bad_inputs():
    cfg = ScoringConfig()
    with pytest.raises(ValueError, match="layers"):
        epikv_scores({10: np.ones(3)}, cfg, (10,))
    with pytest.raises(ValueError, match="lacks"):
        epikv_scores({10: np.ones(3)}, cfg, (10, 21))
    with pytest.raises(ValueError, match="lengths"):
        epikv_scores({10: np.ones(3), 21: np.ones(4)}, cfg, (10, 21))
    with pytest.raises(ValueError, match="shape"):
        epikv_scores(np.ones((3, 3)), cfg, (10, 21))


# ---------------------------------------------------------------- streaming


CONFIGS = [
    ScoringConfig(window=16, min_history=4, smooth=4),
    ScoringConfig(window=128, min_history=8, smooth=4),
    ScoringConfig(window=8, min_history=8, smooth=1),
    ScoringConfig(window=16, min_history=4, smooth=5, layer_b=None),
    ScoringConfig(window=12, min_history=3, smooth=3, normalization="lag"),
    ScoringConfig(window=12, min_history=3, smooth=2, normalization="raw"),
    ScoringConfig(window=10, min_history=3, smooth=3, normalization="lag", layer_b=None),
]


def chunkings(T, rng):
    yield [T]
    yield [1] * T
    yield [3] * (T // 3) + [T % 3]
    yield [17] * (T // 17) + [T % 17]
    sizes, left = [], T
    while left:
        n = int(min(left, rng.integers(0, 40)))
        sizes.append(n)  # includes empty chunks
        left -= n
    yield sizes


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.normalization}-w{c.window}-"
                         f"s{c.smooth}-{'1band' if c.layer_b is None else '2band'}")
def test_streaming_equals_batch(cfg):
    rng = np.random.default_rng(cfg.window * 7 + cfg.smooth)
    T = 301
    layers = (3,) if cfg.layer_b is None else (3, 6)
    G = np.stack([random_g(rng, T) for _ in layers], axis=1)
    # include a constant stretch and a spike to exercise the eps / clip paths
    G[100:180, :] = 1.25
    G[185, 0] = 40.0
    batch = epikv_scores(G, cfg, layers)
    for sizes in chunkings(T, rng):
        sc = StreamingScorer(cfg, layers)
        outs, start = [], 0
        for n in sizes:
            out = sc.update(G[start:start + n])
            assert out.shape == (n,)
            outs.append(out)
            start += n
        assert sc.n_seen == T
        np.testing.assert_allclose(np.concatenate(outs), batch, rtol=1e-9, atol=1e-9)


def test_streaming_reset_and_state_size():
    cfg = ScoringConfig(window=16, min_history=4, smooth=3)
    rng = np.random.default_rng(9)
    G = np.stack([random_g(rng, 500), random_g(rng, 500)], axis=1)
    sc = StreamingScorer(cfg, (1, 2))
    sc.update(G)
    assert sc._buf.shape == (2, 16)
    assert sc._smooth_prefix.shape == (2,)
    sc.reset()
    assert sc.n_seen == 0
    np.testing.assert_array_equal(sc.update(G[:50]), epikv_scores(G[:50], cfg, (1, 2)))


def test_streaming_bad_inputs():
    cfg = ScoringConfig()
    with pytest.raises(ValueError, match="layers"):
        StreamingScorer(cfg, (10,))
    sc = StreamingScorer(cfg, (10, 21))
    with pytest.raises(ValueError, match="shape"):
        sc.update(np.ones(2))
    with pytest.raises(ValueError, match="shape"):
        sc.update(np.ones((4, 3)))


# ---------------------------------------------------------------- causality


@pytest.mark.parametrize("normalization", ["zscore", "lag", "raw"])
def test_causality(normalization):
    cfg = ScoringConfig(window=16, min_history=4, smooth=4, normalization=normalization)
    rng = np.random.default_rng(11)
    G = np.stack([random_g(rng, 120), random_g(rng, 120)], axis=1)
    base = epikv_scores(G, cfg, (0, 1))
    for t in (0, 5, 30, 80, 118):
        G2 = G.copy()
        G2[t + 1:] = rng.random(G2[t + 1:].shape) * 100
        s2 = epikv_scores(G2, cfg, (0, 1))
        np.testing.assert_array_equal(s2[:t + 1], base[:t + 1])
        if t + 1 < 120:
            assert not np.array_equal(s2[t + 1:], base[t + 1:])


def test_no_native_imports():
    """The scoring math and the selection step import numpy only (checked in a fresh interpreter)."""
    import subprocess

    code = ("import sys, epikv_local.policies.scoring, epikv_local.engine.selection; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'cffi') or m == 'epikv_local.engine.native']; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("scale", [0.1, 1e3, 1e6])
@pytest.mark.parametrize("normalization", ["zscore", "lag"])
def test_streaming_equals_batch_constant_runs_large_values(scale, normalization):
    # zero-variance windows amplify rounding by 1/eps: both paths must agree anyway
    rng = np.random.default_rng(12)
    G = rng.random((400, 2)) * scale
    G[100:300] = scale * 1.1
    G[0] = np.nan
    cfg = ScoringConfig(window=64, min_history=8, smooth=3, normalization=normalization)
    batch = epikv_scores(G, cfg, (10, 21))
    sc = StreamingScorer(cfg, (10, 21))
    one = np.concatenate([sc.update(G[i:i + 1]) for i in range(400)])
    np.testing.assert_allclose(one, batch, rtol=1e-9, atol=1e-9)
