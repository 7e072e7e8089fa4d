"""Rank statistics (eval.stats, numpy only) against hand-computed values, and the layer ranking on synthetic data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from epikv_local.eval.anatomy import analyse, rank_layers, trace_signals
from epikv_local.eval.stats import auroc, rankdata, spearman, top_fraction, within_groups_spearman


def test_rankdata_average_ties():
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert rankdata([3, 3, 3]).tolist() == [2.0, 2.0, 2.0]
    assert rankdata([]).tolist() == []


def test_spearman_hand_values():
    # ranks y = [1, 2, 3.5, 5, 3.5]: sum dxdy = 8, sum dx^2 = 10, sum dy^2 = 9.5
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95), abs=1e-12)
    assert spearman([1, 2, 3], [1, 8, 27]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [27, 8, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # constant input
    assert spearman([1, np.nan, 2, 3], [3, 0, 2, 1]) == pytest.approx(-1.0)  # NaN pairs dropped


def test_auroc_hand_values():
    # positives 0.35 and 0.8 vs negatives 0.1 and 0.4: 3 of 4 pairs won
    assert auroc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    # a tie counts 1/2: positive 1 vs negatives 1 (tie) and 2 (loss)
    assert auroc([1, 1, 2], [True, False, False]) == pytest.approx(0.25)
    assert auroc([1, 2, 3, 4], [False, False, True, True]) == pytest.approx(1.0)
    assert auroc([1, 2, 3, 4], [True, True, False, False]) == pytest.approx(0.0)
    assert math.isnan(auroc([1, 2], [True, True]))


def test_auroc_equals_pair_count_on_random_data():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, size=40).astype(float)  # many ties
    y = rng.random(40) < 0.3
    wins = sum((a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y])
    assert auroc(s, y) == pytest.approx(wins / (y.sum() * (~y).sum()))


def test_top_fraction_and_within_groups():
    assert np.flatnonzero(top_fraction(np.arange(10.0))).tolist() == [9]
    x = [1, 2, 3, 1, 2, 3]
    y = [1, 2, 3, 3, 2, 1]
    g = [0, 0, 0, 1, 1, 1]
    assert within_groups_spearman(x, y, g) == pytest.approx(0.0)  # +1 and -1
    assert within_groups_spearman(x, [1, 2, 3, 1, 2, 3], g) == pytest.approx(1.0)


def test_layer_ranking_on_synthetic_signal():
    rng = np.random.default_rng(1)
    T, L = 400, 6
    g = np.abs(rng.normal(1.0, 0.2, size=(T, L)))
    # the label is driven by layer 2's g (positive) and layer 4's g (negative)
    lab = {}
    for p in range(40, T, 3):
        lab[p] = {"label": float(g[p, 2] - g[p, 4] + 0.01 * rng.normal()), "checkpoint": (p // 16 + 1) * 16}
    cap = {"g": g, "knorm": None}
    sig = trace_signals(cap, lab, window=32, n_layer=L + 1, attn=None, attn_chunk=16, horizon=8,
                        pairs={"epikv_default": (2, 4)}, smooth=1)
    res = analyse([sig], n_layer=L + 1)
    top, bottom = rank_layers(res["layers"], k=1)
    assert top == [2] and bottom == [4]
    assert res["signals"]["epikv_default"]["spearman"] > 0.8
    assert abs(res["signals"]["random"]["spearman"]) < 0.3
