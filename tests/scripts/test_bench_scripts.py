"""Smoke tests of the benchmark scripts: they run end to end with tiny settings and write the documented fields.

Invariants only (budgets held, ratios finite and positive, files written); never a speed threshold.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_speed_smoke(model_path, dev_traces, tmp_path, capsys):
    out = tmp_path / "speed.json"
    rc = load_script("bench_speed").main(["--tokens", "32", "--rounds", "1", "--kv-budget", "96", "--batch", "16",
                                          "--policies", "epikv,streaming", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    for key in ("command", "git", "machine", "model", "kv_budget", "n_batch", "n_ctx", "prompt_tokens",
                "decoded_tokens", "rounds", "variants", "epikv_speed_vs_attention_policies"):
        assert key in data, key
    assert data["n_ctx_requested"] == 96 + 16 and data["n_ctx"] >= 96 + 16  # llama.cpp may pad n_ctx
    assert data["prompt_tokens"] == 96 - 16
    assert set(data["variants"]) == {"plain", "plain-noFA", "epikv", "streaming"}
    for name, v in data["variants"].items():
        assert finite_positive(v["median_tokens_per_s"]), name
        assert finite_positive(v["median_ratio_to_plain"]), name
        assert finite_positive(v["median_ratio_to_plain_noFA"]), name
        assert v["n_ctx"] == data["n_ctx"]
    assert data["variants"]["plain"]["median_ratio_to_plain"] == pytest.approx(1.0)
    assert data["variants"]["plain-noFA"]["flash_attn_requested"] is False
    for name in ("epikv", "streaming"):  # prompt 80 + 31 decoded > budget 96: they evicted, within budget
        v = data["variants"][name]
        assert v["evictions_per_run"] > 0 and v["max_live_cells"] <= 96
        assert finite_positive(v["mean_eviction_round_ms"])
        assert v["flash_attn_ran"] is True
    assert "epikv" in capsys.readouterr().out


def test_bench_speed_rejects_unfitting_tokens(model_path):
    with pytest.raises(SystemExit):
        load_script("bench_speed").main(["--tokens", "100", "--batch", "16", "--policies", "epikv"])


def test_bench_long_smoke(model_path, dev_traces, tmp_path):
    rc = load_script("bench_long").main(["--tokens", "150", "--kv-budget", "64", "--every", "40",
                                         "--out-dir", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "long_epikv.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [0, 40, 80, 120, 150]  # after prefill, every 40, final partial
    assert rows[-1]["final"] is True
    for r in rows:
        assert r["live_cells"] <= 64
        assert r["kv_bytes"] > 0 and r["rss_bytes"] > 0 and r["n_ctx"] >= 64 + 64
    for r in rows[1:]:
        assert finite_positive(r["interval_tokens_per_s"])
    assert rows[-1]["n_evicted"] > 0
    summary = json.loads((tmp_path / "long_epikv.summary.json").read_text())
    for key in ("command", "git", "machine", "generated_tokens", "stop_reason", "final_rss_bytes", "kv_bytes",
                "max_live_cells", "mean_eviction_round_ms", "eviction_rounds", "mean_decode_tokens_per_s"):
        assert key in summary, key
    assert summary["generated_tokens"] == 150 and summary["stop_reason"] == "max_tokens"
    assert summary["max_live_cells"] <= 64
    assert finite_positive(summary["mean_eviction_round_ms"])


def test_bench_long_full_cache_stops_at_max_seconds(model_path, dev_traces, tmp_path):
    rc = load_script("bench_long").main(["--full-cache", "--tokens", "4000", "--prompt-tokens", "16",
                                         "--every", "8", "--max-seconds", "0.5", "--out-dir", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "long_full_cache.summary.json").read_text())
    assert summary["policy"] == "none" and summary["stop_reason"] == "max_seconds"
    n = summary["generated_tokens"]
    assert 0 < n < 4000
    assert summary["kv_budget"] == 16 + 4000 and summary["n_evicted"] == 0
    rows = [json.loads(line) for line in (tmp_path / "long_full_cache.jsonl").read_text().splitlines()]
    assert rows[-1]["tokens"] == n
    assert rows[-1]["live_cells"] in (16 + n - 1, 16 + n)  # the last sampled token may not be decoded yet


def test_make_random_model_smoke(model_path, tmp_path):
    out = tmp_path / "tiny.gguf"
    rc = load_script("make_random_model").main(["--layers", "2", "--embd", "128", "--n-ff", "256", "--n-head", "4",
                                                "--n-head-kv", "2", "--out", str(out), "--no-check"])
    assert rc == 0 and out.is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".random-model-")]  # temp F16 removed
    from epikv_local.engine.handles import Model

    with Model(out) as m:
        info = m.info
        assert (info.arch, info.n_layer, info.n_embd, info.n_head, info.n_head_kv) == ("llama", 2, 128, 4, 2)
        assert info.n_vocab == 49152
        assert m.tokenize("hello world")  # SmolLM2's tokenizer works
    check = load_script("make_random_model").check(out, n_tokens=3)
    assert len(check["tokens"]) == 3


def test_bench_calibration_smoke(tmp_path, capsys):
    """The calibration-cost benchmark on a tiny random model: unit costs of today's procedure and of the fast
    profile, today's total from them, then calibrate --fast end to end (with the query statistics and the
    choice among the signals); the progress bars go to stderr."""
    model = tmp_path / "tiny.gguf"
    assert load_script("make_random_model").main(["--layers", "4", "--embd", "128", "--n-ff", "256", "--n-head",
                                                  "4", "--n-head-kv", "2", "--out", str(model), "--no-check"]) == 0
    out = tmp_path / "cost.json"
    rc = load_script("bench_calibration").main(["--model", str(model), "--checkpoints", "1", "--threads", "2",
                                                "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    labels = {(u["horizon"], u["batch"]): u for u in doc["units"]["labels"]}
    assert set(labels) == {(32, 1), (32, 8), (8, 8)}
    assert all(u["positions"] > 0 and finite_positive(u["seconds_per_position"]) for u in labels.values())
    assert finite_positive(doc["today"]["total_s"]) and doc["today"]["label_positions"] > 0
    assert finite_positive(doc["fast"]["total_s"]) and finite_positive(doc["speedup"])
    assert doc["fast"]["selected"]["policy"]
    err = capsys.readouterr().err
    assert "calibrate grid" in err and "labels" in err
