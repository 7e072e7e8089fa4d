"""Rows 8 (the CLI part) and 10 of the hostile-inputs table, through real processes.

Row 10, output that cannot be written: a closed pipe (``generate ... | head -c 10``) ends quietly with exit status
141 (128 + SIGPIPE, as Unix tools) and no "Exception ignored" at interpreter exit; a write error (``> /dev/full``)
is one ``epikv-local: error: cannot write ...: <reason>`` line and exit status 2; an output path that cannot be
written (``labels --out /proc/nope/x``) is one line before any work, and leaves nothing behind.

Row 8, input that is not UTF-8: ``printf '\\xff\\n' | epikv-local chat -m M`` refuses the message with one line and
the chat goes on (no traceback); so does a lone surrogate, typed into the pseudo-terminal chat.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "epikv_local.cli"]
LONG = ["-p", "Count from one to one thousand, in words:", "-n", "3000", "--ignore-eos", "-t", "1"]


def one_line(stderr: str, needle: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("epikv-local: using calibration")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("epikv-local: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    return lines[0]


# -- row 10 ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("json_out", [False, True])
def test_row10_closed_pipe_ends_quietly_with_141(model_path, json_out):
    """The reader takes 10 bytes and goes away (``| head -c 10``); streaming text keeps writing into the closed pipe.
    With --json the one document is written at the end, into a pipe already closed."""
    args = [*LONG[:3], "100", *LONG[4:], "--json"] if json_out else LONG  # --json: the whole run, then one write
    p = subprocess.Popen(CLI + ["generate", "-m", str(model_path), *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        if json_out:
            p.stdout.close()  # gone before anything is written
        else:
            assert len(p.stdout.read(10)) == 10
            p.stdout.close()
        err = p.stderr.read().decode()
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 141, (p.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err
    assert "n_generated_tokens" not in err  # it stopped there: no statistics line after the text could not go out


def test_row10_closed_pipe_in_a_shell_pipeline(model_path):
    """As a user writes it: ``epikv-local generate ... | head -c 10``; the shell sees 141."""
    cmd = " ".join(f"'{a}'" for a in [*CLI, "generate", "-m", str(model_path), *LONG])
    r = subprocess.run(["bash", "-c", f"{cmd} | head -c 10 >/dev/null; echo \"status=${{PIPESTATUS[0]}}\""],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.stdout.strip() == "status=141", (r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("args", [["generate", "-p", "Hi", "-n", "4", "-t", "1"],
                                  ["generate", "-p", "Hi", "-n", "4", "-t", "1", "--json"], ["fetch-model"]],
                         ids=["generate", "generate-json", "fetch-model"])
def test_row10_write_error_is_one_line(model_path, args):
    if args[0] == "generate":
        args = [args[0], "-m", str(model_path), *args[1:]]
    with open("/dev/full", "w") as full:
        r = subprocess.run(CLI + args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    one_line(r.stderr, "cannot write standard output: No space left on device")


@pytest.mark.parametrize("cmd", ["labels", "calibrate"])
def test_row10_output_path_that_cannot_be_written(model_path, tmp_path, cmd):
    traces = tmp_path / "t.jsonl"
    traces.write_text('{"problem": "1+1", "trace": "2"}\n')
    plain = tmp_path / "plain"
    plain.write_text("a file, not a folder")
    cases = [("/proc/nope/x", "cannot create /proc/nope"), (str(tmp_path), "it is a directory"),
             (str(plain / "x.json"), "is not a folder")]
    for out, needle in cases:
        extra = ["--quick"] if cmd == "calibrate" else []
        r = subprocess.run(CLI + [cmd, "-m", str(model_path), "--traces", str(traces), "--out", out, *extra],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert r.returncode == 2, (out, r.returncode, r.stderr[-2000:])
        line = one_line(r.stderr, needle)
        assert line.startswith(f"epikv-local: error: cannot write the {'labels' if cmd == 'labels' else 'calibration'} "
                               f"file {out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "t.jsonl"]  # no probe, no partial file


def test_row10_labels_output_errors_found_late_are_one_line(tmp_path):
    """An OSError about the output path raised while the work runs (here: a read-only folder met by mkdir) is
    one line too, and any other OSError still propagates."""
    from epikv_local.eval.commands import output_errors
    from epikv_local.errors import ConfigError

    out = tmp_path / "sub" / "labels.jsonl"
    with pytest.raises(ConfigError, match=f"cannot write the labels file {out}: No such file"):
        with output_errors(out, "labels"):
            open(out, "a")
    with pytest.raises(ConfigError, match="Permission denied"):
        with output_errors(out, "labels"):
            raise PermissionError(13, "Permission denied", str(out.parent / ".labels.jsonl.tmp1"))
    with pytest.raises(FileNotFoundError):
        with output_errors(out, "labels"):
            open(tmp_path / "elsewhere" / "input.jsonl")


def test_row10_run_main_guards_only_the_output():
    """An OSError that is not about writing the output keeps its traceback (a bug); the streams are restored."""
    code = """
import sys
from epikv_local.errors import run_main
before = sys.stdout
def main(argv):
    open("/nonexistent/input")
try:
    run_main("t", main)
except FileNotFoundError:
    print("propagated", sys.stdout is before)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stdout.strip() == "propagated True", r.stderr


# -- row 8 -------------------------------------------------------------------------------------------------------------
def test_row8_chat_input_that_is_not_utf8_is_refused_and_the_chat_goes_on(model_path):
    r = subprocess.run(CLI + ["chat", "-m", str(model_path), "-n", "8", "--temp", "0", "-t", "1"],
                       input=b"\xff\n\xed\xa0\x80\ncaf\xe9\nHi\n/exit\n", capture_output=True, timeout=300, cwd=REPO)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err[-2000:]
    assert "Traceback" not in err
    refused = [ln for ln in err.splitlines() if ln.startswith("epikv-local: error:")]
    assert refused == ["epikv-local: error: input is not UTF-8 (the message was not sent)"] * 3, err
    out = r.stdout.decode()
    assert out.count("> ") >= 5 and out.replace("> ", "").strip(), out  # "Hi" was answered after the refusals


def test_row8_lone_surrogate_typed_in_the_terminal_chat(model_path):
    """The pseudo-terminal chat of test_chat_terminal: bytes that are no UTF-8 (a UTF-8-encoded lone surrogate,
    an invalid byte) are refused with one line; the next message is answered."""
    from test_chat_terminal import PtyChat

    c = PtyChat("-m", str(model_path), "--kv-budget", "96", "-t", "1", "--temp", "0", "-n", "8")
    try:
        c.prompt()
        for bad in (b"\xed\xa0\x80", b"ab\xffcd"):
            start = len(c.screen)
            os.write(c.fd, bad + b"\r")
            shown = c.prompt(start)
            assert "input is not UTF-8" in shown, shown
        assert "Traceback" not in c.screen
        assert c.say("Hello!").split("\n", 1)[1].strip()
        c.send("/exit\r")
        assert c.wait() == 0
    finally:
        c.close()
