"""calibrate's accuracy objective (epikv_local/eval/calibrate_accuracy.py): dev problems only, the rule that
chooses (most right answers, a tie keeps the lower ΔNLL), and the command end to end on the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epikv_local.errors import ConfigError, DataError
from epikv_local.eval import calibrate_accuracy as ca

CLI = [sys.executable, "-m", "epikv_local.cli"]
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "r1_traces_dev.jsonl"


def _problems(tmp_path, splits=("test", "dev", "dev", "dev"), name="gsm8k.jsonl") -> Path:
    f = tmp_path / name
    f.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} plus 3?", "answer": str(i + 3),
                                     "split": s}) + "\n" for i, s in enumerate(splits)))
    return f


def test_dev_problems_only_and_bad_files(tmp_path):
    f = _problems(tmp_path)
    assert [p["id"] for p in ca.dev_problems(f, 2)] == ["q1", "q2"]  # q0 is a test problem: never used
    with pytest.raises(DataError, match="no dev problem"):
        ca.dev_problems(_problems(tmp_path, ("test", "test"), "test_only.jsonl"), 5)
    with pytest.raises(DataError, match="not found"):
        ca.dev_problems(tmp_path / "none.jsonl", 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "question": "x", "answer": "1", "split": "dev"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        ca.dev_problems(bad, 5)
    with pytest.raises(ConfigError, match="top_k"):
        ca.AccuracyObjective(str(f), top_k=0)


def _row(a, b, nll, w=128, rf=0.5):
    return {"layer_a": a, "layer_b": b, "window": w, "recent_fraction": rf, "delta_nll": nll}


@pytest.mark.parametrize("rights, want, changed", [
    ({(3, 9): 1, (4, 9): 2, (5, 10): 1}, (4, 9), True),    # more right answers beat a lower ΔNLL
    ({(3, 9): 2, (4, 9): 2, (5, 10): 1}, (3, 9), False),   # a tie keeps the lower ΔNLL: step 2's choice
    ({(3, 9): 0, (4, 9): 0, (5, 10): 1}, (5, 10), True),   # the default is a candidate too
])
def test_the_most_right_answers_win_and_a_tie_keeps_the_lower_delta_nll(monkeypatch, tmp_path, rights, want,
                                                                       changed):
    grid = [_row(3, 9, 0.10), _row(4, 9, 0.12), _row(6, 11, 0.30), _row(5, 10, 0.20)]
    default = grid[3]
    asked = []

    def fake(model, problems, policy, budget, max_tokens, n_threads=None):
        layers = getattr(policy, "layers", None)
        asked.append(layers)
        n = 0 if layers is None else rights[tuple(layers)]
        assert budget.protect_prompt is False and budget.kv_budget == 160 and max_tokens == 50
        return {"correct": [True] * n + [False] * (len(problems) - n), "n_right": n, "mean_generated": 10.0,
                "seconds": 0.0}

    monkeypatch.setattr(ca, "answer_accuracy", fake)
    obj = ca.AccuracyObjective(str(_problems(tmp_path)), n_problems=2, kv_budget=160, max_tokens=50, top_k=2)
    chosen, rec = ca.choose_by_accuracy(None, grid, default, obj)
    assert (chosen["layer_a"], chosen["layer_b"]) == want and rec["changed_choice"] is changed
    assert asked[0] is None  # StreamingLLM first, as the reference
    assert [tuple(x) for x in asked[1:]] == [(3, 9), (4, 9), (5, 10)]  # top 2 by ΔNLL and the default, ΔNLL order
    assert rec["problem_ids"] == ["q1", "q2"] and rec["split"] == "dev" and rec["prompt"] == "counted"
    assert rec["delta_nll_choice"]["layer_a"] == 3 and rec["streaming"]["n_right"] == 0


def test_the_default_among_the_best_is_answered_once(monkeypatch, tmp_path):
    grid = [_row(3, 9, 0.10), _row(4, 9, 0.12), _row(6, 11, 0.30)]
    asked = []

    def fake(model, problems, policy, budget, max_tokens, n_threads=None):
        asked.append(getattr(policy, "layers", None))
        return {"correct": [False] * len(problems), "n_right": 0, "mean_generated": 1.0, "seconds": 0.0}

    monkeypatch.setattr(ca, "answer_accuracy", fake)
    obj = ca.AccuracyObjective(str(_problems(tmp_path)), n_problems=1, top_k=2)
    chosen, rec = ca.choose_by_accuracy(None, grid, grid[1], obj)  # the default is the second best
    assert [tuple(x) for x in asked[1:]] == [(3, 9), (4, 9)] and len(rec["candidates"]) == 2
    assert (chosen["layer_a"], rec["changed_choice"]) == (3, False)  # all tie at 0: the lower ΔNLL stays


def test_calibrate_objective_accuracy_end_to_end(model_path, tmp_path):
    f, out = _problems(tmp_path), tmp_path / "cal.json"
    r = subprocess.run(CLI + ["calibrate", "--model", str(model_path), "--traces", str(TRACES), "--quick",
                              "--no-signals", "--objective", "accuracy", "--problems", str(f),
                              "--accuracy-problems", "2", "--accuracy-budget", "96", "--accuracy-max-tokens", "24",
                              "--accuracy-top-k", "1", "--threads", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["objective"] == "accuracy"
    doc = json.loads(out.read_text())
    rec = doc["accuracy"]
    assert doc["objective"] == "accuracy" and rec["problem_ids"] == ["q1", "q2"]
    key = ("layer_a", "layer_b", "window", "recent_fraction")
    base = {k: doc["baseline"][k] for k in key}
    assert base in [{k: c[k] for k in key} for c in rec["candidates"]]  # the default was answered
    for c in rec["candidates"] + [rec["streaming"]]:
        assert len(c["correct"]) == 2 and c["n_right"] == sum(c["correct"])
    best = max(rec["candidates"], key=lambda c: (c["n_right"], -c["delta_nll"]))
    assert doc["chosen"] == rec["chosen"] == {k: best[k] for k in key}
    by_nll = min(doc["grid_results"], key=lambda g: g["delta_nll"])
    assert rec["changed_choice"] == (rec["chosen"] != {k: by_nll[k] for k in key})
    assert doc["cost_seconds"]["accuracy"] > 0


def test_calibrate_accuracy_bad_input_is_one_line(model_path, tmp_path):
    base = CLI + ["calibrate", "--model", str(model_path), "--traces", str(TRACES), "--quick", "--no-signals",
                  "--out", str(tmp_path / "c.json")]
    for args, needle in ((["--objective", "accuracy", "--problems", str(tmp_path / "none.jsonl")], "not found"),
                         (["--objective", "accuracy", "--problems",
                           str(_problems(tmp_path, ("test",), "test_only.jsonl"))],
                          "no dev problem"),
                         (["--problems", str(_problems(tmp_path))], "--objective accuracy"),
                         (["--accuracy-top-k", "3"], "--accuracy-top-k: only with --objective accuracy"),
                         (["--objective", "accuracy", "--problems", str(_problems(tmp_path)),
                           "--accuracy-budget", "0"], "--accuracy-budget must be at least 1"),
                         (["--objective", "accuracy", "--problems", str(_problems(tmp_path)),
                           "--accuracy-budget", "3"], "kv_budget")):
        r = subprocess.run(base + args, capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, r.stderr)
    assert not (tmp_path / "c.json").exists()
