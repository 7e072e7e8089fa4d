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
                              "--objective", "accuracy", "--problems", str(f),
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
    # step 3b in the same run: the quick grid's one cell (64) is the one that runs at 96 cells
    sig = doc["accuracy_signals"]
    assert sig["cell"] == 64 and sig["problem_ids"] == ["q1", "q2"]
    assert next(c for c in sig["candidates"] if c["policy"] == "streaming").get("reused") == "step 4"
    assert doc["selected"]["by_budget"][0]["policy"] == sig["chosen"]["policy"]
    assert doc["selected"]["by_budget"][0]["chosen_by"] == "accuracy"


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


# -- step 3b: the choice among the signals re-ranked on answers ------------------------------------------------
def _cand(policy, objs, rf=0.5, **options):
    return {"policy": policy, "options": options, "recent_fraction": rf, "objective": sum(objs.values()) / len(objs),
            "per_budget": {str(b): {"delta_nll": o, "key_delta_nll": o, "objective": o, "per_trace": [o]}
                           for b, o in objs.items()}}


def _selected():
    cands = [_cand("streaming", {128: 1.0, 256: 0.9, 512: 0.5}), _cand("keydiff", {128: 0.8, 256: 0.7, 512: 0.4}),
             _cand("epikv_mix", {128: 0.9, 256: 0.6, 512: 0.3}, rf=0.75, layers=[10], w_keydiff=2.0),
             _cand("rkv_redundancy", {128: 1.1, 256: 0.8, 512: 0.45})]
    cell = lambda b, c: {"kv_budget": b, "policy": c["policy"], "options": c["options"],  # noqa: E731
                         "recent_fraction": c["recent_fraction"], **c["per_budget"][str(b)], "vs_streaming": {}}
    return {"chosen": cell(256, cands[2]), "by_budget": [cell(128, cands[1]), cell(256, cands[2]),
                                                         cell(512, cands[2])], "candidates": cands}


@pytest.mark.parametrize("rights, want", [
    ({"streaming": 1, "epikv_mix": 2, "keydiff": 3}, "keydiff"),  # more right answers beat step 3's ΔNLL choice
    ({"streaming": 2, "epikv_mix": 2, "keydiff": 1}, "streaming"),  # a tie with StreamingLLM keeps StreamingLLM
    ({"streaming": 1, "epikv_mix": 2, "keydiff": 2}, "epikv_mix"),  # a tie among scored ones keeps step 3's choice
])
def test_the_signal_cell_at_the_accuracy_budget_is_re_ranked_on_answers(monkeypatch, tmp_path, rights, want):
    asked = []

    def fake(model, problems, policy, budget, max_tokens, n_threads=None):
        asked.append((policy.name, budget.recent_fraction))
        assert budget.kv_budget == 192 and budget.protect_prompt is False and max_tokens == 50
        n = rights[policy.name]
        return {"correct": [True] * n + [False] * (3 - n), "n_right": n, "mean_generated": 5.0, "seconds": 0.0}

    monkeypatch.setattr(ca, "answer_accuracy", fake)
    sel = _selected()
    obj = ca.AccuracyObjective(str(_problems(tmp_path)), n_problems=3, kv_budget=192, max_tokens=50, top_k=2)
    out, rec = ca.choose_signal_by_accuracy(None, sel, obj, tmp_path)
    # 192 cells run the 256 cell (nearest on a log scale); its choice, the 2 best there, and StreamingLLM
    assert rec["cell"] == 256 and asked == [("epikv_mix", 0.75), ("keydiff", 0.5), ("streaming", 0.5)]
    assert rec["chosen"]["policy"] == want and rec["changed_choice"] is (want != "epikv_mix")
    new = {e["kv_budget"]: e for e in out["by_budget"]}
    assert new[256]["policy"] == want and new[256]["chosen_by"] == "accuracy"
    assert new[256]["objective"] == next(c for c in sel["candidates"] if c["policy"] == want)["per_budget"]["256"][
        "objective"]
    assert [new[b] for b in (128, 512)] == [sel["by_budget"][0], sel["by_budget"][2]]  # the other cells stay
    assert out["chosen"] == sel["chosen"] and rec["delta_nll_choice"]["policy"] == "epikv_mix"


def test_step_4s_streaming_answers_are_reused_only_at_the_same_recent_share(monkeypatch, tmp_path):
    asked = []

    def fake(model, problems, policy, budget, max_tokens, n_threads=None):
        asked.append(policy.name)
        return {"correct": [False], "n_right": 0, "mean_generated": 5.0, "seconds": 0.0}

    monkeypatch.setattr(ca, "answer_accuracy", fake)
    obj = ca.AccuracyObjective(str(_problems(tmp_path)), n_problems=1, kv_budget=100, top_k=1)
    ref = {"correct": [True], "n_right": 1, "mean_generated": 5.0, "seconds": 0.0}
    _, rec = ca.choose_signal_by_accuracy(None, _selected(), obj, tmp_path, streaming={**ref, "recent_fraction": 0.5})
    assert rec["cell"] == 128 and asked == ["keydiff"] and rec["chosen"]["policy"] == "streaming"
    asked.clear()
    ca.choose_signal_by_accuracy(None, _selected(), obj, tmp_path, streaming={**ref, "recent_fraction": 0.75})
    assert asked == ["keydiff", "streaming"]


def test_calibrate_from_a_finished_calibration_end_to_end(model_path, tmp_path):
    """A --quick ΔNLL calibration with signals, then --from it into another folder: steps 4 and 3b recorded,
    the query statistics still found, the file read back; bad input one line, exit 2, nothing written."""
    src = tmp_path / "a" / "cal.json"
    src.parent.mkdir()
    r = subprocess.run(CLI + ["calibrate", "--model", str(model_path), "--traces", str(TRACES), "--quick",
                              "--threads", "2", "--out", str(src)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    f, out = _problems(tmp_path), tmp_path / "b" / "acc.json"
    out.parent.mkdir()
    common = ["calibrate", "--model", str(model_path), "--objective", "accuracy", "--problems", str(f),
              "--accuracy-problems", "2", "--accuracy-max-tokens", "16", "--accuracy-budget", "64",
              "--accuracy-top-k", "1", "--threads", "2"]
    r = subprocess.run(CLI + common + ["--from", str(src), "--out", str(out)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    before, doc = json.loads(src.read_text()), json.loads(out.read_text())
    assert doc["objective"] == "accuracy" and doc["reused_from"].endswith("cal.json")
    assert doc["grid_results"] == before["grid_results"] and doc["anatomy"] == before["anatomy"]  # not rerun
    rec = doc["accuracy_signals"]
    assert rec["cell"] == 64 and rec["problem_ids"] == ["q1", "q2"]
    for c in rec["candidates"] + doc["accuracy"]["candidates"]:
        assert len(c["correct"]) == 2 and c["n_right"] == sum(c["correct"])
    best = max(rec["candidates"], key=lambda c: (c["n_right"], c["policy"] == "streaming",
                                                 (c["policy"], c["options"]) == (rec["delta_nll_choice"]["policy"],
                                                                                 rec["delta_nll_choice"]["options"])))
    assert doc["selected"]["by_budget"][0]["policy"] == rec["chosen"]["policy"] == best["policy"]
    from epikv_local.api.calibration import load_file

    cal = load_file(out)
    assert cal.selected_for(64)["policy"] == best["policy"]
    assert before["query_stats"]  # SmolLM2 has RoPE: TriAttention's statistics were collected
    # the statistics stay where they were, named relative to the new file
    assert Path(cal.query_stats).resolve() == (src.parent / before["query_stats"]).resolve()
    assert Path(cal.query_stats).is_file()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**before, "model_sha256": "0" * 64}))
    bad_out = tmp_path / "never.json"
    for args, needle in ((["--from", str(src)], None),
                         (["--from", str(tmp_path / "none.json")], "no such file"),
                         (["--from", str(tmp_path)], "not a file"),
                         (["--from", str(f)], "is malformed"),
                         (["--from", str(out)], "chosen on answers already"),
                         (["--from", str(src), "--fast"], "--fast: not with --from"),
                         (["--from", str(other)], "another model file")):
        cmd = CLI + (common if needle else ["calibrate", "--model", str(model_path)]) + args + ["--out", str(bad_out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (args, r.stderr)
        assert (needle or "only with --objective accuracy") in lines[0], (args, r.stderr)
    assert not bad_out.exists()


def test_a_calibration_that_cannot_be_re_ranked_is_refused_before_any_answer(tmp_path):
    from epikv_local.eval.calibrate import _check_reusable

    obj = ca.AccuracyObjective(str(_problems(tmp_path)), kv_budget=192)
    good = {"n_layer": 24, "grid_results": [_row(3, 9, 0.1)], "baseline": _row(5, 10, 0.2), "selected": _selected()}
    _check_reusable(good, tmp_path / "c.json", obj)
    _check_reusable({**good, "selected": None}, tmp_path / "c.json", obj)  # no step 3: step 4 only
    sel = _selected()
    for doc, needle in (
            ({**good, "grid_results": []}, "no step-2 grid results"),
            ({**good, "grid_results": {"a": 1}}, "no step-2 grid results"),
            ({**good, "grid_results": [{"layer_a": "3"}]}, "a step-2 setting"),
            ({**good, "grid_results": [_row(3, 23, 0.1)]}, r"outside 0\.\.22"),
            ({**good, "grid_results": [_row(3, 3, 0.1)]}, "distinct"),
            ({**good, "grid_results": [_row(3, 9, 0.1, w=0)]}, "a step-2 setting"),
            ({**good, "baseline": _row(5, 10, 0.2, rf=1.5)}, "recent"),
            ({**good, "objective": "accuracy"}, "chosen on answers already"),
            ({**good, "selected": {**sel, "by_budget": []}}, "no per-budget choices"),
            ({**good, "selected": {**sel, "by_budget": [{**sel["by_budget"][0], "kv_budget": 0}]}}, "kv_budget > 0"),
            ({**good, "selected": {**sel, "candidates": sel["candidates"][1:]}}, "no StreamingLLM candidate"),
            ({**good, "selected": {**sel, "candidates": [{**sel["candidates"][0], "policy": "nonesuch"}]}},
             "malformed"),
            ({**good, "selected": {**sel, "candidates": [{**sel["candidates"][1], "options": {"evil": 1}}]}},
             "has no setting 'evil'"),
            ({**good, "selected": {**sel, "candidates": [{**sel["candidates"][1], "options": ["window"]}]}},
             "options not an object"),
            ({**good, "selected": {**sel, "candidates": [{**sel["candidates"][2], "options": {"layers": 5}}]}},
             "malformed"),
            ({**good, "selected": {**sel, "candidates": [{**sel["candidates"][1], "policy": "triattention",
                                                          "options": {"query_stats": "gone.npz"}}]}}, "not found"),
            ({**good, "selected": {**sel, "candidates": [{**sel["candidates"][0], "per_budget": {}}]}}, "malformed"),
            ({**good, "selected": [1, 2]}, "no per-budget choices")):
        with pytest.raises(DataError, match=needle):
            _check_reusable(doc, tmp_path / "c.json", obj)
