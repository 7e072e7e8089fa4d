"""Counterfactual labels on a tiny trace of the real model: control ~ 0, finite labels, resumability, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epikv_local.eval.labels import LabelSettings, label_trace, read_labels
from epikv_local.eval.stats import nll_rows

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"
CLI = [sys.executable, "-m", "epikv_local.cli"]
SETTINGS = dict(max_tokens=64, horizon=8, stride=8, min_pos=8)


def test_nll_rows_by_hand():
    logits = np.array([[0.0, 0.0], [np.log(3.0), 0.0]], dtype=np.float32)
    assert nll_rows(logits, np.array([0, 1])) == pytest.approx([np.log(2.0), np.log(4.0)], abs=1e-6)


def test_checkpoints_and_candidates():
    s = LabelSettings(**SETTINGS)
    ck = s.checkpoints(64)
    assert ck[0] == 16 and ck[-1] + s.horizon <= 63  # c=8 has no candidate >= min_pos
    assert list(s.candidates(24)) == list(range(15, 23))  # D = c - p in 2 .. 9
    with pytest.raises(ValueError, match="delay must be >= 2"):
        LabelSettings(**{**SETTINGS, "delay": 1})
    s2 = LabelSettings(**{**SETTINGS, "delay": 4})
    assert list(s2.candidates(24)) == list(range(13, 21))  # D = c - p in 4 .. 11


def test_labels_tiny_trace(model, dev_traces):
    toks = model.tokenize(dev_traces[0]["problem"] + "\n\n" + dev_traces[0]["trace"])[:64]
    s = LabelSettings(**SETTINGS)
    rows, sec, n = label_trace(model, "t0", toks, s, n_threads=2, control=True)
    ctrl = [r for r in rows if r["type"] == "control"]
    lab = [r for r in rows if r["type"] == "label"]
    assert len(ctrl) == len(s.checkpoints(64))
    # re-decoding the no-removal branch reproduces the baseline (removing nothing changes nothing)
    assert max(abs(r["label"]) for r in ctrl) < 1e-3
    assert n == len(lab) == sum(len(s.candidates(c)) for c in s.checkpoints(64))
    vals = np.array([r["label"] for r in lab])
    assert np.all(np.isfinite(vals))
    assert np.abs(vals).max() > 1e-3  # removing a token does change the predictions
    for r in lab:
        assert 2 <= r["delay"] <= s.stride + 1 and r["token"] == toks[r["position"]]
    # the most recent labelled tokens matter more than the control noise on average
    d1 = [r["label"] for r in lab if r["delay"] == 2]
    assert np.mean(d1) > 10 * max(abs(r["label"]) for r in ctrl)


def test_batched_branches_give_the_same_labels(model, dev_traces):
    """8 counterfactual branches per llama_decode (sequences 1..8 sharing the prefix cells) give the labels of
    one branch per decode (both without flash attention, which batched branches use: see _Brancher); the
    control row (no removal, decoded in the same batch as the base branch) stays ~0."""
    toks = model.tokenize(dev_traces[0]["problem"] + "\n\n" + dev_traces[0]["trace"])[:64]
    one, _, n1 = label_trace(model, "t0", toks, LabelSettings(**SETTINGS, flash_attn=False), n_threads=2,
                             control=True)
    many, _, n8 = label_trace(model, "t0", toks, LabelSettings(**SETTINGS, batch=8), n_threads=2, control=True)
    assert n1 == n8 and len(one) == len(many)
    for a, b in zip(one, many):
        assert (a["type"], a.get("position"), a["checkpoint"]) == (b["type"], b.get("position"), b["checkpoint"])
        assert abs(a["label"] - b["label"]) < 1e-5, (a, b)
    assert max(abs(r["label"]) for r in many if r["type"] == "control") < 1e-3
    assert np.abs([r["label"] for r in many if r["type"] == "label"]).max() > 1e-2
    with pytest.raises(ValueError, match="batch"):
        LabelSettings(**SETTINGS, batch=0)


def test_labels_cli_resumable(model_path, tmp_path):
    out = tmp_path / "labels.jsonl"
    args = ["labels", "--model", str(model_path), "--traces", str(TRACES), "--n-traces", "1",
            "--max-tokens", "64", "--horizon", "8", "--stride", "8", "--min-pos", "8", "--out", str(out),
            "--threads", "2"]
    r = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    header, rows = read_labels(out)
    assert header["horizon"] == 8 and header["stride"] == 8
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["n_labelled"] == len(rows) > 0 and stats["seconds_per_position"] > 0
    first = out.read_text()
    r2 = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert out.read_text() == first  # nothing added
    assert json.loads(r2.stdout.strip().splitlines()[-1])["n_labelled"] == 0
    # other settings on the same file: refused, one line
    r3 = subprocess.run(CLI + args[:-2] + ["--horizon", "4", "--threads", "2"], capture_output=True, text=True,
                        timeout=300)
    assert r3.returncode == 2 and "other settings" in r3.stderr
