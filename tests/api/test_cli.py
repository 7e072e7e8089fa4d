"""The command line: JSON output on the real model, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epikv_local.policies import DEFAULT_POLICY

CLI = [sys.executable, "-m", "epikv_local.cli"]


def cli(*args, timeout=300):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


def test_generate_json(model_path):
    r = cli("generate", "--model", str(model_path), "--prompt", "Count from one to twenty, in words:",
            "--max-tokens", "150", "--kv-budget", "64", "--n-recent", "24", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("policy", "kv_budget", "n_prompt_tokens", "n_generated_tokens", "n_evicted", "max_live_cells",
                "decode_tokens_per_s", "prefill_tokens_per_s", "kv_bytes", "flash_attn", "text"):
        assert key in out, key
    assert out["policy"] == DEFAULT_POLICY and out["kv_budget"] == 64
    assert out["n_generated_tokens"] == 150
    assert out["max_live_cells"] <= 64 and out["n_evicted"] > 0
    assert out["flash_attn"] is True
    assert out["kv_bytes"] > 0 and out["decode_tokens_per_s"] > 0
    assert isinstance(out["text"], str) and out["text"]


def one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("epikv-local: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_missing_model_file(tmp_path):
    one_line_error(cli("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"), "not found")


def test_non_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    one_line_error(cli("generate", "--model", str(bad), "--prompt", "hi"), "not a GGUF file")


def test_layers_beyond_depth(model_path):
    one_line_error(cli("generate", "--model", str(model_path), "--prompt", "hi", "--layers", "9,40"),
                   "beyond what a 30-layer model can capture")


def test_budget_smaller_than_protected(model_path):
    one_line_error(cli("generate", "--model", str(model_path), "--prompt", "hi", "--kv-budget", "16",
                       "--n-sink", "8", "--n-recent", "8"), "too small for the protected tokens")


def test_unknown_policy_is_refused(model_path):
    r = cli("generate", "--model", str(model_path), "--prompt", "hi", "--policy", "h3o")
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


def test_architecture_without_l_out(tmp_path):
    """A GGUF whose architecture llama.cpp does not know is refused with one line (no crash)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "unknown_arch.gguf"
    w = gguf.GGUFWriter(str(path), "epikv-unknown-arch")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = cli("generate", "--model", str(path), "--prompt", "hi")
    one_line_error(r, "could not load")


def test_readme_python_examples_run(tmp_path, model_path):
    """The README's Python examples, executed as written; the drop-in snippet gets the cached default model for
    its GGUF file and a token limit (the small model could otherwise ramble for a long time)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2, "README needs the drop-in snippet and the engine example"
    drop_in = blocks[0]
    assert "from epikv_local import Llama" in drop_in and "kv_budget" in drop_in
    drop_in = re.sub(r'model_path="[^"]+"', f"model_path={str(model_path)!r}", drop_in)
    drop_in = drop_in.replace("stream=True)", "stream=True, max_tokens=48)")
    for i, code in enumerate([drop_in, blocks[1]]):
        script = tmp_path / f"example{i}.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()
    assert "live cells:" in r.stdout


def test_llama_cpp_style_flags_text_on_stdout_stats_on_stderr(model_path):
    r = cli("generate", "-m", str(model_path), "-p", "Say hi.", "--chat", "--system", "Be brief.", "-n", "12",
            "-ngl", "-1", "-ctk", "q8_0", "-ctv", "q8_0", "--temp", "0", "-s", "3", "-t", "1", "--kv-budget", "96")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "policy=" not in r.stdout
    stats = r.stderr.strip().splitlines()[-1]
    assert f"policy={DEFAULT_POLICY}" in stats and "flash_attn=True" in stats and "n_generated_tokens=" in stats


def test_version_and_help_show_defaults():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("epikv-local ")
    h = cli("generate", "--help").stdout
    assert "(default: 0.6)" in h and "(default: -1)" in h and "-ngl" in h and "-ctk" in h


def test_system_without_chat_is_one_line(model_path):
    one_line_error(cli("generate", "-m", str(model_path), "-p", "hi", "--system", "x"), "--system needs --chat")
