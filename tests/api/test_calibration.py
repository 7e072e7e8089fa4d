"""Calibration: the --quick path writes a file that load_for_model reads and the CLI announces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epikv_local.api.calibration import CalibrationResult, load_file, resolve_policy
from epikv_local.policies import ModelShape

CLI = [sys.executable, "-m", "epikv_local.cli"]
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "r1_traces_dev.jsonl"


def test_result_configs():
    r = CalibrationResult(model_sha256="x", arch="llama", n_layer=30, layer_a=5, layer_b=17, window=64,
                          recent_fraction=0.25, delta_nll=0.1, baseline_delta_nll=0.2)
    assert r.policy_options() == {"layers": (5, 17), "window": 64}
    single = CalibrationResult(model_sha256="x", arch="llama", n_layer=30, layer_a=28, layer_b=None, window=128,
                               recent_fraction=0.5, delta_nll=0.1, baseline_delta_nll=0.2)
    assert single.policy_options()["layers"] == (28,)


def test_selected_for_follows_the_budget_on_a_log_scale(tmp_path):
    import pytest

    from epikv_local.errors import DataError

    a, b, c = ({"policy": p, "options": {}, "recent_fraction": rf} for p, rf in
               (("streaming", 0.5), ("keydiff", 0.75), ("epikv", 0.5)))
    r = CalibrationResult(model_sha256="x", arch="llama", n_layer=30, layer_a=5, layer_b=None, window=64,
                          recent_fraction=0.5, delta_nll=0.1, baseline_delta_nll=0.2, selected=c,
                          selected_by_budget=((128, a), (256, b), (1024, c)))
    assert r.selected_for(None) is c                   # budget unknown: the overall choice
    assert r.selected_for(16) is a and r.selected_for(181) is a  # below the range; sqrt(128 * 256) = 181.02
    assert r.selected_for(182) is b
    assert r.selected_for(512) is c                    # 512 is as far from 256 as from 1024: the larger
    assert r.selected_for(1 << 20) is c
    plain = CalibrationResult(model_sha256="x", arch="llama", n_layer=30, layer_a=5, layer_b=None, window=64,
                              recent_fraction=0.5, delta_nll=0.1, baseline_delta_nll=0.2, selected=c)
    assert plain.selected_for(128) is c                # a calibration without per-budget choices

    # the JSON round trip: per-budget entries as written by calibrate, query statistics made absolute
    doc = {"model_sha256": "x", "arch": "llama", "n_layer": 30, "chosen_delta_nll": 0.1, "baseline_delta_nll": 0.2,
           "chosen": {"layer_a": 5, "layer_b": None, "window": 64, "recent_fraction": 0.5},
           "selected": {"chosen": {"policy": "epikv", "options": {"layers": [5]}, "recent_fraction": 0.5},
                        "by_budget": [{"kv_budget": 512, "policy": "triattention", "recent_fraction": 0.75,
                                       "options": {"query_stats": "q.npz"}},
                                      {"kv_budget": 128, "policy": "streaming", "options": {},
                                       "recent_fraction": 0.5}]}}
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(doc))
    cal = load_file(f)
    assert [bb for bb, _ in cal.selected_by_budget] == [128, 512]
    assert cal.selected_for(1000)["options"]["query_stats"] == str(tmp_path / "q.npz")
    assert cal.selected_for(None)["options"]["layers"] == (5,)
    doc["selected"]["by_budget"][0]["kv_budget"] = 0
    f.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="malformed"):
        load_file(f)
    doc["selected"]["by_budget"][0].update(kv_budget=512, policy="no_such_policy")
    f.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="malformed"):
        load_file(f)


def test_guarded_choice_keeps_streaming_inside_the_noise():
    from epikv_local.eval.signals import guarded_choice

    s, a, b = {"policy": "streaming"}, {"policy": "a"}, {"policy": "b"}
    base = [1.0, 1.2, 0.8]
    # a: lowest mean, but its paired advantage (-0.12, +0.1, -0.06) is inside one standard error -> not a;
    # b: a steady advantage of 0.02 on every trace -> b
    a_t, b_t = [0.88, 1.3, 0.74], [0.98, 1.18, 0.78]
    ch, m = guarded_choice([(s, 1.0, base), (a, sum(a_t) / 3, a_t), (b, sum(b_t) / 3, b_t)])
    assert ch is b and m["fallback"] and m["mean"] < 0 and m["n_traces"] == 3
    assert m["mean"] + m["se"] < 0
    # nothing clears the guard -> streaming, said so
    ch, m = guarded_choice([(s, 1.0, base), (a, sum(a_t) / 3, a_t)])
    assert ch is s and m == {"mean": 0.0, "se": 0.0, "n_traces": 3, "fallback": True}
    # streaming is best -> streaming, no fallback; guard 0 -> the plain minimum
    ch, m = guarded_choice([(s, 0.5, base), (a, 1.0, a_t)])
    assert ch is s and not m["fallback"]
    assert guarded_choice([(s, 1.0, base), (a, sum(a_t) / 3, a_t)], guard_se=0.0)[0] is a


def test_load_for_model_without_calibration(tmp_path, monkeypatch):
    from epikv_local.api import calibration

    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    assert calibration.load_for_model(f) is None
    res = resolve_policy("epikv", f)
    assert res.calibration is None and res.recent_fraction == 0.5
    assert resolve_policy("said_facts", f).recent_fraction == 0.25  # the share it was designed with
    assert res.policy.bind(ModelShape(n_layer=30)).g_layers == (9, 20)  # the documented default
    # the content hash is cached and is the sha256 of the file
    import hashlib

    assert calibration.model_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert (tmp_path / "model_hashes.json").is_file()


def test_calibrated_policy_needs_a_calibration(tmp_path, monkeypatch):
    import pytest

    from epikv_local.errors import ConfigError
    from epikv_local.policies import make_policy

    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ConfigError, match="run `epikv-local calibrate"):
        resolve_policy("calibrated", f)
    with pytest.raises(ConfigError, match="chosen per model"):
        make_policy("calibrated")


def test_calibrate_quick_roundtrip(model_path, tmp_path):
    env = {**os.environ, "EPIKV_CACHE_DIR": str(tmp_path)}
    r = subprocess.run(CLI + ["calibrate", "--model", str(model_path), "--traces", str(TRACES), "--quick",
                              "--threads", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    files = list((tmp_path / "calibration").glob("*.json"))
    assert len(files) == 1 and str(files[0]) == out["path"]
    doc = json.loads(files[0].read_text())
    assert doc["n_layer"] == 30 and doc["arch"] == "llama"
    assert doc["grid_results"] and doc["baseline_delta_nll"] == doc["baseline"]["delta_nll"]
    assert doc["chosen_delta_nll"] <= doc["baseline_delta_nll"]  # the default is one of the grid points
    cal = load_file(files[0])
    assert 0 <= cal.layer_a <= 28 and (cal.layer_b is None or 0 <= cal.layer_b <= 28)

    # load_for_model finds it by content hash, in this cache directory
    code = ("import sys, json; from epikv_local.api.calibration import load_for_model; "
            "c = load_for_model(sys.argv[1]); print(json.dumps([c.path, c.layer_a, c.layer_b, c.window]))")
    r2 = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True, env=env,
                        timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout) == [str(files[0]), cal.layer_a, cal.layer_b, cal.window]

    # the CLI uses it for an epikv-family policy without --layers/--window, and says so on stderr
    gen = ["generate", "--model", str(model_path), "--prompt", "Count from one to ten:", "--max-tokens", "40",
           "--kv-budget", "48", "--ignore-eos", "--json", "--threads", "2"]
    r3 = subprocess.run(CLI + gen, capture_output=True, text=True, env=env, timeout=300)
    assert r3.returncode == 0, r3.stderr
    assert f"epikv-local: using calibration {files[0]}" in r3.stderr.splitlines()
    stats = json.loads(r3.stdout.strip().splitlines()[-1])
    want = [cal.layer_a] + ([] if cal.layer_b is None else [cal.layer_b])
    assert list(stats["layers"]) == want  # only the chosen layers are captured
    # explicit --layers: no calibration
    r4 = subprocess.run(CLI + gen + ["--layers", "9,20"], capture_output=True, text=True, env=env, timeout=300)
    assert r4.returncode == 0, r4.stderr
    assert "using calibration" not in r4.stderr
    # a non-EPIKV policy: no calibration
    r5 = subprocess.run(CLI + gen + ["--policy", "streaming"], capture_output=True, text=True, env=env, timeout=300)
    assert r5.returncode == 0, r5.stderr
    assert "using calibration" not in r5.stderr

    # step 3: query statistics beside the JSON, the choice among the signals (streaming is a candidate, so the
    # chosen objective is at most streaming's on the dev traces), and --policy calibrated runs the choice
    sel = doc["selected"]
    names = {c["policy"] for c in sel["candidates"]}
    assert {"streaming", "epikv", "keydiff", "triattention", "rkv_redundancy", "epikv_mix"} <= names
    stream = min(c["objective"] for c in sel["candidates"] if c["policy"] == "streaming")
    # one dev trace in the quick grid: no standard error, so the guard reduces to "beats streaming"
    assert sel["chosen"]["objective"] == min(c["objective"] for c in sel["candidates"]) <= stream
    # per budget (the quick grid has one, 64): the best candidate at that budget, and what `calibrated` runs there
    assert [e["kv_budget"] for e in sel["by_budget"]] == [64]
    best64 = min(c["per_budget"]["64"]["objective"] for c in sel["candidates"])
    assert sel["by_budget"][0]["objective"] == best64 and sel["by_budget"][0]["vs_streaming"]["n_traces"] == 1
    assert cal.selected_for(48)["policy"] == sel["by_budget"][0]["policy"]
    assert (files[0].parent / doc["query_stats"]).is_file()
    assert cal.selected["policy"] == sel["chosen"]["policy"] and cal.query_stats
    r6 = subprocess.run(CLI + gen + ["--policy", "calibrated"], capture_output=True, text=True, env=env, timeout=300)
    assert r6.returncode == 0, r6.stderr
    assert json.loads(r6.stdout.strip().splitlines()[-1])["policy"] == sel["by_budget"][0]["policy"]
    # triattention takes the model's offline query statistics (no query capture at run time)
    code = ("import sys; from epikv_local.api.calibration import resolve_policy; from epikv_local.policies import "
            "ModelShape; p = resolve_policy('triattention', sys.argv[1]).policy; print(p.query_stats); "
            "print(p.bind(ModelShape(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, rope_dims=64)).query_layers)")
    r7 = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True, env=env,
                        timeout=120)
    assert r7.returncode == 0, r7.stderr
    assert r7.stdout.splitlines() == [cal.query_stats, "()"]


def test_default_model_ships_its_calibration(model_path, tmp_path, monkeypatch):
    """The default model's measured calibration is packaged and found by content hash with an empty cache."""
    from epikv_local.api import calibration

    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    cal = calibration.load_for_model(model_path)
    assert cal is not None and Path(cal.path).parent == calibration.PACKAGED_DIR
    assert (cal.layer_a, cal.layer_b, cal.window, cal.recent_fraction) == (19, None, 256, 0.75)
    assert cal.policy_options() == {"layers": (19,), "window": 256}
    assert Path(cal.query_stats).parent == calibration.PACKAGED_DIR and Path(cal.query_stats).is_file()
    res = resolve_policy("epikv", model_path)
    assert res.calibration == cal and res.recent_fraction == 0.75
    assert res.policy.bind(ModelShape(n_layer=30)).g_layers == (19,)
    # --policy calibrated: the shipped selection
    sel = resolve_policy("calibrated", model_path)
    assert sel.calibration == cal and sel.policy.name == cal.selected["policy"]
    assert sel.recent_fraction == cal.selected["recent_fraction"]
    # explicit settings win over the calibration; a non-calibratable policy never takes one
    assert resolve_policy("epikv", model_path, {"window": 64}).calibration is None
    assert resolve_policy("streaming", model_path).calibration is None
    # a configuration designed with a recent share of its own keeps it over the calibration's (its EPIKV
    # layers and window still come from the calibration); the caller's share wins over both
    facts = resolve_policy("said_facts", model_path)
    assert facts.calibration == cal and facts.recent_fraction == 0.25
    assert facts.policy.bind(ModelShape(n_layer=30)).g_layers == (19,)
    assert resolve_policy("said_prompt", model_path).recent_fraction == 0.75
    from epikv_local.api.session_spec import resolve_session

    assert resolve_session(model_path, kv_policy="said_facts", kv_budget=192).budget.recent_window == 48
    assert resolve_session(model_path, kv_policy="said_facts", kv_budget=192,
                           recent_fraction=0.5).budget.recent_window == 96
    assert resolve_session(model_path, kv_policy="said_facts", kv_budget=192, n_recent=64).budget.recent_window == 64


def test_calibrate_from_an_installed_package_without_shared_data(model_path, tmp_path):
    """Run from another folder (the installed package, not this checkout): the packaged dev traces are used."""
    env = {**os.environ, "EPIKV_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)
    code = ("import epikv_local.eval.traces as t, sys; print(t.default_dev_traces());"
            "from epikv_local.cli import main; sys.exit(main(['calibrate', '--model', sys.argv[1], '--quick',"
            " '--threads', '2', '--out', sys.argv[2]]))")
    r = subprocess.run([sys.executable, "-c", code, str(model_path), str(tmp_path / "cal.json")], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    used = Path(r.stdout.splitlines()[0])
    assert used.name == "dev_traces.jsonl" and "site-packages" in str(used)
    # provenance only, spelled without this machine's paths: the installed package's folder is the root here
    assert json.loads((tmp_path / "cal.json").read_text())["traces"] == "epikv_local/eval/data/dev_traces.jsonl"


def test_installed_package_run_from_the_checkout_finds_the_checkout(tmp_path):
    """The README's ``.venv/bin/epikv-local`` runs the installed copy of the package: run from the repository's
    root, it names this checkout in results and reads the dev split beside it, as the source tree does (it read
    the packaged traces before)."""
    from epikv_local.eval import provenance

    checkout = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import epikv_local, epikv_local.eval.provenance as p, epikv_local.eval.traces as t;"
            "print(epikv_local.__file__); print(p.REPO); print(t.default_dev_traces())")

    def installed_from(cwd: Path) -> list[str]:
        """(package file, REPO, default dev traces) of the installed copy run from ``cwd``; ``-I`` keeps the
        working folder off sys.path, so the installed copy is imported, as by the console script."""
        r = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, env=env,
                           cwd=cwd)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    imported, repo, traces = installed_from(checkout)
    if Path(imported).resolve().parent == checkout / "epikv_local":
        pytest.skip("the package is installed in editable mode: the source tree itself is imported")
    assert Path(repo) == checkout == provenance.REPO
    split = checkout.parent / "shared" / "data" / "r1_traces_dev.jsonl"
    assert Path(traces) == (split if split.is_file() else Path(imported).parent / "eval" / "data" / "dev_traces.jsonl")
    _, repo, traces = installed_from(tmp_path)  # not a checkout: the installed package's own folder, packaged traces
    assert Path(repo) != checkout
    assert traces.endswith("dev_traces.jsonl") and "site-packages" in traces
