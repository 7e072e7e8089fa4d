"""Long-range metrics: key-token mask, restricted means, answer span, paired bootstrap, the key grid, collapse
metrics on crafted texts, and one tiny real run (fields present and finite, zero at full budget)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from epikv_local.eval import collapse as C
from epikv_local.eval import longrange as lr
from epikv_local.eval.fidelity import StreamingComparison, position_metrics, summarize
from epikv_local.eval.stats import bootstrap_ci, log_softmax

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"


# -- key tokens and restricted means ----------------------------------------------------------------------------
def test_key_token_mask_by_hand():
    full = np.array([1.0, 2.0, 3.0, 0.5, np.nan, 1.0])
    win = np.array([1.2, 4.0, 3.5, 2.0, 5.0, 2.0])
    # gains 0.2, 2.0, 0.5, 1.5, nan, 1.0 (not > 1.0: strict)
    assert lr.key_token_mask(full, win, 1.0).tolist() == [False, True, False, True, False, False]
    assert lr.key_token_mask(full, win, 0.4).tolist() == [False, True, True, True, False, True]
    with pytest.raises(ValueError):
        lr.key_token_mask(full, win[:3], 1.0)


def test_masked_means_by_hand():
    pp = {"delta_nll": np.array([0.1, 0.5, -0.2, 0.9]), "top1_agreement": np.array([1.0, 0.0, 1.0, 0.0])}
    m = lr.masked_means(pp, np.array([False, True, False, True]), "key_")
    assert m["key_delta_nll"] == pytest.approx(0.7) and m["key_top1_agreement"] == 0.0
    empty = lr.masked_means(pp, np.zeros(4, bool), "key_")
    assert all(math.isnan(v) for v in empty.values())


def test_window_blocks_cover_positions_with_the_promised_context():
    blocks = lr.window_blocks(10, 21, window=4, stride=2)
    seen = []
    for a, s, e in blocks:
        for t in range(s, e):
            assert 4 <= t - a + 1 <= 4 + 2 - 1  # between window and window + stride - 1 tokens
            seen.append(t)
    assert seen == list(range(10, 21))
    assert lr.window_blocks(0, 3, window=8, stride=4) == [(0, 0, 3)]  # short prefix: all of it
    assert lr.window_stride(64) == 32 and lr.window_blocks(5, 5, 4) == []


def test_answer_span_positions():
    head, body, tail = lr.answer_parts(" 42 ")
    assert body == "42" and head.endswith("\\boxed{") and tail.startswith("}")
    # trace of 10 tokens, head 3 tokens, answer 2: answer tokens at 13, 14, predicted at positions 12, 13
    assert lr.answer_positions(10, 3, 2).tolist() == [12, 13]
    with pytest.raises(ValueError):
        lr.answer_parts("  ")


def test_streaming_comparison_limit_and_restricted():
    rng = np.random.default_rng(3)
    n, v, start = 12, 6, 4
    tokens = rng.integers(0, v, size=start + n + 1)
    ref = log_softmax(rng.normal(size=(n, v)))
    ev = log_softmax(rng.normal(size=(n, v)))
    limit = start + 8  # positions >= limit (an appended answer) stay out of the all-token means
    cmp = StreamingComparison(ref, start, tokens, limit=limit)
    for i in range(0, n, 5):
        cmp(np.arange(start + i, start + min(i + 5, n)), ev[i:i + 5])
    whole = position_metrics(ref, ev, tokens[start + 1:start + n + 1])
    assert cmp.n == 8
    assert cmp.means()["delta_nll"] == pytest.approx(whole["delta_nll"][:8].mean(), rel=1e-12)
    pos = np.array([start + 1, start + 9, start + 10])
    r = cmp.restricted(pos, "answer_")
    assert r["n_answer"] == 3
    assert r["answer_delta_nll"] == pytest.approx(whole["delta_nll"][[1, 9, 10]].mean(), rel=1e-12)
    assert r["answer_top1_agreement"] == pytest.approx(whole["top1_agreement"][[1, 9, 10]].mean())


# -- paired comparisons -------------------------------------------------------------------------------------------
def test_paired_bootstrap_ci():
    x = [0.31, 0.05, 0.22, 0.40, 0.18, None]
    y = [0.20, 0.07, 0.10, 0.25, 0.11, 0.3]
    mean, lo, hi, n = lr.paired_bootstrap_ci(x, y, n_resamples=2000, seed=5)
    d = np.array([0.11, -0.02, 0.12, 0.15, 0.07])
    assert n == 5 and mean == pytest.approx(d.mean())
    assert lo <= mean <= hi and lo < hi
    assert (mean, lo, hi) == pytest.approx(bootstrap_ci(d, n_resamples=2000, seed=5))
    assert lr.paired_bootstrap_ci(x, y, n_resamples=2000, seed=5) == (mean, lo, hi, n)  # deterministic


def _rows():
    rows = []
    for i, (s, e, ks, ke) in enumerate([(0.20, 0.25, 1.0, 0.7), (0.10, 0.12, 0.9, 0.8), (0.30, 0.29, 1.2, None)]):
        for pol, dn, kd in (("streaming", s, ks), ("epikv", e, ke)):
            rows.append({"trace_id": f"t{i}", "policy": pol, "kv_budget": 128, "flash_attn": True, "n_eval": 10,
                         "seconds": 1.0, "nll": 1 + dn, "nll_ref": 1.0, "delta_nll": dn, "top1_agreement": 0.8,
                         "kl": dn, "n_key": 0 if kd is None else 2, "key_fraction": 0.0 if kd is None else 0.2,
                         "key_delta_nll": kd, "key_top1_agreement": None if kd is None else 0.5})
    return rows


def test_summarize_adds_longrange_and_paired_fields():
    s = {x["policy"]: x for x in summarize(_rows(), n_resamples=500, seed=1)}
    ep = s["epikv"]
    assert ep["key_delta_nll"]["n_traces"] == 2 and ep["key_delta_nll"]["mean"] == pytest.approx(0.75)
    assert ep["n_key_positions"] == 4 and "paired_vs_streaming" not in s["streaming"]
    p = ep["paired_vs_streaming"]
    assert p["delta_nll"]["mean"] == pytest.approx((0.05 + 0.02 - 0.01) / 3)
    assert p["delta_nll"]["ci_low"] <= p["delta_nll"]["mean"] <= p["delta_nll"]["ci_high"]
    assert p["key_delta_nll"]["n_traces"] == 2 and p["key_delta_nll"]["mean"] == pytest.approx((-0.3 - 0.1) / 2)
    assert p["nll_ref"]["mean"] == 0.0
    old = [{k: v for k, v in r.items() if not k.startswith(("key", "n_key"))} for r in _rows()]
    assert "key_delta_nll" not in summarize(old)[0]  # old rows still summarise


def test_key_grid_and_selection():
    pos = np.arange(100, 110)
    win = {8: np.full(10, 2.0), 16: np.array([1.0] * 9 + [2.5])}
    traces = []
    for k, off in enumerate((0.0, 0.1, 0.3)):
        nll_ref = np.ones(10)
        passes = {("streaming", 100): {"positions": pos, "nll_ref": nll_ref, "delta_nll": np.full(10, 0.2 + off),
                                       "top1_agreement": np.ones(10)},
                  ("random", 100): {"positions": pos, "nll_ref": nll_ref, "delta_nll": np.full(10, 0.1 + 2 * off),
                                    "top1_agreement": np.zeros(10)}}
        traces.append({"positions": pos, "window_nll": win, "passes": passes})
    grid = lr.key_grid(traces, [8, 16], [0.5, 2.0], n_resamples=200)
    by = {(g["window"], g["threshold"]): g for g in grid}
    assert by[(8, 0.5)]["key_share"] == 1.0 and by[(8, 2.0)]["key_share"] == 0.0
    assert by[(16, 0.5)]["key_share"] == pytest.approx(0.1) and by[(16, 0.5)]["n_key"] == 3
    assert by[(16, 2.0)]["key_share"] == 0.0
    assert by[(16, 0.5)]["paired"]["mean"] == pytest.approx(np.mean([-0.1, 0.0, 0.2]))
    choice = lr.select_key_setting(grid, 100)
    assert (choice["window"], choice["threshold"]) == (16, 0.5)  # the only share in [5 %, 20 %]


# -- collapse metrics on crafted texts ----------------------------------------------------------------------------
LOOPING = "We need to find x. " + "So the answer is 5. " * 12
VARIED = ("First we expand the square, then collect like terms and divide both sides by three to isolate the "
          "variable; finally we check the result against the original equation and find it holds.")


def test_collapse_metrics_loop_vs_varied():
    lw, vw = LOOPING.split(), VARIED.split()
    loop = C.collapse_metrics(lw, LOOPING, "max_tokens")
    var = C.collapse_metrics(vw, VARIED + " \\boxed{3}", "eog")
    assert loop["loop"] == 1.0 and loop["loop_period"] == 5 and loop["loop_share"] == pytest.approx(60 / 65)
    assert loop["longest_repeat_share"] == pytest.approx(55 / 65)  # 12 periods of 5 overlap themselves
    assert loop["distinct_2"] == pytest.approx(10 / 64) and loop["distinct_3"] < 0.2
    assert var["loop"] == 0.0 and var["loop_share"] == 0.0 and var["distinct_2"] == 1.0 and var["distinct_3"] == 1.0
    assert var["longest_repeat_share"] == pytest.approx(1 / 32)  # "the" twice
    assert (loop["no_boxed"], loop["hit_max_tokens"], var["no_boxed"], var["hit_max_tokens"]) == (1, 1, 0, 0)
    assert loop["distinct_2_prefix"] == pytest.approx(C.distinct_n(lw[:64], 2))  # first 64 of 65 words
    assert math.isnan(var["distinct_2_prefix"])  # 32 words: shorter than the prefix
    assert C.collapse_metrics(vw, VARIED, "eog", prefix=10)["distinct_3_prefix"] == 1.0
    assert C.collapse_metrics([], "  ", "eog")["empty"] == 1.0


def test_collapse_primitives_by_hand():
    assert C.longest_repeat(list("abcabcab")) == 5 and C.longest_repeat(list("abcd")) == 0
    assert C.distinct_n(list("aaaa"), 2) == pytest.approx(1 / 3) and math.isnan(C.distinct_n(["a"], 2))
    assert C.tail_loop(list("xyz" + "ab" * 14), min_span=6) == (2, 28)
    assert C.tail_loop(list("xyz" + "ab" * 3), min_span=1) == (2, 6)  # three periods: a loop
    assert C.tail_loop(list("xyz" + "ab" * 2), min_span=1) == (0, 0)  # two periods: not yet


def test_summarize_collapse_pairs_with_full_cache():
    rows = []
    for i, (full, ev) in enumerate([(0.9, 0.5), (0.8, 0.8), (0.95, 0.6)]):
        rows.append({"prompt_id": f"p{i}", "policy": "none", "kv_budget": None, "distinct_2": full,
                     "n_generated": 10, "seconds": 1.0})
        rows.append({"prompt_id": f"p{i}", "policy": "streaming", "kv_budget": 64, "distinct_2": ev,
                     "n_generated": 10, "seconds": 1.0})
    s = {x["policy"]: x for x in C.summarize_collapse(rows, metrics=("distinct_2",), n_resamples=300)}
    p = s["streaming"]["paired_vs_none"]["distinct_2"]
    assert p["mean"] == pytest.approx(np.mean([-0.4, 0.0, -0.35])) and p["n_prompts"] == 3
    assert p["ci_low"] <= p["mean"] <= p["ci_high"] and "paired_vs_none" not in s["none"]


# -- one tiny real run -----------------------------------------------------------------------------------------------
def test_real_run_fields_and_full_budget_zero(model):
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.eval.fidelity import (TraceSpans, answer_suffix, compare_pass, evaluate_trace,
                                           key_positions_of, local_window_nll, reference_pass)
    from epikv_local.eval.traces import load_traces

    (tid, toks), = load_traces(TRACES, model, max_tokens=200, n_traces=1)
    rec = next(json.loads(ln) for ln in TRACES.read_text().splitlines() if json.loads(ln)["id"] == tid)
    suffix = answer_suffix(model, rec["answer"])
    full = toks + suffix.tokens
    window, thr, start = 32, 0.5, 64
    ref = reference_pass(model, full, chunk=16, flash_attn=True, eval_start=start)
    wnll = local_window_nll(model, toks, window, start, len(toks) - 1)
    assert wnll.shape == (len(toks) - 1 - start,) and np.all(np.isfinite(wnll))
    spans = TraceSpans(len(toks), key_positions_of(ref, full, wnll, thr, len(toks)), suffix.positions(len(toks)),
                       window, thr)
    assert len(spans.key_positions) > 0 and len(spans.answer_positions) == suffix.n_answer
    # a budget above the whole sequence evicts nothing: exactly zero everywhere
    row = compare_pass(model, full, ref, "epikv", BudgetConfig(kv_budget=512, protect_prompt=False), chunk=16,
                       eval_start=start, spans=spans)
    assert row["n_evicted"] == 0 and row["n_tokens"] == 200 and row["n_eval"] == 200 - 1 - start
    assert row["n_key"] == len(spans.key_positions) and row["n_answer"] == suffix.n_answer
    assert row["key_delta_nll"] == 0.0 and row["answer_delta_nll"] == 0.0 and row["delta_nll"] == 0.0
    assert row["key_kl"] == 0.0 and row["key_top1_agreement"] == 1.0 and row["answer_top1_agreement"] == 1.0
    # budget 64, two policies, through the harness (the window pass reused)
    rows = evaluate_trace(model, toks, ["streaming", "epikv"], [64], answer=rec["answer"], key_window=window,
                          key_threshold=thr, window_nll=wnll)
    assert [r["policy"] for r in rows] == ["streaming", "epikv"]
    for r in rows:
        assert r["n_evicted"] > 0 and r["max_live"] <= 64 and r["n_key"] == len(spans.key_positions)
        for k in lr.PAIRED_METRICS + ("key_fraction",):
            assert isinstance(r[k], float) and math.isfinite(r[k]), k
        assert r["key_nll"] == pytest.approx(r["key_nll_ref"] + r["key_delta_nll"], abs=1e-9)
        assert r["n_answer"] == suffix.n_answer and 0 <= r["answer_top1_agreement"] <= 1
    s = summarize([{"trace_id": tid, **r} for r in rows], n_resamples=100)
    assert "paired_vs_streaming" in next(x for x in s if x["policy"] == "epikv")


def test_bench_collapse_quick(model_path, tmp_path):
    spec = importlib.util.spec_from_file_location("_bench_collapse", REPO / "scripts" / "bench_collapse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--n-prompts", "1", "--max-tokens", "24", "--budgets", "64", "--policies", "streaming",
                     "--name", "quick", "--out", str(tmp_path), "--bootstrap", "50"]) == 0
    doc = json.loads((tmp_path / "collapse_quick.json").read_text())
    assert {(r["policy"], r["kv_budget"]) for r in doc["rows"]} == {("none", None), ("streaming", 64)}
    for r in doc["rows"]:
        assert 1 <= r["n_generated"] <= 24 and r["stop_reason"] in ("eog", "max_tokens")
        assert r["seed"] == 0 and r["max_live"] <= (64 if r["policy"] == "streaming" else 10**6)
    ev = next(s for s in doc["summary"] if s["policy"] == "streaming")
    assert set(C.COLLAPSE_METRICS) <= set(ev["paired_vs_none"])

    # a second part with the model's (shipped) calibration, on the same prompt: merged, the full cache kept once
    # and the pairs recomputed; a part on another prompt (--skip-prompts) is refused
    assert mod.main(["--n-prompts", "1", "--max-tokens", "24", "--budgets", "64", "--policies", "random",
                     "--calibration", "auto", "--name", "cal", "--out", str(tmp_path), "--bootstrap", "50"]) == 0
    cal = json.loads((tmp_path / "collapse_cal.json").read_text())
    sel = cal["settings"]["calibration"]["selected_by_budget"]
    runs = {(r["policy"], r["kv_budget"]): r for r in cal["rows"]}
    assert set(runs) == {("none", None), ("random", 64), ("epikv_calibrated", 64), ("calibrated", 64)}
    if sel:  # the calibrated run used the choice for budget 64 and its recent share
        assert runs[("calibrated", 64)]["recent_fraction"] == sel["64"]["recent_fraction"]
    assert runs[("none", None)]["tokens"] == doc["rows"][0]["tokens"]  # same prompt and seed: same generation
    assert mod.main(["--merge", f"{tmp_path / 'collapse_quick.json'},{tmp_path / 'collapse_cal.json'}",
                     "--name", "both", "--out", str(tmp_path), "--bootstrap", "50"]) == 0
    both = json.loads((tmp_path / "collapse_both.json").read_text())
    assert sorted((r["policy"], r["kv_budget"] or 0) for r in both["rows"]) == sorted(
        [("none", 0), ("streaming", 64), ("random", 64), ("epikv_calibrated", 64), ("calibrated", 64)])
    assert {s["policy"] for s in both["summary"]} == {"none", "streaming", "random", "epikv_calibrated", "calibrated"}
    assert mod.main(["--n-prompts", "1", "--skip-prompts", "1", "--max-tokens", "24", "--budgets", "64",
                     "--policies", "streaming", "--name", "other", "--out", str(tmp_path), "--bootstrap", "50"]) == 0
    other = json.loads((tmp_path / "collapse_other.json").read_text())
    assert other["settings"]["prompt_ids"] != doc["settings"]["prompt_ids"]
    assert mod.main(["--merge", f"{tmp_path / 'collapse_quick.json'},{tmp_path / 'collapse_other.json'}",
                     "--name", "bad", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "collapse_bad.json").exists()
