"""Hardening: every row of the hostile-user table, and a bad-input matrix over the CLI and the API.

CLI cases assert: one ``epikv-local: error: ...`` line, exit status 2, no traceback, no file left behind.
API cases assert: the documented exception class, and that the object is still usable afterwards.
Interrupts: a real SIGINT sent to a real process at several moments (model load, prefill, decoding) ends it
with exit status 130, one line and no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from epikv_local.api.generation import generate, stream_generate
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.handles import Model, resolve_threads
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import BudgetError, ConfigError, EpikvError, NativeError
from epikv_local.policies import make_policy

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "epikv_local.cli"]


def cli(*args, timeout=300, cwd=REPO):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def one_line(r, needle=""):
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("epikv-local: using calibration")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("epikv-local: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


# -- the bad-input matrix: command line -----------------------------------------------------------------------------
GEN_CASES = [
    # sizes
    (["--kv-budget", "0"], "kv_budget"), (["--kv-budget", "-1"], "kv_budget"),
    (["--kv-budget", str(2**32)], "kv_budget"), (["--kv-budget", str(2**32 - 64)], "kv_budget"),
    (["--batch", "0"], "n_batch"), (["--batch", "100000"], "n_batch"), (["--n-sink", "-1"], "n_sink"),
    (["--n-recent", "-1"], "n_recent"), (["--evict-chunk", "0"], "evict_chunk"), (["--max-tokens", "0"], "max-tokens"),
    (["--max-tokens", "-5"], "max-tokens"), (["--kv-budget", "16", "--n-sink", "8", "--n-recent", "8"], "too small"),
    # ranges
    (["--temp", "nan"], "finite"), (["--temp", "inf"], "finite"), (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"), (["--seed", "-1"], "seed"), (["--seed", str(2**32)], "seed"),
    (["--min-p", "2"], "min_p"), (["--repeat-penalty", "0"], "repeat_penalty"), (["--threads", "0"], "n_threads"),
    (["--threads", "100000"], "n_threads"), (["--threads", "20000"], "n_threads"), (["--window", "0"], "window"),
    (["--window", "1"], "window"), (["--layers", "99"], "beyond"), (["--layers", "9,9"], "distinct"),
    (["--policy", "streaming", "--layers", "9"], "no setting 'layers'"),
    (["--policy", "random", "--window", "64"], "no setting 'window'"), (["--stop", ""], "--stop"),
    (["--policy", "h2o"], "flash attention"), (["--policy", "h2o", "--no-flash-attn", "-ctv", "q4_0"], "quantizes"),
    (["--system", "x"], "--system needs --chat"),
    # encodings
    (["--prompt", "\udcff\udcfe"], "not valid UTF-8"),
]


@pytest.mark.parametrize("extra,needle", GEN_CASES, ids=[" ".join(a)[:40] for a, _ in GEN_CASES])
def test_generate_bad_input_is_one_line(model_path, extra, needle):
    args = ["generate", "-m", model_path, "-p", "hi", "-n", "4", *extra]
    if "--prompt" in extra:
        args = ["generate", "-m", model_path, "-n", "4", *extra]
    r = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=REPO,
                       errors="surrogateescape")
    one_line(r, needle)


def test_model_file_problems(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")  # a header cut after the version
    folder = tmp_path / "dir.gguf"
    folder.mkdir()
    for path, needle in ((tmp_path / "missing.gguf", "not found"), (empty, "not a GGUF"), (folder, "not a file"),
                         (truncated, "could not load")):
        one_line(cli("generate", "-m", path, "-p", "hi"), needle)


def test_data_file_problems_write_nothing(model_path, tmp_path):
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(b'{"problem": "caf\xe9", "trace": "x"}\n')
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"problem": "1+1", "trace": "2"}\n{oops\n')
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "1+1"}\n')
    for traces, needle in ((tmp_path / "none.jsonl", "not found"), (bad_utf8, "not UTF-8"), (not_json, ":2: not JSON"),
                           (wrong, "without 'problem'")):
        out = tmp_path / f"labels-{traces.stem}.jsonl"
        one_line(cli("labels", "--model", model_path, "--traces", traces, "--out", out), needle)
        assert not out.exists()
        cal = tmp_path / f"cal-{traces.stem}.json"
        one_line(cli("calibrate", "--model", model_path, "--traces", traces, "--quick", "--out", cal), needle)
        assert not cal.exists() and not list(tmp_path.glob(".cal-*"))


def test_unknown_subcommand_and_flag_are_usage_errors():
    for args in (["frobnicate"], ["generate", "--no-such-flag"]):
        r = cli(*args)
        assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr


# -- interrupts ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [0.0, 0.2, 0.5, 1.0, 2.0, 4.0])
def test_sigint_at_any_moment_exits_130_without_traceback(model_path, delay):
    """Row 5: a SIGINT during model load used to be swallowed by the log callback ("Exception ignored"). The
    delay counts from llama.cpp's first log line (the model load starts), so that a loaded machine cannot move
    the signal into the interpreter's own start-up."""
    p = subprocess.Popen(CLI + ["generate", "-m", str(model_path), "-p", "Write a very long story.", "--ignore-eos",
                                "-n", "100000", "--verbose", "-t", "1"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline()
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    err = first + err
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err
    assert err.rstrip().splitlines()[-1] == "epikv-local: interrupted"


# -- the table's rows in the API -------------------------------------------------------------------------------------
def run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_row1_closed_model_refuses_use(model_path):
    r = run_py(f"""
import epikv_local as ek
m = ek.Model({str(model_path)!r}); m.close(); m.close()
for call in (lambda: m.tokenize("hi"), lambda: m.token_bytes(1), lambda: m.is_eog(1), lambda: m.meta("x")):
    try:
        call(); print("no error")
    except ek.NativeError as e:
        print("refused", "closed" in str(e))
""")
    assert r.returncode == 0, r.stderr  # it used to abort
    assert r.stdout.split() == ["refused", "True"] * 4


def test_row2_model_refuses_to_close_under_an_open_session(model, model_path):
    with Model(model_path) as m:
        s = Session(m, make_policy("streaming"), BudgetConfig(kv_budget=64), SessionConfig(n_threads=1))
        with pytest.raises(NativeError, match="open context"):
            m.close()
        toks = m.tokenize("Once upon a time")
        res = generate(s, toks, 8, SamplingConfig(), ignore_eog=True)  # used to segfault
        assert res.stats.n_generated_tokens == 8
    # leaving the with block did not free the model under the session: it goes with the last context
    assert not m.closed
    s.reset()
    s.close()
    assert m.closed


def test_row3_threads_are_checked_against_the_machine():
    n = len(os.sched_getaffinity(0))
    for bad in (0, -1, 100000, 4 * n + 1, True, 2.5):
        with pytest.raises(ConfigError, match="n_threads"):
            resolve_threads(bad)
    assert resolve_threads(1) == 1
    assert resolve_threads(None) == max(1, min(8, n - 1))  # row 7: one core left for the neighbour


def test_row4_lazy_exports_return_objects():
    r = run_py("import epikv_local as ek; ek.generate; ek.Llama; print(callable(ek.generate), ek.generate.__name__,"
               " ek.Llama.__name__)")
    assert r.returncode == 0 and r.stdout.split() == ["True", "generate", "Llama"], r.stderr


def test_row9_closed_session_and_second_generation(model):
    toks = model.tokenize("Once upon a time")
    s = Session(model, make_policy("epikv"), BudgetConfig(kv_budget=64), SessionConfig(n_threads=1))
    generate(s, toks, 4, SamplingConfig(), ignore_eog=True)
    with pytest.raises(ConfigError, match="reset"):  # a hint, not a bare BudgetError
        generate(s, toks, 4, SamplingConfig(), ignore_eog=True)
    s.reset()
    assert generate(s, toks, 4, SamplingConfig(), ignore_eog=True).stats.n_generated_tokens == 4
    s.close()
    s.close()
    with pytest.raises(NativeError, match="closed"):
        generate(s, toks, 4, SamplingConfig())
    with pytest.raises(NativeError, match="closed"):
        s.reset()


def test_row10_one_session_two_threads(model):
    toks = model.tokenize("Write a story about a lighthouse keeper.")
    with Session(model, make_policy("epikv"), BudgetConfig(kv_budget=96), SessionConfig(n_threads=1)) as s:
        errors, results = [], []
        started = threading.Event()

        def first():
            for i, _ in enumerate(stream_generate(s, toks, 200, SamplingConfig(), ignore_eog=True)):
                if i == 2:
                    started.set()
                    time.sleep(0.5)
            results.append("done")

        t = threading.Thread(target=first)
        t.start()
        started.wait(60)
        try:
            generate(s, toks, 5, SamplingConfig())
        except ConfigError as e:
            errors.append(str(e))
        t.join(120)
        assert results == ["done"] and len(errors) == 1 and "already generating" in errors[0]
        assert s.stats().max_live <= 96


# -- API misuse matrix ----------------------------------------------------------------------------------------------
API_CASES = [
    (lambda: BudgetConfig(kv_budget=True), ConfigError), (lambda: BudgetConfig(kv_budget=2**40), ConfigError),
    (lambda: BudgetConfig(kv_budget=64, recent_fraction=1.0), ConfigError),
    (lambda: BudgetConfig(kv_budget=64, recent_fraction=float("nan")), ConfigError),
    (lambda: SessionConfig(n_batch=0), ConfigError), (lambda: SessionConfig(capture_route="x"), ConfigError),
    (lambda: SessionConfig(type_k="q3"), ConfigError), (lambda: SamplingConfig(temperature=float("inf")), ConfigError),
    (lambda: SamplingConfig(seed=2**32), ConfigError), (lambda: SamplingConfig(logit_bias={1: float("nan")}), ConfigError),
    (lambda: make_policy("epikv", layers="ab"), ConfigError), (lambda: make_policy("knorm", n_head_kv=0), ConfigError),
    (lambda: make_policy("nope"), ConfigError), (lambda: make_policy("epikv", bogus=1), ConfigError),
]


@pytest.mark.parametrize("i", range(len(API_CASES)))
def test_api_bad_settings(i):
    make, exc = API_CASES[i]
    with pytest.raises(exc):
        make()


def test_api_misuse_leaves_objects_usable(model):
    with Session(model, make_policy("epikv"), BudgetConfig(kv_budget=64), SessionConfig(n_threads=1)) as s:
        toks = model.tokenize("Hello there")
        for bad in (lambda: generate(s, [], 4), lambda: generate(s, toks, 0), lambda: generate(s, toks, 4, stop=("",)),
                    lambda: s.feed(toks, logits="some"), lambda: model.tokenize("\udcff")):
            with pytest.raises(ConfigError):
                bad()
        assert generate(s, toks, 3, SamplingConfig(), ignore_eog=True).stats.n_generated_tokens == 3
        with pytest.raises(BudgetError):
            Session(model, make_policy("none"), BudgetConfig(kv_budget=8), SessionConfig(n_threads=1)).feed(
                list(range(40)), is_prompt=True)
    assert issubclass(BudgetError, EpikvError)


def test_no_half_written_labels_on_interrupt(model_path, tmp_path):
    """labels appends whole checkpoints (resumable); an interrupt leaves only complete JSON lines."""
    out = tmp_path / "labels.jsonl"
    traces = REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"
    p = subprocess.Popen(CLI + ["labels", "--model", str(model_path), "--traces", str(traces), "--n-traces", "1",
                                "--max-tokens", "256", "--out", str(out), "--threads", "1"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode in (0, 130), err
    if out.exists():
        for line in out.read_text().splitlines():
            json.loads(line)


def test_busy_session_numbers_stay_sane(model):
    """The engine's view equals llama.cpp's cell list after a generation with evictions."""
    with Session(model, make_policy("epikv"), BudgetConfig(kv_budget=48, n_recent=16), SessionConfig(n_threads=1)) as s:
        generate(s, model.tokenize("Count to one hundred:"), 120, SamplingConfig(), ignore_eog=True)
        cells = s.ctx.cell_positions()
        assert np.array_equal(np.sort(cells[cells >= 0]), s.live_positions())


def test_calibrate_refuses_a_bad_parallel_count(model_path, tmp_path):
    cal = tmp_path / "cal.json"
    for bad in ("0", "65", "-2"):
        one_line(cli("calibrate", "--model", model_path, "--quick", "--parallel", bad, "--out", cal), "--parallel")
    assert not cal.exists()
