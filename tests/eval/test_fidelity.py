"""Teacher-forced fidelity: metrics by hand, bootstrap CI, full-budget invariance on the real model, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epikv_local.eval.fidelity import (
    METRICS,
    StreamingComparison,
    compare_pass,
    position_metrics,
    reference_pass,
    summarize,
)
from epikv_local.errors import DataError
from epikv_local.eval.stats import bootstrap_ci, log_softmax
from epikv_local.eval.traces import load_traces

REPO = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, str(REPO / "scripts" / "bench_fidelity.py")]
TRACES = REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"


def bench(*args, timeout=900):
    return subprocess.run(BENCH + list(args), capture_output=True, text=True, timeout=timeout)


# -- (b) metrics against hand computation ------------------------------------------------------------------------
def _hand(ref_logits, ev_logits, target):
    def lsm(row):
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        return [x - lse for x in row]

    r, e = lsm(ref_logits), lsm(ev_logits)
    nll, nll_ref = -e[target], -r[target]
    kl = sum(math.exp(a) * (a - b) for a, b in zip(r, e))
    agree = float(max(range(len(r)), key=r.__getitem__) == max(range(len(e)), key=e.__getitem__))
    return {"nll": nll, "nll_ref": nll_ref, "delta_nll": nll - nll_ref, "top1_agreement": agree, "kl": kl}


def test_metrics_match_hand_computation():
    ref_logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0], [1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    ev_logits = np.array([[1.0, 2.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0], [4.0, 2.0, 3.0, 1.0]], dtype=np.float32)
    targets = np.array([0, 2, 1])
    ref, ev = log_softmax(ref_logits), log_softmax(ev_logits)
    assert ref.dtype == np.float32 and np.allclose(np.exp(ref.astype(np.float64)).sum(axis=1), 1.0, atol=1e-6)
    m = position_metrics(ref, ev, targets)
    for i in range(3):
        want = _hand(ref_logits[i].tolist(), ev_logits[i].tolist(), int(targets[i]))
        for k in METRICS:
            assert m[k][i] == pytest.approx(want[k], abs=1e-5), (i, k)
    # row 1 is identical: exactly zero difference, full agreement
    assert m["delta_nll"][1] == 0.0 and m["kl"][1] == 0.0 and m["top1_agreement"][1] == 1.0
    assert m["top1_agreement"].tolist() == [0.0, 1.0, 0.0]
    assert np.all(m["kl"] >= 0)
    # a stable log-softmax: huge logits neither overflow nor lose the differences
    big = log_softmax(np.array([[1000.0, 999.0, -1000.0]], dtype=np.float32))
    assert np.all(np.isfinite(big)) and big[0, 0] == pytest.approx(-math.log1p(math.exp(-1.0)), abs=1e-6)


def test_streaming_comparison_equals_one_shot():
    rng = np.random.default_rng(1)
    n, v, start = 10, 7, 5
    tokens = rng.integers(0, v, size=start + n + 1)
    ref = log_softmax(rng.normal(size=(n, v)))
    ev = log_softmax(rng.normal(size=(n, v)))
    cmp = StreamingComparison(ref, start, tokens)
    for i in range(0, n, 4):  # chunks of 4, 4, 2
        cmp(np.arange(start + i, start + min(i + 4, n)), ev[i:i + 4])
    whole = position_metrics(ref, ev, tokens[start + 1:start + n + 1])
    assert cmp.n == n
    for k in METRICS:
        assert cmp.means()[k] == pytest.approx(whole[k].mean(), rel=1e-12)


# -- (d) bootstrap -------------------------------------------------------------------------------------------------
def test_bootstrap_ci_contains_mean_and_is_deterministic():
    vals = [0.31, 0.05, 0.22, 0.4, 0.18, 0.27, 0.11, 0.6]
    mean, lo, hi = bootstrap_ci(vals, n_resamples=1000, seed=7)
    assert mean == pytest.approx(np.mean(vals))
    assert lo <= mean <= hi and lo < hi
    assert min(vals) <= lo and hi <= max(vals)
    assert bootstrap_ci(vals, n_resamples=1000, seed=7) == (mean, lo, hi)
    assert bootstrap_ci(vals, n_resamples=1000, seed=8) != (mean, lo, hi)
    assert bootstrap_ci([0.5]) == (0.5, 0.5, 0.5)
    rows = [{"policy": "p", "kv_budget": 8, "flash_attn": True, "n_eval": 3, "seconds": 1.0,
             **{k: v for k in METRICS}} for v in vals]
    s = summarize(rows, n_resamples=1000, seed=7)
    assert len(s) == 1 and s[0]["n_traces"] == len(vals)
    assert (s[0]["kl"]["mean"], s[0]["kl"]["ci_low"], s[0]["kl"]["ci_high"]) == (mean, lo, hi)


# -- (c) full-budget invariance on the real model -----------------------------------------------------------------
def test_budget_above_trace_equals_reference(model):
    traces = load_traces(TRACES, model, max_tokens=150, n_traces=1)
    assert traces and len(traces[0][1]) == 150
    _, toks = traces[0]
    from epikv_local.engine.budget import BudgetConfig

    ref = reference_pass(model, toks, chunk=16, flash_attn=True, eval_start=0)
    assert ref.logp.shape == (149, model.info.n_vocab) and ref.logp.dtype == np.float32
    row = compare_pass(model, toks, ref, "epikv", BudgetConfig(kv_budget=256, protect_prompt=False), chunk=16,
                       eval_start=0)
    assert row["n_eval"] == 149 and row["n_evicted"] == 0
    assert row["delta_nll"] == 0.0 and row["kl"] == 0.0 and row["top1_agreement"] == 1.0
    assert row["nll"] == row["nll_ref"] and math.isfinite(row["nll"]) and row["nll"] > 0


def test_load_traces_truncates_and_skips(model, tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"id": "short", "problem": "1+1?", "trace": "2"}) + "\n"
                 + json.dumps({"id": "long", "problem": "Count.", "trace": " one two three" * 50}) + "\n")
    got = load_traces(f, model, max_tokens=40, n_traces=5)
    assert [t for t, _ in got] == ["long"] and len(got[0][1]) == 40
    assert got[0][1] == model.tokenize("Count.\n\n" + " one two three" * 50)[:40]
    with pytest.raises(DataError, match="not found"):
        load_traces(tmp_path / "missing.jsonl", model, 40)


# -- (a) the benchmark CLI end to end ------------------------------------------------------------------------------
def test_bench_quick_end_to_end(model_path, tmp_path):
    r = bench("--quick", "--model", str(model_path), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "fidelity_quick.jsonl").read_text().splitlines()]
    assert {(x["policy"], x["kv_budget"]) for x in rows} == {("streaming", 128), ("epikv", 128)}
    for x in rows:
        assert x["n_tokens"] == 300 and x["n_eval"] == 300 - 1 - 128
        assert x["max_live"] <= 128 and x["n_evicted"] > 0 and x["flash_attn"] is True
        for k in METRICS:
            assert math.isfinite(x[k]), k
        assert 0.0 <= x["top1_agreement"] <= 1.0 and x["kl"] >= 0.0
        assert x["nll"] == pytest.approx(x["nll_ref"] + x["delta_nll"], abs=1e-9)
    doc = json.loads((tmp_path / "fidelity_quick_summary.json").read_text())
    for key in ("command", "git_revision", "date", "machine", "model", "settings", "results"):
        assert key in doc, key
    assert "--quick" in doc["command"] and doc["git_revision"]
    assert doc["model"]["size_bytes"] > 0 and len(doc["model"]["sha256_first_1MiB"]) == 64
    assert doc["machine"]["cpu_count"] >= 1 and doc["settings"]["budgets"] == [128]
    assert len(doc["results"]) == 2
    for s in doc["results"]:
        assert s["n_traces"] == 1
        for k in ("delta_nll", "top1_agreement", "kl"):
            m = s[k]
            assert all(math.isfinite(m[f]) for f in ("mean", "ci_low", "ci_high"))
            assert m["ci_low"] <= m["mean"] <= m["ci_high"]
        assert 0.0 <= s["top1_agreement"]["mean"] <= 1.0 and s["kl"]["mean"] >= 0.0
    assert "top-1 agreement" in r.stdout and "streaming" in r.stdout and "epikv" in r.stdout


def test_bench_merge_of_parts_equals_one_run(model_path, tmp_path):
    """A result made in parts (--merge) has the rows and the summary of the same run made at once."""
    common = ["--quick", "--model", str(model_path), "--key-window", "0", "--no-answer-span"]
    for name, pols in (("a", "streaming"), ("b", "epikv"), ("all", "streaming,epikv")):
        r = bench(*common, "--policies", pols, "--name", name, "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr
    r = bench("--merge", f"{tmp_path / 'fidelity_a.jsonl'},{tmp_path / 'fidelity_b.jsonl'}", "--name", "merged",
              "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    drop = ("seconds", "decode_seconds", "ref_seconds")
    rows = lambda n: sorted(({k: v for k, v in json.loads(ln).items() if k not in drop}
                             for ln in (tmp_path / f"fidelity_{n}.jsonl").read_text().splitlines()),
                            key=lambda x: x["policy"])
    assert rows("merged") == rows("all")
    res = lambda n: sorted(({k: v for k, v in x.items() if k != "seconds_per_pass"} for x in
                            json.loads((tmp_path / f"fidelity_{n}_summary.json").read_text())["results"]),
                           key=lambda x: x["policy"])
    assert res("merged") == res("all")
    _one_line_error(bench("--merge", str(tmp_path / "fidelity_a.jsonl") + "," + str(tmp_path / "fidelity_a.jsonl"),
                          "--out", str(tmp_path)), "appears twice")


def _one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bench_fidelity: error:") and needle in lines[0], r.stderr


def test_bench_bad_input(model_path, tmp_path):
    _one_line_error(bench("--model", str(model_path), "--policies", "nope", "--out", str(tmp_path)),
                    "unknown policy")
    _one_line_error(bench("--model", str(model_path), "--budgets", " , ", "--out", str(tmp_path)), "empty")
    _one_line_error(bench("--model", str(model_path), "--traces", str(tmp_path / "missing.jsonl"),
                          "--out", str(tmp_path)), "not found")
    _one_line_error(bench("--model", str(model_path), "--budgets", "2048", "--max-tokens", "512",
                          "--out", str(tmp_path)), "no budget below")
    _one_line_error(bench("--bogus-flag"), "unrecognized")
