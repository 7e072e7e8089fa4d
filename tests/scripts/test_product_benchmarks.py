"""The product benchmark scripts run end to end in a small mode and write their JSON (the committed results
come from the full-size commands in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(script: str, *args, timeout=600) -> dict:
    out = Path(args[args.index("--out") + 1])
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def trace_data(tmp_path) -> Path:
    """A data folder whose r1_traces_dev.jsonl is one synthetic trace of arithmetic steps."""
    data = tmp_path / "data"
    data.mkdir()
    trace = " ".join(f"Step {i}: we add {i} and {i + 1} to get {2 * i + 1}." for i in range(200))
    (data / "r1_traces_dev.jsonl").write_text(json.dumps({"trace": trace}) + "\n")
    return data


def test_multiturn(tmp_path):
    d = run("bench_multiturn.py", "--rounds", "1", "--turn1-tokens", "60", "--kv-budget", "96", "--out",
            tmp_path / "m.json")
    r = d["rounds"][0]
    assert r["reuse"]["decoded"] < r["fresh"]["decoded"] == r["turn2_prompt_tokens"]


def test_quant_kv(tmp_path):
    d = run("bench_quant_kv.py", "--n-traces", "1", "--max-tokens", "200", "--budgets", "96", "--policies",
            "streaming", "--generated", "1024", "--memory-budget", "128", "--threads", "2", "--out", tmp_path / "q.json")
    kinds = {(s["type"], s["cache"]) for s in d["summary"]}
    assert {("q8_0", "full"), ("q4_0", "budget 96"), ("f16", "budget 96")} <= kinds
    mem = {(m["cache"], m["type"]): m["kv_mib_llama_cpp"] for m in d["memory"]}
    assert mem[("budget 128", "q4_0")] < mem[("budget 128", "f16")] < mem[("full cache", "f16")]


def test_evict_scaling(tmp_path):
    d = run("bench_evict_scaling.py", "--budgets", "256,512", "--tokens", "40", "--threads", "2", "--out",
            tmp_path / "e.json")
    assert len(d["rows"]) == 4 and all(r["rounds"] > 0 and r["max_live"] <= r["budget"] for r in d["rows"])


def test_soak_passes_and_fails(tmp_path):
    d = run("soak.py", "--tokens", "400", "--warmup", "100", "--every", "100", "--kv-budget", "64", "--out",
            tmp_path / "s.json")
    assert d["passed"] and d["max_live_cells"] <= 64 and len(d["samples"]) >= 4
    # a growth limit below zero cannot be met: the script says FAIL and exits 1 (the check can fail)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--tokens", "300", "--warmup", "100",
                        "--every", "100", "--kv-budget", "64", "--max-growth", "-0.5"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 1 and "FAIL" in r.stdout


@pytest.mark.parametrize("script", ["bench_busy.py", "bench_multiturn.py", "bench_quant_kv.py",
                                    "bench_evict_scaling.py", "soak.py", "bench_server.py"])
def test_help(script):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0 and "usage:" in r.stdout


def test_accuracy_bench_runs_resumes_and_merges(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"p{i}", "split": "dev", "question": f"What is {i} plus 3?", "answer": str(i + 3),
             "solution": ""} for i in range(2)]
    (data / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, out = tmp_path / "r.jsonl", tmp_path / "a.json"
    args = ("bench_accuracy.py", "--data", data, "--policies", "streaming", "--budgets", "160", "--max-tokens",
            "48", "--records", records, "--out", out)
    d = run(*args)
    assert set(d["settings"]) == {"full/protected", "streaming@160/protected"}
    lines = records.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 4 and all(r["max_live_cells"] <= 160 for r in recs if r["budget"] == 160)
    assert all(r["n_evicted"] == 0 for r in recs if r["budget"] is None)
    s = d["settings"]["streaming@160/protected"]
    assert s["n"] == 2 and s["vs_full"]["n"] == 2 and 0 <= s["accuracy"] <= 1
    run(*args)  # resumed: every pair is done, nothing is added
    assert len(records.read_text().splitlines()) == 4
    inside = REPO / "results" / f"_test_records_{os.getpid()}.jsonl"  # a records path relative to the checkout
    try:
        inside.write_text(records.read_text())
        d = run("bench_accuracy.py", "--merge", "--records", inside.relative_to(REPO), "--out", out)
        assert d["records"] == str(inside.relative_to(REPO))
    finally:
        inside.unlink(missing_ok=True)


def test_accuracy_bench_runs_a_calibrations_policies(tmp_path):
    """--calibration FILE adds epikv_calibrated (the file's layers, window and recent share) and calibrated (its
    step-3 choice for the budget); each record names the calibration and what ran; a resumed run with another
    calibration is refused in one line."""
    cal = next((REPO / "epikv_local" / "calibrations").glob("*.json"))  # the default model's, with step 3
    doc = json.loads(cal.read_text())
    data = _tiny_gsm8k(tmp_path)
    records, out = tmp_path / "r.jsonl", tmp_path / "a.json"
    d = run("bench_accuracy.py", "--data", data, "--policies", "streaming", "--budgets", "512", "--limit", "1",
            "--max-tokens", "24", "--no-full", "--calibration", cal, "--records", records, "--out", out)
    assert set(d["settings"]) == {"streaming@512/protected", "epikv_calibrated@512/protected",
                                  "calibrated@512/protected"}
    recs = {r["setting"]: r for r in map(json.loads, records.read_text().splitlines())}
    ran = recs["epikv_calibrated@512/protected"]["ran"]
    chosen = doc["chosen"]
    assert ran["kv_policy"] == "epikv" and ran["recent_fraction"] == chosen["recent_fraction"]
    assert ran["kv_policy_settings"] == {"layers": [chosen["layer_a"]] + ([chosen["layer_b"]] if chosen["layer_b"]
                                                                          is not None else []),
                                         "window": chosen["window"]}
    at512 = next(e for e in doc["selected"]["by_budget"] if e["kv_budget"] == 512)
    sel = recs["calibrated@512/protected"]
    assert sel["calibration"] == cal.name and sel["ran"]["kv_policy"] == at512["policy"]
    assert sel["ran"]["kv_policy_settings"] == at512["options"]  # the statistics' file by name, not a local path
    assert "calibration" not in recs["streaming@512/protected"]
    other = tmp_path / "other.json"
    other.write_text(cal.read_text().replace(at512["options"]["query_stats"], str(cal.with_suffix(".qstats.npz"))))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_accuracy.py"), "--data", str(data),
                        "--policies", "streaming", "--budgets", "512", "--limit", "1", "--max-tokens", "24",
                        "--no-full", "--calibration", str(other), "--records", str(records)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "calibration" in r.stderr, r.stderr
    # the recall benchmark takes the same runs: at 96 cells step 3's nearest choice is the one for 128
    trace = " ".join(f"Step {i}: we add {i} and {i + 1} to get {2 * i + 1}." for i in range(200))
    (data / "r1_traces_dev.jsonl").write_text(json.dumps({"trace": trace}) + "\n")
    d = run("bench_recall.py", "--data", data, "--task", "passkey", "--context", "300", "--budgets", "96",
            "--policies", "streaming", "--depths", "0.5", "--seeds", "1", "--calibration", cal,
            "--records", tmp_path / "p.jsonl", "--out", tmp_path / "p.json")
    assert set(d["settings"]) == {"full", "streaming@96", "epikv_calibrated@96", "calibrated@96"}
    recs = {r["setting"]: r for r in map(json.loads, (tmp_path / "p.jsonl").read_text().splitlines())}
    at128 = next(e for e in doc["selected"]["by_budget"] if e["kv_budget"] == 128)
    assert recs["calibrated@96"]["ran"]["kv_policy"] == at128["policy"]
    assert recs["epikv_calibrated@96"]["ran"]["kv_policy_settings"]["window"] == chosen["window"]
    assert recs["epikv_calibrated@96"]["n_evicted"] > 0


def test_accuracy_bench_runs_only_the_calibration_runs_asked_for(tmp_path):
    """--calibration-runs calibrated runs step 3's choice without epikv_calibrated, beside the records of another
    calibration's epikv_calibrated runs (a setting's outcomes still come from one calibration; the merge names
    each setting's calibration); a run it cannot give, no run named, or the option without --calibration, is one
    line, exit 2."""
    cal = next((REPO / "epikv_local" / "calibrations").glob("*.json"))  # the default model's, with step 3
    data = _tiny_gsm8k(tmp_path)
    records, out = tmp_path / "r.jsonl", tmp_path / "a.json"
    from epikv_local.api.models import default_model_path

    records.write_text(json.dumps({"model": default_model_path().name, "task": "gsm8k", "split": "dev",
                                   "max_tokens": 24, "setting": "epikv_calibrated@512/protected",
                                   "policy": "epikv_calibrated", "budget": 512, "prompt": "protected", "id": "x",
                                   "correct": False, "empty": False, "looping": False, "n_generated": 3,
                                   "n_evicted": 0, "finish_reason": "stop", "calibration": "older.json"}) + "\n")
    base = ["--data", data, "--policies", "streaming", "--budgets", "512", "--limit", "1", "--max-tokens", "24",
            "--no-full", "--calibration", cal, "--records", records]
    d = run("bench_accuracy.py", *base, "--calibration-runs", "calibrated,calibrated", "--out", out)  # one run
    assert set(d["settings"]) == {"streaming@512/protected", "epikv_calibrated@512/protected",
                                  "calibrated@512/protected"}
    assert d["settings"]["calibrated@512/protected"]["calibration"] == cal.name
    assert d["settings"]["epikv_calibrated@512/protected"]["calibration"] == "older.json"
    assert "calibration" not in d["settings"]["streaming@512/protected"]
    ran = [json.loads(x)["setting"] for x in records.read_text().splitlines()]
    assert ran.count("epikv_calibrated@512/protected") == 1  # the older calibration's record only
    assert ran.count("calibrated@512/protected") == 1  # a repeated name runs once
    for extra, word in ((["--calibration-runs", "epikv_calibrated"], "older.json"),  # that setting is another's
                        (["--calibration-runs", "calibratd"], "calibratd"),
                        (["--calibration-runs", ","], "at least one")):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_accuracy.py"), *map(str, base), *extra],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and word in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_accuracy.py"), "--data", str(data),
                        "--calibration-runs", "calibrated", "--records", str(tmp_path / "n.jsonl")],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--calibration" in r.stderr, r.stderr
    assert not (tmp_path / "n.jsonl").exists()


def test_accuracy_merge_chooses_three_budgets_on_dev_records(tmp_path):
    """On dev records, --merge picks the ascending budget triple whose StreamingLLM losses (share of the full
    cache's right answers lost) lie nearest 75 % / 50 % / 25 %; on test records it chooses nothing."""
    base = {"model": "m.gguf", "task": "gsm8k", "max_tokens": 48, "empty": False, "looping": False,
            "n_generated": 10, "n_evicted": 0, "finish_reason": "stop", "prompt": "counted"}
    # right answers among p0..p9 (each setting gets its first n right); the full cache gets p0..p7, so
    # StreamingLLM loses 8/8, 7/8, 6/8, 4/8, 2/8, 2/8, 1/8, 0/8 at 60 ... 400 cells
    right_of = {None: 8, 60: 0, 80: 1, 100: 2, 150: 4, 200: 6, 250: 6, 300: 7, 400: 8}

    def rows(split):
        for budget, n_right in right_of.items():
            name = "full/counted" if budget is None else f"streaming@{budget}/counted"
            for i in range(10):
                yield {**base, "split": split, "setting": name, "policy": "none" if budget is None else "streaming",
                       "budget": budget, "id": f"p{i}", "correct": i < n_right}

    for split, chosen in (("dev", [100, 150, 200]), ("test", None)):  # (100, 150, 250) ties: the first
        records, out = tmp_path / f"{split}.jsonl", tmp_path / f"{split}.json"
        # problems p10..p19 ran only with the full cache (all right) and at 150 cells (all wrong): a budget run on
        # more problems does not move the choice, made on the problems every budget answered
        extra = [{**base, "split": split, "setting": name, "policy": policy, "budget": budget, "id": f"p{i}",
                  "correct": budget is None} for i in range(10, 20)
                 for name, policy, budget in (("full/counted", "none", None), ("streaming@150/counted", "streaming", 150))]
        records.write_text("".join(json.dumps(r) + "\n" for r in [*rows(split), *extra]))
        d = run("bench_accuracy.py", "--merge", "--records", records, "--out", out)
        if chosen is None:
            assert "budget_choice" not in d
            continue
        c = d["budget_choice"]["counted"]
        assert c["chosen"] == chosen
        assert c["loss_share"] == {"60": 1.0, "80": 7 / 8, "100": 0.75, "150": 0.5, "200": 0.25, "250": 0.25,
                                   "300": 1 / 8, "400": 0.0}
    records.write_text("".join(json.dumps(r) + "\n" for r in rows("dev") if r["budget"] in (None, 100, 150)))  # two budgets
    d = run("bench_accuracy.py", "--merge", "--records", records, "--out", out)
    assert d["budget_choice"]["counted"]["chosen"] == [] and "3 are needed" in d["budget_choice"]["counted"]["why"]


def write_outcomes(path: Path, right_of: dict, n: int) -> None:
    """Test-split GSM8K records: for each (policy, budget) of ``right_of`` (budget None: the full cache), problems
    p0..p{n-1} with the first ``right_of[...]`` of them right."""
    base = {"model": "m.gguf", "task": "gsm8k", "split": "test", "max_tokens": 48, "empty": False,
            "looping": False, "n_generated": 10, "n_evicted": 0, "finish_reason": "stop", "prompt": "counted"}
    path.write_text("".join(
        json.dumps({**base, "setting": "full/counted" if budget is None else f"{policy}@{budget}/counted",
                    "policy": policy, "budget": budget, "id": f"p{i}", "correct": i < right}) + "\n"
        for (policy, budget), right in right_of.items() for i in range(n)))


def test_accuracy_merge_reports_the_share_of_streamings_loss_recovered(tmp_path):
    """--merge gives each policy setting issue 21's goal figure: the share of StreamingLLM's loss (same budget and
    prompt mode) it wins back, its CI, and whether the goal is met (half, with the paired CI above zero)."""
    records, out = tmp_path / "r.jsonl", tmp_path / "r.json"
    write_outcomes(records, {("full", None): 40, ("streaming", 192): 10, ("epikv", 192): 25, ("said", 192): 12}, 60)
    s = run("bench_accuracy.py", "--merge", "--records", records, "--out", out)["settings"]
    assert s["epikv@192/counted"]["recovered"]["share"] == pytest.approx(0.5)
    assert s["epikv@192/counted"]["recovered"]["goal_met"] is True
    assert s["said@192/counted"]["recovered"]["share"] == pytest.approx(2 / 30)
    assert s["said@192/counted"]["recovered"]["goal_met"] is False
    assert s["streaming@192/counted"]["recovered"] is None and s["full/counted"]["recovered"] is None


def test_accuracy_merge_compares_the_default_with_each_policy_at_its_budget(tmp_path):
    """--merge also pairs the default policy (or --against's) with every other setting at the same budget and
    prompt mode: the difference is the default's accuracy minus the other's, on the problems both answered."""
    records, out = tmp_path / "r.jsonl", tmp_path / "r.json"
    write_outcomes(records, {("full", None): 40, ("streaming", 192): 10, ("said_words_deep", 192): 30,
                             ("lagkv", 192): 20, ("lagkv", 160): 5, ("streaming", 160): 6}, 60)
    r = run("bench_accuracy.py", "--merge", "--records", records, "--out", out)
    s = r["settings"]
    assert r["against"] == "said_words_deep"
    assert s["lagkv@192/counted"]["vs_against"]["difference"] == pytest.approx(10 / 60)
    assert s["lagkv@192/counted"]["vs_against"]["n"] == 60
    assert s["streaming@192/counted"]["vs_against"]["difference"] == pytest.approx(20 / 60)
    assert s["said_words_deep@192/counted"]["vs_against"] is None  # not with itself
    assert s["lagkv@160/counted"]["vs_against"] is None  # the default did not run at 160
    assert s["full/counted"]["vs_against"] is None
    s = run("bench_accuracy.py", "--merge", "--records", records, "--out", out, "--against", "lagkv")["settings"]
    assert s["streaming@160/counted"]["vs_against"]["difference"] == pytest.approx(-1 / 60)
    assert s["lagkv@192/counted"]["vs_against"] is None
    before = out.read_bytes()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_accuracy.py"), "--merge", "--records",
                        str(records), "--out", str(out), "--against", "lagvk"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)  # a misspelt policy: one line, not a summary that compares nothing
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "lagvk" in r.stderr, r.stderr
    assert out.read_bytes() == before


def test_accuracy_merge_writes_strict_json_when_streaming_loses_nothing(tmp_path):
    """Nothing to recover (StreamingLLM as right as the full cache): the figure is undefined and the result file
    says null, not NaN, which strict JSON readers refuse."""
    records, out = tmp_path / "r.jsonl", tmp_path / "r.json"
    write_outcomes(records, {("full", None): 5, ("streaming", 384): 5, ("epikv", 384): 5}, 10)
    run("bench_accuracy.py", "--merge", "--records", records, "--out", out)
    text = out.read_text()
    assert "NaN" not in text
    r = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert r["settings"]["epikv@384/counted"]["recovered"] == {"n": 10, "share": None, "ci95": [None, None],
                                                               "goal_met": False}


def test_recall_bench_passkey_and_multiturn(tmp_path):
    data = trace_data(tmp_path)
    d = run("bench_recall.py", "--data", data, "--task", "passkey", "--context", "300", "--budgets", "96",
            "--policies", "streaming", "--depths", "0.5", "--seeds", "1", "--records", tmp_path / "p.jsonl",
            "--out", tmp_path / "p.json")
    s = d["settings"]["streaming@96"]
    assert s["n"] == 1 and s["mean_evicted"] > 0 and set(s["by_depth"]) == {"0.50"} and "vs_full" in s
    assert d["settings"]["full"]["mean_evicted"] == 0
    d = run("bench_recall.py", "--data", data, "--task", "multiturn", "--filler-tokens", "8", "--budgets", "160",
            "--policies", "streaming", "--seeds", "1", "--records", tmp_path / "m.jsonl", "--out", tmp_path / "m.json")
    assert set(d["settings"]) == {"full", "streaming@160"}



class _Chat:
    """A stand-in for ``Llama`` in bench_recall's conversation: bytes as tokens, each reply "ok", every call's
    messages kept."""

    def __init__(self):
        self.calls = []

    def tokenize(self, text: bytes, add_bos: bool = False) -> list[int]:
        return list(text)

    def detokenize(self, tokens: list[int]) -> bytes:
        return bytes(tokens)

    def create_chat_completion(self, messages, **kw):
        self.calls.append([dict(m) for m in messages])
        return {"choices": [{"message": {"content": "ok"}}]}


def _recall_chats(tmp_path, option: str, k: int):
    """bench_recall's multi-turn conversation of case 0 run on :class:`_Chat` without and with ``option k``: the
    last call's messages of each, and the trace file's bytes."""
    spec = importlib.util.spec_from_file_location("_bench_recall", REPO / "scripts" / "bench_recall.py")
    br = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(br)
    data = trace_data(tmp_path)
    case = br.multiturn_cases(br.parser().parse_args(["--records", "x", "--seeds", "1"]))[0]
    out = []
    for n in (0, k):
        chat = _Chat()
        br.run_multiturn(chat, case, br.parser().parse_args(["--records", "x", "--task", "multiturn", "--data",
                                                             str(data), option, str(n)]))
        out.append(chat.calls[-1])
    return out[0], out[1], (data / "r1_traces_dev.jsonl").read_bytes()


def test_recall_multiturn_pastes_the_notes_into_the_first_prompt_only(tmp_path):
    """--notes-tokens K: the first user message carries K tokens of the dev traces after its greeting, the
    later turns are unchanged; without it the first message is the greeting alone."""
    plain, noted, trace = _recall_chats(tmp_path, "--notes-tokens", 40)
    assert plain[0]["content"] == "Hi! I will tell you a few things about me; remember them."
    head, notes = noted[0]["content"].split(":\n\n", 1)
    assert head.startswith(plain[0]["content"]) and len(notes.encode()) == 40 and notes.encode() in trace
    assert noted[1:] == plain[1:] and len(plain) == 15  # 8 user turns between 7 answers, the question last


def test_recall_multiturn_pastes_notes_into_the_long_answer_turns(tmp_path):
    """--paste-tokens K: each of the turns 5-7 (the requests for long answers) carries K tokens of the dev
    traces before its request; the first prompt and the fact turns are unchanged."""
    plain, pasted, trace = _recall_chats(tmp_path, "--paste-tokens", 30)
    users = [i for i, m in enumerate(plain) if m["role"] == "user"]
    assert len(users) == 8
    for n, i in enumerate(users):
        if n in (4, 5, 6):  # turns 5-7
            head, rest = pasted[i]["content"].split(":\n\n", 1)
            notes, request = rest.rsplit("\n\n", 1)
            assert head == "Here are more of my notes" and request == plain[i]["content"]
            assert len(notes.encode()) == 30 and notes.encode() in trace
        else:
            assert pasted[i] == plain[i]


@pytest.mark.parametrize("option", ["--notes-tokens", "--paste-tokens"])
def test_recall_multiturn_notes_are_their_own_configuration(tmp_path, option):
    """Records of one count of notes never mix with another's; a negative count, or the option with the passkey
    task, or more than the dev traces hold, is one error line, exit 2, and writes no records."""
    data = trace_data(tmp_path)
    records = tmp_path / "m.jsonl"
    d = run("bench_recall.py", "--data", data, "--task", "multiturn", option, "40", "--filler-tokens", "8",
            "--budgets", "160", "--policies", "streaming", "--seeds", "1", "--records", records,
            "--out", tmp_path / "m.json")
    assert set(d["settings"]) == {"full", "streaming@160"} and d["settings"]["streaming@160"]["mean_evicted"] > 0
    key = option[2:].replace("-", "_")
    assert {json.loads(x)[key] for x in records.read_text().splitlines()} == {40}
    for task, n, why, rec in (("multiturn", "0", "another configuration", records),
                              ("multiturn", "-1", option, records),
                              ("passkey", "8", option, tmp_path / "p.jsonl"),
                              ("multiturn", "999999", f"fewer than {option}", tmp_path / "q.jsonl")):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_recall.py"), "--data", str(data), "--task",
                            task, "--filler-tokens", "8", "--budgets", "160", "--policies", "streaming",
                            "--seeds", "1", "--records", str(rec), option, n], capture_output=True, text=True,
                           cwd=REPO, timeout=300)
        errors = [x for x in r.stderr.splitlines() if not x.startswith("[")]  # "[hh:mm:ss] ..." is progress
        assert r.returncode == 2 and len(errors) == 1 and why in errors[0], r.stderr
    assert not (tmp_path / "p.jsonl").exists() and not (tmp_path / "q.jsonl").exists()


def test_passkey_ranks_finds_every_digit_of_each_code(tmp_path):
    """scripts/passkey_ranks.py on the default model: each case's code is found as its digit tokens after the
    fact sentence (not the instruction's "secret"), and every digit gets a percentile in both span settings."""
    data = trace_data(tmp_path)
    d = run("passkey_ranks.py", "--data", data, "--context", "200", "--seeds", "1", "--out", tmp_path / "r.json")
    assert [c["depth"] for c in d["cases"]] == [0.1, 0.3, 0.5, 0.7, 0.9]
    for c in d["cases"]:
        assert 0 < c["code_start"] < c["n_prompt"]
        for span in ("span0", "span2"):
            pct = c[span]["digit_percentiles"]
            assert pct and all(0.0 <= x <= 100.0 for x in pct)
            assert 0 <= c[span]["above_weakest_digit"] < c["n_prompt"]
        assert len(c["span0"]["digit_percentiles"]) == len(c["span2"]["digit_percentiles"])
    starts = [c["code_start"] for c in d["cases"]]
    assert starts == sorted(starts) and len(set(starts)) == 5  # deeper cases put the code later


def test_passkey_ranks_of_surprise_reports_the_digits_surprisal(tmp_path):
    """``--policy surprise``: each digit's surprisal (nats, the first token of a random code is never certain) and
    the rank of the policy's own scores; a policy it does not know is one error line, exit 2, no file."""
    data = trace_data(tmp_path)
    d = run("passkey_ranks.py", "--data", data, "--context", "200", "--seeds", "1", "--policy", "surprise",
            "--out", tmp_path / "r.json")
    assert d["policy"] == "surprise" and set(d["median_above_weakest_digit"]) == {"span0"}
    for c in d["cases"]:
        assert len(c["digit_surprisal"]) == len(c["span0"]["digit_percentiles"]) > 0
        assert all(x > 0 for x in c["digit_surprisal"]) and c["median_surprisal"] < max(c["digit_surprisal"])
        assert "span2" not in c
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "passkey_ranks.py"), "--data", data, "--policy", "h2o",
                          "--out", str(tmp_path / "bad.json")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--policy" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_recall_merge_reports_the_share_of_streamings_loss_recovered(tmp_path):
    right_of = {("full", None): 12, ("streaming", 256): 0, ("said", 256): 12, ("epikv", 256): 0}
    records, out = tmp_path / "m.jsonl", tmp_path / "m.json"
    records.write_text("".join(
        json.dumps({"task": "multiturn", "setting": policy if budget is None else f"{policy}@{budget}",
                    "policy": policy, "budget": budget, "id": f"c{i}", "correct": i < n, "n_evicted": 0}) + "\n"
        for (policy, budget), n in right_of.items() for i in range(12)))
    s = run("bench_recall.py", "--merge", "--records", records, "--out", out)["settings"]
    assert s["said@256"]["recovered"] == {"n": 12, "share": 1.0, "ci95": [1.0, 1.0], "goal_met": True}
    assert s["epikv@256"]["recovered"]["share"] == 0.0 and s["epikv@256"]["recovered"]["goal_met"] is False
    assert "recovered" not in s["streaming@256"] and "recovered" not in s["full"]


def test_accuracy_bench_names_a_recent_share_in_the_setting(tmp_path):
    """--recent-fraction runs each policy with that recent share, under a name of its own that never mixes with
    the default's records; its comparisons are against the default StreamingLLM at the same budget."""
    data = _tiny_gsm8k(tmp_path)
    records, out = tmp_path / "r.jsonl", tmp_path / "a.json"
    common = ("--data", data, "--budgets", "96", "--prompt", "counted", "--max-tokens", "48", "--records", records,
              "--out", out)
    run("bench_accuracy.py", "--policies", "streaming", *common)
    d = run("bench_accuracy.py", "--policies", "said_prompt", "--recent-fraction", "0.25", "--no-full", *common)
    s = d["settings"]
    assert set(s) == {"full/counted", "streaming@96/counted", "said_prompt@96~recent0.25/counted"}
    recs = [json.loads(x) for x in records.read_text().splitlines()]
    assert [r.get("recent_fraction") for r in recs if "~" in r["setting"]] == [0.25, 0.25]
    assert all("recent_fraction" not in r for r in recs if "~" not in r["setting"])
    assert s["said_prompt@96~recent0.25/counted"]["vs_streaming"]["n"] == 2
    for bad, why in ((["--recent-fraction", "1.0"], "--recent-fraction"),
                     (["--recent-fraction", "0.25", "--calibration", "auto"], "calibration")):
        fresh = tmp_path / "fresh.jsonl"
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_accuracy.py"), "--data", str(data),
                            "--policies", "streaming", *bad, "--records", str(fresh)], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and why in r.stderr, r.stderr
        assert not fresh.exists()


@pytest.mark.parametrize("script", ["bench_accuracy.py", "bench_recall.py"])
def test_accuracy_and_recall_bad_input_is_one_line(tmp_path, script):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    for args in (["--budgets", "1,a", "--records", tmp_path / "r.jsonl"], ["--records", "/proc/nope/r.jsonl"],
                 ["--merge", "--records", bad]):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / script), *map(str, args)], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("script", ["bench_accuracy.py", "bench_recall.py"])
def test_a_merge_of_no_records_is_one_line_and_writes_nothing(tmp_path, script):
    empty, torn, out = tmp_path / "empty.jsonl", tmp_path / "torn.jsonl", tmp_path / "out.json"
    empty.write_text("")
    torn.write_text('{"setting": "full", "id"')  # only a torn last line: what a run killed at once leaves
    for records, why in ((tmp_path / "missing.jsonl", "not found"), (empty, "no records"), (torn, "no records")):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--merge", "--records", str(records),
                            "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and why in r.stderr, r.stderr
        assert not out.exists()


def _tiny_gsm8k(tmp_path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"p{i}", "split": "dev", "question": f"What is {i} plus 3?", "answer": str(i + 3),
             "solution": ""} for i in range(2)]
    (data / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_accuracy_pages_replay_the_benchmark(tmp_path):
    """The page's three runs per problem give the answers bench_accuracy recorded for the same settings (the
    script says how many differ), and each run carries its verdict."""
    data, records = _tiny_gsm8k(tmp_path), tmp_path / "r.jsonl"
    common = ("--data", data, "--prompt", "counted", "--max-tokens", "48")
    run("bench_accuracy.py", *common, "--policies", "streaming,said_words", "--budgets", "80", "--records", records,
        "--out", tmp_path / "a.json")
    recs = [json.loads(x) for x in records.read_text().splitlines()]
    assert len(recs) == 6 and any(r["n_evicted"] for r in recs)
    page = tmp_path / "page.html"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "accuracy_pages.py"), *map(str, common),
                        "--policies", "streaming,said_words", "--budget", "80", "--ids", "p0,p1", "--records", str(records),
                        "--out", str(page)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 cases written" in r.stderr and "0 of 6 answers checked differ from the records" in r.stderr, r.stderr
    html = page.read_text(encoding="utf-8")
    assert html.count('<section class="case">') == 2 and html.count('<section class="run"') == 6
    assert html.count('class="runs n3"') == 2
    right, wrong = html.count('<span class="mark ok">right: '), html.count('<span class="mark bad">wrong: ')
    assert right + wrong == 6 and right == sum(x["correct"] for x in recs)
    assert "What is 1 plus 3?" in html and not list(tmp_path.glob(".*tmp*"))


def test_accuracy_pages_bad_input_is_one_line(tmp_path):
    data = _tiny_gsm8k(tmp_path)
    base = [sys.executable, str(REPO / "scripts" / "accuracy_pages.py"), "--data", str(data)]
    for args, needle in ((["--policies", "streaming", "--out", tmp_path / "x.html"], "two policies"),
                         (["--ids", "p9", "--out", tmp_path / "x.html"], "p9"),
                         (["--out", tmp_path / "missing" / "x.html"], "does not exist"),
                         (["--budget", "0", "--out", tmp_path / "x.html"], "--budget"),
                         (["--records", tmp_path / "none.jsonl", "--out", tmp_path / "x.html"], "not found")):
        r = subprocess.run(base + list(map(str, args)), capture_output=True, text=True, timeout=120, cwd=REPO)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, r.stderr)
    assert not (tmp_path / "x.html").exists()


def test_profile_server_summarizes_py_spy_stacks(tmp_path):
    """scripts/profile_server.py: py-spy attached to a real `serve --parallel 2` while two streams run; the
    summary names the decode thread and splits the samples; its parser on a hand-made raw profile."""
    d = run("profile_server.py", "--n", "2", "--tokens", "24", "--no-native", "--rate", "50", "--engine", "--out",
            tmp_path / "p.json", timeout=900)
    assert d["unprofiled"]["wall_s"] > 0 and d["unprofiled"]["cpu_s"]["other"] > 0
    assert d["engine"]["many"]["rounds"] > 0 and d["engine"]["one"]["ms_per_round"] > 0
    busy = d["profiled"]["thread_busy"]
    assert d["profiled"]["samples"] > 0 and all(0 <= v <= 1.01 for v in busy.values()), busy
    assert "epikv-decode" in busy and d["profiled"]["ticks"] > 0, busy
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import profile_server
    finally:
        sys.path.remove(str(REPO / "scripts"))
    raw = ("thread (1): epikv-decode;_loop (epikv_local/engine/pool.py:80);llama_decode (libllama.so) 6\n"
           "thread (1): epikv-decode;_run (epikv_local/engine/pool.py:381) 2\n"
           "thread (2): MainThread;EpollSelector.select (selectors.py:468) 2\n")
    s = profile_server.summarize(raw, top=5)
    assert s["samples"] == 10 and s["ticks"] == 8
    assert s["thread_busy"] == {"epikv-decode": 1.0, "MainThread": 0.0}  # select() is waiting, not busy
    assert s["decode_thread_in_llama_decode"] == 0.75
    assert s["top_python_frames"] == [{"frame": "epikv-decode: _run (epikv_local/engine/pool.py)", "share": 0.25}]


def test_profile_server_bad_input_is_one_line():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "profile_server.py"), "--n", "0"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--n" in r.stderr, r.stderr


def test_bench_fa_accumulator_refuses_a_library_without_the_experimental_patch():
    """The shipped library has one accumulator: both modes give the same logits, which the script says in one
    line (exit 2) instead of reporting a comparison of a kernel with itself. Bad counts are one line too."""
    script = str(REPO / "scripts" / "bench_fa_accumulator.py")
    r = subprocess.run([sys.executable, script, "--repeats", "1", "--ctx", "64", "--speed-tokens", "2", "--tokens",
                        "3"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "built without patches/experimental/0005" in r.stderr
    r = subprocess.run([sys.executable, script, "--repeats", "0"], capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--repeats" in r.stderr, r.stderr


def test_bench_prefill_rows_measures_the_three_ways_and_refuses_bad_counts(tmp_path):
    script = str(REPO / "scripts" / "bench_prefill_rows.py")
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, script, "--rows", "64", "--repeats", "1", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert min(run["one_seq_64_rows_per_s"], run["one_seq_256_rows_per_s"], run["four_seqs_64_rows_per_s"]) > 0
    assert 1 <= run["four_seqs_rounds"] <= 4 and run["four_seqs_shared_rounds"] <= run["four_seqs_rounds"]
    r = subprocess.run([sys.executable, script, "--rows", "0"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--rows" in r.stderr, r.stderr


def test_bench_parallel_passes_compares_pooled_with_one_at_a_time_and_refuses_bad_input(tmp_path):
    script = str(REPO / "scripts" / "bench_parallel_passes.py")
    out = tmp_path / "passes.json"
    r = subprocess.run([sys.executable, script, "--tokens", "96", "--budgets", "32,48", "--n-traces", "2",
                        "--parallel", "4", "--repeats", "1", "--threads", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["4"]["references_identical"] is True and run["4"]["same_evictions"] is True
    assert 0 <= run["4"]["max_abs_diff_delta_nll"] < 0.05 and run["4"]["unit_s"] > 0
    assert doc["summary"]["4"]["unit_speedup_median"] == run["4"]["unit_ratio"]
    for bad, needle in ((["--repeats", "0"], "--repeats"), (["--budgets", "x"], "comma-separated"),
                        (["--budgets", "900"], "budgets")):
        r = subprocess.run([sys.executable, script] + bad, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def test_accuracy_evidence_runs_its_parts_and_refuses_what_it_cannot_do(tmp_path, model_path):
    """scripts/accuracy_evidence.sh in small mode: the dev part runs both prompt modes (one full-cache run), cannot
    choose three budgets from two candidates (one line, exit 2, before any test problem is answered); with the
    budgets given, the GSM8K part answers both modes and the merge summarises every records file."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"p{i}", "split": split, "question": f"What is {i} plus 3?", "answer": str(i + 3),
             "solution": ""} for i, split in enumerate(["dev", "dev", "test"])]
    (data / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    env = {**os.environ, "MODEL": str(model_path), "DATA": str(data), "OUT": str(out), "TAG": "t",
           "EPIKV_VENV": str(Path(sys.executable).parent.parent), "MAX_TOKENS": "16", "POLICIES": "streaming",
           "DEV_PROBLEMS": "2", "CANDIDATES": "128,160", "TEST_PROBLEMS": "1"}

    def script(**extra):
        return subprocess.run(["bash", str(REPO / "scripts" / "accuracy_evidence.sh")], capture_output=True,
                              text=True, timeout=600, cwd=REPO, env={**env, **extra})

    r = script(PARTS="budgets gsm8k")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("accuracy_evidence: no budgets"), \
        r.stderr[-2000:]
    dev = [json.loads(x) for x in (out / "accuracy_gsm8k_dev_t.jsonl").read_text().splitlines()]
    assert sorted({r["setting"] for r in dev}) == ["full/counted", "streaming@128/counted", "streaming@128/protected",
                                                  "streaming@160/counted", "streaming@160/protected"]
    choice = json.loads((out / "accuracy_gsm8k_dev_t.json").read_text())["budget_choice"]
    assert choice["counted"]["chosen"] == [] and set(choice) == {"counted", "protected"}
    assert not (out / "accuracy_gsm8k_t.jsonl").exists()
    r = script(PARTS="gsm8k merge", BUDGETS_COUNTED="160", BUDGETS_PROTECTED="128")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((out / "accuracy_gsm8k_t.json").read_text())
    assert set(d["settings"]) == {"full/counted", "streaming@160/counted", "streaming@128/protected"}
    assert d["split"] == "test" and all(s["n"] == 1 for s in d["settings"].values())
    r = script(PARTS="nope")
    assert r.returncode == 2 and r.stderr.strip() == \
        "accuracy_evidence: unknown part 'nope' (budgets calibrate gsm8k math passkey multiturn merge)"
