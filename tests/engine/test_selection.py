"""Tests for epikv_local.selection (pure numpy; no native code)."""

import numpy as np
import pytest

from epikv_local.engine.selection import protected_mask, select_evictions


def sel(pos, sc, prot, n):
    return select_evictions(np.asarray(pos, dtype=np.int64), np.asarray(sc, dtype=float),
                            np.asarray(prot, dtype=bool), n)


def test_lowest_scores_exact_set():
    pos = [0, 1, 2, 3, 4, 5, 6, 7]
    sc = [5.0, 1.0, 3.0, -2.0, 4.0, 0.5, 9.0, 2.0]
    prot = [False] * 8
    out = sel(pos, sc, prot, 3)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [1, 3, 5])
    np.testing.assert_array_equal(sel(pos, sc, prot, 1), [3])
    np.testing.assert_array_equal(sel(pos, sc, prot, 0), np.empty(0, np.int64))


def test_unsorted_positions_result_sorted():
    pos = [40, 7, 23, 11, 2]
    sc = [0.1, 0.3, -1.0, 0.2, 5.0]
    np.testing.assert_array_equal(sel(pos, sc, [False] * 5, 3), [11, 23, 40])


def test_ties_broken_by_older_first():
    pos = [9, 3, 7, 5, 1]
    sc = [1.0, 1.0, 1.0, 0.0, 1.0]
    prot = [False] * 5
    np.testing.assert_array_equal(sel(pos, sc, prot, 1), [5])
    np.testing.assert_array_equal(sel(pos, sc, prot, 2), [1, 5])
    np.testing.assert_array_equal(sel(pos, sc, prot, 3), [1, 3, 5])
    np.testing.assert_array_equal(sel(pos, sc, prot, 4), [1, 3, 5, 7])


def test_nan_counts_as_lowest():
    pos = [0, 1, 2, 3, 4]
    sc = [-100.0, np.nan, -np.inf, np.nan, 0.0]
    prot = [False] * 5
    np.testing.assert_array_equal(sel(pos, sc, prot, 1), [1])
    np.testing.assert_array_equal(sel(pos, sc, prot, 2), [1, 3])
    np.testing.assert_array_equal(sel(pos, sc, prot, 3), [1, 2, 3])
    np.testing.assert_array_equal(sel(pos, sc, prot, 4), [0, 1, 2, 3])


def test_protected_never_chosen():
    pos = np.arange(10)
    sc = np.array([-5.0, np.nan, 1, 2, 3, 4, 5, 6, 7, -9.0])
    prot = np.zeros(10, bool)
    prot[[0, 1, 9]] = True
    np.testing.assert_array_equal(sel(pos, sc, prot, 2), [2, 3])
    out = sel(pos, sc, prot, 100)
    np.testing.assert_array_equal(out, np.arange(2, 9))


def test_n_evict_larger_than_available():
    out = sel([3, 1, 2], [0.0, 0.0, 0.0], [False, True, False], 10)
    np.testing.assert_array_equal(out, [2, 3])
    assert sel([3, 1], [0.0, 0.0], [True, True], 5).shape == (0,)
    assert sel([], [], [], 3).shape == (0,)


def test_random_against_sort_reference():
    rng = np.random.default_rng(0)
    for _ in range(50):
        N = int(rng.integers(1, 60))
        pos = rng.choice(1000, size=N, replace=False)
        sc = rng.integers(0, 5, size=N).astype(float)  # many ties
        sc[rng.random(N) < 0.1] = np.nan
        prot = rng.random(N) < 0.3
        n = int(rng.integers(0, N + 3))
        cand = [(0 if np.isnan(s) else 1, 0.0 if np.isnan(s) else s, p)
                for p, s, pr in zip(pos, sc, prot) if not pr]
        exp = sorted(p for _, _, p in sorted(cand)[:n])
        np.testing.assert_array_equal(sel(pos, sc, prot, n), exp)


def test_validation():
    with pytest.raises(ValueError, match="length"):
        sel([0, 1], [0.0], [False, False], 1)
    with pytest.raises(ValueError, match="length"):
        sel([0, 1], [0.0, 1.0], [False], 1)
    with pytest.raises(ValueError, match="n_evict"):
        sel([0, 1], [0.0, 1.0], [False, False], -1)
    with pytest.raises(ValueError, match="duplicate"):
        sel([0, 1, 1], [0.0, 1.0, 2.0], [False] * 3, 1)
    with pytest.raises(ValueError, match="positions"):
        select_evictions(np.array([0.5, 1.0]), np.zeros(2), np.zeros(2, bool), 1)


def test_protected_mask_cases():
    pos = np.arange(20)
    m = protected_mask(pos, n_sink=2, n_recent=3, newest_pos=19, prompt_end=None)
    assert m.dtype == bool
    np.testing.assert_array_equal(np.flatnonzero(m), [0, 1, 17, 18, 19])
    m = protected_mask(pos, n_sink=2, n_recent=3, newest_pos=19, prompt_end=6)
    np.testing.assert_array_equal(np.flatnonzero(m), [0, 1, 2, 3, 4, 5, 17, 18, 19])
    m = protected_mask(pos, n_sink=0, n_recent=0, newest_pos=19, prompt_end=None)
    assert not m.any()
    # newest_pos beyond the live positions (e.g. after eviction gaps)
    live = np.array([0, 4, 10, 25, 29])
    m = protected_mask(live, n_sink=1, n_recent=5, newest_pos=30, prompt_end=None)
    np.testing.assert_array_equal(m, [True, False, False, False, True])
    m = protected_mask(live, n_sink=0, n_recent=0, newest_pos=29, prompt_end=0)
    assert not m.any()


def test_protected_mask_validation():
    with pytest.raises(ValueError, match="n_sink"):
        protected_mask(np.arange(3), n_sink=-1, n_recent=0, newest_pos=2, prompt_end=None)
    with pytest.raises(ValueError, match="n_recent"):
        protected_mask(np.arange(3), n_sink=0, n_recent=-1, newest_pos=2, prompt_end=None)


def test_mask_then_select_end_to_end():
    pos = np.arange(12)
    sc = np.array([0, 0, 5, -1, 2, -3, 4, 1, 0, -7, -8, -9], float)
    prot = protected_mask(pos, n_sink=2, n_recent=3, newest_pos=11, prompt_end=None)
    np.testing.assert_array_equal(select_evictions(pos, sc, prot, 3), [3, 5, 8])


def _reference_select(positions, scores, protected, n):
    """The definition, by a full lexsort: NaN first, then score ascending, then older position first."""
    pos, sc = np.asarray(positions, np.int64), np.asarray(scores, np.float64)
    cand = ~np.asarray(protected, bool)
    cpos, csc = pos[cand], sc[cand]
    isnan = np.isnan(csc)
    order = np.lexsort((cpos, np.where(isnan, 0.0, csc), ~isnan))
    return np.sort(cpos[order[:min(n, len(cpos))]])


@pytest.mark.parametrize("seed", range(40))
def test_partition_selection_equals_the_full_sort_definition(seed):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(1, 400))
    pos = np.sort(rng.choice(10 * N, size=N, replace=False))
    if seed % 3 == 0:
        pos = rng.permutation(pos)  # unsorted input is sorted internally
    kind = seed % 4
    sc = {0: rng.normal(size=N), 1: rng.integers(0, 3, N).astype(float), 2: np.full(N, 0.5),
          3: np.where(rng.random(N) < 0.3, np.nan, rng.normal(size=N))}[kind]
    if seed % 5 == 0:
        sc[rng.random(N) < 0.1] = -np.inf
    prot = rng.random(N) < 0.3
    for n in (0, 1, 7, N // 2, N, N + 5):
        np.testing.assert_array_equal(select_evictions(pos, sc, prot, n), _reference_select(pos, sc, prot, n))
