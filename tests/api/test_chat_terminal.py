"""``epikv-local chat``: the rendering and the history rules on synthetic chunks, then the real program on the
default model driven through a pseudo-terminal (Ctrl-C and Ctrl-D are sent as the terminal's bytes)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from epikv_local.api import terminal as T
from epikv_local.errors import BudgetError

ROOT = Path(__file__).resolve().parents[2]
READ_TIMEOUT = 120.0  # seconds without any output before a read gives up (generous: slow CI machines)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]")


# -- rendering (no model) ------------------------------------------------------------------------------------
def chunk(content=None, reasoning=None, finish=None, ext=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    c = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if ext is not None:
        c["epikv"] = ext
    return c


def reasoning_stream():
    return [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
            chunk(reasoning="Let me think"), chunk(reasoning=" about it."), chunk(content="The answer"),
            chunk(content=" is 4."), chunk(finish="stop", ext={"live_cells": 12})]


def test_render_dims_reasoning_on_a_colour_terminal():
    out = io.StringIO()
    ans = T.render(reasoning_stream(), out, color=True)
    assert out.getvalue() == "\x1b[2mLet me think about it.\x1b[0m\nThe answer is 4.\n"
    assert (ans.reasoning, ans.content, ans.finish_reason) == ("Let me think about it.", "The answer is 4.", "stop")
    assert ans.extension == {"live_cells": 12} and not ans.interrupted


def test_render_without_colour_frames_reasoning_and_writes_no_escapes():
    out = io.StringIO()
    ans = T.render(reasoning_stream(), out, color=False)
    assert out.getvalue() == "<think>\nLet me think about it.\n</think>\nThe answer is 4.\n"
    assert "\x1b" not in out.getvalue()
    assert ans.content == "The answer is 4."


@pytest.mark.parametrize("color", [True, False])
def test_render_hide_reasoning(color):
    out = io.StringIO()
    ans = T.render(reasoning_stream(), out, show_reasoning=False, color=color)
    assert out.getvalue() == "The answer is 4.\n"
    assert ans.reasoning == "Let me think about it."  # collected, not shown


def test_render_stops_when_asked_and_resets_the_colour():
    consumed = []

    def chunks():
        for c in reasoning_stream():
            consumed.append(c)
            yield c

    out = io.StringIO()
    ans = T.render(chunks(), out, color=True, should_stop=lambda: len(consumed) >= 2)
    assert ans.interrupted and ans.reasoning == "Let me think" and ans.content == ""
    assert len(consumed) == 2  # nothing read after the stop
    assert out.getvalue() == "\x1b[2mLet me think\x1b[0m\n\x1b[2m[stopped]\x1b[0m\n"


def test_render_keyboard_interrupt_stops_and_an_error_propagates_with_the_line_ended():
    def interrupted():
        yield chunk(content="partial")
        raise KeyboardInterrupt

    out = io.StringIO()
    ans = T.render(interrupted(), out)
    assert ans.interrupted and ans.content == "partial"
    assert out.getvalue() == "partial\n[stopped]\n"

    def failing():
        yield chunk(reasoning="hmm")
        raise BudgetError("does not fit")

    out = io.StringIO()
    with pytest.raises(BudgetError):
        T.render(failing(), out, color=True)
    assert out.getvalue() == "\x1b[2mhmm\x1b[0m\n"


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_colour_only_on_a_terminal_without_no_color():
    assert T.use_color(Tty(), {}) is True
    assert T.use_color(Tty(), {"NO_COLOR": "1"}) is False
    assert T.use_color(Tty(), {"NO_COLOR": ""}) is True  # no-color.org: set and not empty
    assert T.use_color(io.StringIO(), {}) is False


# -- the history rules (a stand-in Llama) ---------------------------------------------------------------------
class FakeStats:
    n_live, kv_budget, max_live, n_evicted, kv_bytes = 7, 96, 9, 3, 1024


class FakeLlama:
    """Answers with ``script``: a list of chunks, or an exception raised by the call."""

    def __init__(self):
        self.script, self.calls, self.resets = [], [], 0
        self.session = Namespace(stats=lambda: FakeStats())

    def chat_completion_steps(self, messages, **kw):  # plain chunks: render() takes them as well as ChunkSteps
        self.calls.append([dict(m) for m in messages])
        if isinstance(self.script, Exception):
            raise self.script
        return (c for c in self.script)

    def reset(self):
        self.resets += 1


def fake_chat(**over):
    args = {"temperature": 0.0, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "max_tokens": None,
            "stop": [], "system": None, "hide_reasoning": False}
    args.update(over)
    out, err = io.StringIO(), io.StringIO()
    return T.Chat(FakeLlama(), Namespace(**args), out, err, color=False), out, err


def test_history_keeps_content_only_and_sends_the_system_message_every_turn():
    chat, _, _ = fake_chat(system="Be brief.")
    chat.llm.script = reasoning_stream()
    chat.turn("2+2?")
    chat.turn("and 3+3?")
    assert chat.history == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is 4."},
                            {"role": "user", "content": "and 3+3?"},
                            {"role": "assistant", "content": "The answer is 4."}]
    assert chat.llm.calls[1][0] == {"role": "system", "content": "Be brief."} and len(chat.llm.calls[1]) == 4


def test_a_stopped_answer_is_kept_and_one_without_text_is_dropped():
    chat, _, _ = fake_chat()

    def stopped(with_text):
        yield chunk(reasoning="thinking")
        if with_text:
            yield chunk(content="Once upon")
        raise KeyboardInterrupt

    chat.llm.script = stopped(True)
    chat.turn("story")
    assert chat.history[-1] == {"role": "assistant", "content": "Once upon"}
    chat.llm.script = stopped(False)
    chat.turn("another")
    assert [m["content"] for m in chat.history] == ["story", "Once upon"]


def test_sigint_during_an_answer_stops_it_softly_and_a_second_one_clears_the_cache():
    chat, out, err = fake_chat()
    chat.history = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]
    after_stop = []
    # the handler in force before the turn: Python's default, or SIG_IGN when the suite runs as a background
    # job of a non-interactive shell (which starts it with SIGINT ignored)
    before = signal.getsignal(signal.SIGINT)

    def answer(n_sigint):
        yield chunk(content="Once")
        for _ in range(n_sigint):
            os.kill(os.getpid(), signal.SIGINT)  # as the terminal's Ctrl-C; the handler runs at once
        yield chunk(content=" upon")
        after_stop.append(True)  # only reached when nothing stopped the reading
        yield chunk(finish="stop")

    chat.llm.script = answer(1)  # one Ctrl-C: the answer stops at its next chunk, the cache stays
    chat.turn("story")
    assert chat.history[-1] == {"role": "assistant", "content": "Once upon"} and chat.llm.resets == 0
    assert out.getvalue().endswith("Once upon\n[stopped]\n") and not after_stop
    chat.llm.script = answer(2)  # a second one interrupts at once: the cache is cleared, the partial kept
    chat.turn("again")
    assert chat.history[-1] == {"role": "assistant", "content": "Once"} and len(chat.history) == 6
    assert chat.llm.resets == 1 and "cache was cleared" in err.getvalue() and chat.last is None
    assert signal.getsignal(signal.SIGINT) is before  # restored after the turn


def test_a_library_error_is_one_line_and_the_turn_is_dropped():
    chat, _, err = fake_chat()
    chat.llm.script = BudgetError("the first prompt (500 tokens) does not fit\nsecond line")
    chat.turn("a very long message")
    assert chat.history == []
    assert err.getvalue() == "epikv-local: error: the first prompt (500 tokens) does not fit\n"


def test_commands():
    chat, out, err = fake_chat()
    chat.llm.script = reasoning_stream()
    chat.turn("hi")
    assert chat.command("/stats")
    text = out.getvalue()
    assert "messages: 2 (1 turn)" in text and "live cells: 7 (budget 96)" in text and "max live cells: 9" in text
    assert "evicted: 3" in text and "KV bytes: 1024" in text
    assert chat.command("/reset") and chat.history == [] and chat.llm.resets == 1
    assert chat.command("/help") and "/stats" in out.getvalue()
    assert chat.command("/nope") and "unknown command /nope" in err.getvalue()
    assert chat.command("/exit") is False and chat.command("/quit") is False


# -- the real program through a pseudo-terminal ---------------------------------------------------------------
class PtyChat:
    """``epikv-local chat`` with a pseudo-terminal as its controlling terminal (stdin, stdout and stderr)."""

    def __init__(self, *args: str):
        env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
        env.update(TERM="dumb", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "epikv_local.cli", "chat", *args]
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once
            try:
                os.chdir(ROOT)
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.raw, self.status = pid, fd, b"", None

    @property
    def screen(self) -> str:
        """Everything written so far, without escape sequences and carriage returns."""
        return ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def _read(self, timeout: float = READ_TIMEOUT) -> bool:
        """Read what is there within ``timeout`` seconds; False at end of output."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no output for {timeout:.0f} s; screen so far:\n{self.screen[-3000:]}")
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.raw += data
        return bool(data)

    def until(self, pattern: str, start: int = 0, timeout: float = READ_TIMEOUT) -> re.Match:
        """Read until the screen from ``start`` on matches ``pattern``."""
        rx = re.compile(pattern, re.DOTALL)
        while True:
            m = rx.search(self.screen, start)
            if m:
                return m
            if not self._read(timeout):
                raise AssertionError(f"output ended before {pattern!r}; screen:\n{self.screen[-3000:]}")

    def prompt(self, start: int = 0, timeout: float = READ_TIMEOUT) -> str:
        """Wait for a fresh prompt after ``start``; return the screen between."""
        m = self.until(r"\n> $", start, timeout)
        return self.screen[start:m.start() + 1]

    def say(self, text: str) -> str:
        """Send a line and return what came back before the next prompt."""
        start = len(self.screen)
        self.send(text + "\r")
        return self.prompt(start)

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def interrupt_prompt(self) -> str:
        """Ctrl-C at the idle prompt; return the screen up to the next prompt.

        CPython's readline loop can miss a SIGINT that lands after the prompt is drawn and before it waits in
        select() (the signal is then handled at the next one): a Ctrl-C that shows no effect is sent again."""
        start = len(self.screen)
        for _ in range(10):
            self.send("\x03")
            try:
                return self.prompt(start, timeout=5)
            except TimeoutError:
                continue
        raise AssertionError(f"Ctrl-C at the prompt had no effect; screen:\n{self.screen[-3000:]}")

    def wait(self) -> int:
        while self._read():
            pass
        _, status = os.waitpid(self.pid, 0)
        self.status = os.waitstatus_to_exitcode(status)
        os.close(self.fd)
        return self.status

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:
                pass
            os.close(self.fd)
            self.status = -9


@pytest.fixture
def chat(model_path):
    sessions = []

    def start(*extra: str) -> PtyChat:
        c = PtyChat("-m", str(model_path), "--kv-budget", "96", "-t", "1", "--temp", "0", *extra)
        sessions.append(c)
        c.prompt()
        return c

    yield start
    for c in sessions:
        c.close()


def stat(text: str, pattern: str) -> int:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return int(m.group(1))


def test_turns_stats_reset_and_exit(chat):
    c = chat("-n", "40")
    assert "/help lists the commands" in c.screen
    first = c.say("What is the capital of France?")
    assert first.startswith("What is the capital of France?\n")  # the echo, then the answer
    assert first.split("\n", 1)[1].strip(), "no answer was streamed"
    second = c.say("And of Italy?")
    assert second.split("\n", 1)[1].strip()
    stats = c.say("/stats")
    assert stat(stats, r"messages: (\d+)") == 4
    assert stat(stats, r"(\d+) prompt tokens reused") > 0
    assert 0 < stat(stats, r"live cells: (\d+)") <= 96
    assert stat(stats, r"max live cells: (\d+)") <= 96
    assert stat(stats, r"KV bytes: (\d+)") > 0
    assert "conversation cleared" in c.say("/reset")
    stats = c.say("/stats")
    assert stat(stats, r"messages: (\d+)") == 0 and stat(stats, r"live cells: (\d+)") == 0
    assert "last turn: none" in stats
    assert "/reset" in c.say("/help")
    assert c.say("What is 2 + 2?").split("\n", 1)[1].strip()  # the chat goes on after /reset
    c.send("/exit\r")
    assert c.wait() == 0


def test_ctrl_c_stops_an_answer_and_ctrl_d_exits(chat):
    c = chat("-n", "300")  # long enough to be stopped, short enough to let the next turn end soon
    start = len(c.screen)
    c.send("Write a long story about a dragon\r")
    m = c.until(r"dragon\n(.{40})", start)  # the echo, then 40 characters of the answer
    c.send("\x03")
    stopped = c.prompt(m.start())
    assert "[stopped]" in stopped
    stats = c.say("/stats")
    assert stat(stats, r"messages: (\d+)") == 2  # the partial answer is kept
    follow = c.say("Give the dragon a name.")
    assert follow.split("\n", 1)[1].strip() and "[stopped]" not in follow
    assert stat(c.say("/stats"), r"(\d+) prompt tokens reused") > 0
    assert "Ctrl-D or /exit quits" in c.interrupt_prompt()  # Ctrl-C at the empty prompt: a fresh prompt
    assert stat(c.say("/stats"), r"messages: (\d+)") == 4  # still the same conversation
    c.send("\x04")  # Ctrl-D at the empty prompt
    assert c.wait() == 0


def test_a_prompt_that_cannot_fit_is_one_error_line_and_the_chat_goes_on(chat):
    c = chat("-n", "20")
    long = " ".join(f"word{i}" for i in range(150))
    out = c.say(long)
    errors = [ln for ln in out.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith("epikv-local: error:"), out
    assert "Traceback" not in c.screen
    assert stat(c.say("/stats"), r"messages: (\d+)") == 0
    assert c.say("Hello!").split("\n", 1)[1].strip()
    c.send("/quit\r")
    assert c.wait() == 0


@pytest.mark.parametrize("flags, needle", [(["-m", "/nonexistent/model.gguf"], "model file not found"),
                                           (["-n", "0"], "--max-tokens must be >= 1")])
def test_bad_startup_flags_exit_2_with_one_line(model_path, flags, needle):
    argv = ["-m", str(model_path), *flags] if flags[0] != "-m" else flags
    r = subprocess.run([sys.executable, "-m", "epikv_local.cli", "chat", *argv], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, cwd=ROOT, timeout=300, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("epikv-local: error:") and needle in lines[0], r.stderr
