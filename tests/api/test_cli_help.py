"""``--help`` of every subcommand: each default shown once, every sampling option explained, the policy list printed
once, and ``calibrate`` / ``labels`` take ``-m`` as well as ``--model``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from epikv_local.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["generate", "demo", "serve", "chat", "labels", "calibrate", "fetch-model"]


def help_text(cmd: str) -> str:
    r = subprocess.run([sys.executable, "-m", "epikv_local.cli", cmd, "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def entries(text: str) -> dict[str, str]:
    """{first option string: its whole help entry (wrapped lines joined)}."""
    body = text.split("options:", 1)[1]
    out = {}
    for block in re.split(r"\n(?=  -)", body):
        block = block.strip()
        if block.startswith("-"):
            out[block.split()[0].rstrip(",")] = " ".join(block.split())
    return out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_default_is_shown_once(cmd):
    text = help_text(cmd)
    assert "(default: None)" not in text
    for opt, entry in entries(text).items():
        assert entry.lower().count("(default") <= 1, entry


def test_defaults_and_help_of_the_sampling_options():
    e = entries(help_text("generate"))
    expected = {"--temp": "0.6", "--top-p": "0.95", "--top-k": "0", "--min-p": "0.0", "--typical": "1.0",
                "--repeat-penalty": "1.0", "--presence-penalty": "0.0", "--frequency-penalty": "0.0",
                "--repeat-last-n": "64", "--mirostat": "0", "--mirostat-lr": "0.1", "--mirostat-ent": "5.0",
                "-s": "0", "--reasoning-budget": "-1", "-ngl": "-1", "-ctk": "f16", "-ctv": "f16"}
    for opt, default in expected.items():
        assert f"(default: {default})" in e[opt], e[opt]
    for opt, entry in e.items():  # every option says what it does (the flag and its metavar are not enough)
        flags = re.match(r"^(-[^\s,]+( [A-Z][^\s,]*)?,? ?)+", entry).group(0)
        assert len(entry) - len(flags) > 10, entry
    assert "nucleus" in e["--top-p"] and "seed" in e["-s"]
    assert "CPUs available - 1" in e["-t"] and e["-t"].count("(default") == 1


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve"])
def test_the_policy_list_is_printed_once(cmd):
    text = help_text(cmd)
    assert text.count("triattention") == 1, text  # the last registered name: once, in --policy's help
    assert text.count("q5_1") == 1  # the KV types too


def test_calibrate_and_labels_take_m():
    ap = build_parser()[0]
    for cmd in ("calibrate", "labels"):
        extra = ["--traces", "t.jsonl"] if cmd == "labels" else []
        assert ap.parse_args([cmd, "-m", "x.gguf", *extra]).model == "x.gguf"
        assert ap.parse_args([cmd, "--model", "y.gguf", *extra]).model == "y.gguf"  # the old spelling works
    assert "-m MODEL, --model MODEL" in help_text("calibrate")


def test_demo_shows_its_own_defaults():
    e = entries(help_text("demo"))
    assert "(default: 600)" in e["-n"] and "(default: 256)" in e["--kv-budget"]
