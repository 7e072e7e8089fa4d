"""The terminal chat (``epikv-local chat``): a conversation on one budgeted KV cache, like ``llama-cli -cnv``.

One :class:`~epikv_local.api.llama.Llama` holds the whole conversation: every turn sends the full message
list and only the new tokens are decoded (the common prefix stays in the cache, evictions and all). The
history keeps the assistant's ``content`` only, never its reasoning (as a chat template that drops earlier
thinking expects).

Screen: the answer streams as it is generated; reasoning (``reasoning_content``) is shown dimmed when stdout
is a terminal and ``NO_COLOR`` is not set (https://no-color.org: set and not empty), between ``<think>`` and
``</think>`` lines otherwise, or not at all with ``--hide-reasoning``. Commands at the prompt: ``/stats``,
``/reset``, ``/help``, ``/exit`` (or ``/quit``); a line ending in ``\\`` continues on the next line; a
message that starts with ``/`` is typed as ``//...``.

Keys:

- Ctrl-C while an answer streams stops it at the next token and returns to the prompt. The partial answer
  is **kept**: what was shown stays in the history (and in the cache), so the next message can say
  "continue" or "shorter" (``/reset`` forgets it). When no answer text had appeared yet (stopped during
  the prompt or the reasoning), the turn is dropped from the history, as if it had not been asked. A second
  Ctrl-C before the answer has stopped (e.g. during a long prompt) interrupts at once; the cache is then
  cleared, because the interrupted library call may have left it half-updated, and the next turn decodes
  the conversation again.
- Ctrl-C at the prompt discards the line and gives a fresh prompt; it does not quit.
- Ctrl-D (end of input) at the prompt, ``/exit`` or ``/quit`` quit with status 0.

Errors of the library during a turn (:class:`~epikv_local.errors.EpikvError`, e.g. a first message that
cannot fit the budget) print one ``epikv-local: error: ...`` line, the turn is dropped from the history and
the chat goes on. So does input that is not UTF-8 (undecodable bytes on stdin, a lone surrogate): one
``epikv-local: error: input is not UTF-8 ...`` line, and the message is not sent. Errors at start-up (bad flags,
bad model, a grammar that does not parse) propagate: the CLI's ``run_main`` prints one line and exits 2.
Output that cannot be written (a closed pipe, a full disk) ends the chat through ``run_main`` too.

Sampling: the options of ``generate`` (:func:`.options.add_sampling_args`), translated once by
:func:`.options.llama_sampling_kwargs` into the keywords of every turn's call.

This module is imported when the CLI's parser is built: the heavy imports (the ``Llama``) happen in
:func:`run`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

from ..errors import ConfigError, EpikvError, OutputError, first_line

PROG = "epikv-local"
PROMPT = "> "
CONTINUATION_PROMPT = ". "
DIM, RESET = "\x1b[2m", "\x1b[0m"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
STOPPED = "[stopped]"
HELP = """\
Type a message and press Enter; end a line with \\ to continue it on the next line.
  /stats   live KV cells, evictions, max live cells, KV bytes, the last turn's prompt reuse
  /reset   forget the conversation (history and cache; --system stays)
  /help    this text
  /exit    quit (also /quit or Ctrl-D at the prompt)
Ctrl-C stops an answer (the text so far stays in the conversation); at the prompt it clears the line.
A message that starts with / is typed as //...\
"""


# -- arguments -----------------------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    """Add this command's arguments to its argparse subparser (``generate``'s flags where they mean the same)."""
    from .options import add_budget_args, add_model_args, add_sampling_args

    add_model_args(p)
    add_budget_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message (kept by /reset)")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="stop each answer after this many tokens (default: none, the KV budget bounds memory)")
    p.add_argument("--hide-reasoning", action="store_true", help="do not show the reasoning (<think>...</think>)")


# -- rendering -----------------------------------------------------------------------------------------------
def use_color(stream: TextIO, environ=None) -> bool:
    """Dim reasoning only on a terminal, and never when ``NO_COLOR`` is set to something (no-color.org)."""
    environ = os.environ if environ is None else environ
    if environ.get("NO_COLOR"):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@dataclass
class Answer:
    """What one streamed answer produced (filled while it streams, so it is complete even when stopped)."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    extension: dict = field(default_factory=dict)  # the chunk's "epikv" statistics (last chunk only)
    stats: object = None  # GenerationStats as of the last chunk read (a ChunkStep stream's), even when stopped
    interrupted: bool = False


def render(chunks: Iterable[dict], out: TextIO, *, show_reasoning: bool = True, color: bool = False,
           should_stop: Callable[[], bool] | None = None, answer: Answer | None = None) -> Answer:
    """Write OpenAI chat stream chunks to ``out`` as they arrive and return what they said. The items may
    also be ``ChunkStep``s (a chunk with its statistics, ``Llama.chat_completion_steps``): the answer then
    keeps the statistics of the last one read.

    ``content`` deltas are written as they are; ``reasoning_content`` deltas are dimmed (``color``), framed
    by ``<think>`` / ``</think>`` lines (no colour) or skipped (``show_reasoning=False``); they are collected
    in the answer either way. ``should_stop()`` is asked after every chunk: True stops reading, and so does a
    KeyboardInterrupt; the answer is then ``interrupted`` and a ``[stopped]`` line is written. The output
    always ends at the start of a line with the colour reset, also when the chunks raise (which propagates).
    """
    answer = Answer() if answer is None else answer
    mode = None  # "r" while writing reasoning, "c" while writing content
    at_line_start = True

    def write(text: str) -> None:
        nonlocal at_line_start
        if text:
            out.write(text)
            at_line_start = text.endswith("\n")

    def end_line() -> None:
        if not at_line_start:
            write("\n")

    def close_reasoning() -> None:
        nonlocal mode
        if mode == "r":
            if color:
                out.write(RESET)
                end_line()
            else:
                end_line()
                write(THINK_CLOSE + "\n")
        mode = None

    try:
        for chunk in chunks:
            if not isinstance(chunk, dict):  # a ChunkStep
                answer.stats = chunk.stats if chunk.stats is not None else answer.stats
                chunk = chunk.chunk
            choice = (chunk.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            reasoning, content = delta.get("reasoning_content") or "", delta.get("content") or ""
            if reasoning:
                answer.reasoning += reasoning
                if show_reasoning:
                    if mode != "r":
                        close_reasoning()
                        end_line()
                        write(DIM if color else THINK_OPEN + "\n")
                        at_line_start = True
                        mode = "r"
                    write(reasoning)
            if content:
                answer.content += content
                if mode != "c":
                    close_reasoning()
                    mode = "c"
                write(content)
            if choice.get("finish_reason") is not None:
                answer.finish_reason = choice["finish_reason"]
            if chunk.get("epikv"):
                answer.extension = chunk["epikv"]
            out.flush()
            if should_stop is not None and should_stop():
                answer.interrupted = True
                break
    except KeyboardInterrupt:
        answer.interrupted = True
    finally:
        close_reasoning()
        end_line()
        if answer.interrupted:
            write((DIM + STOPPED + RESET if color else STOPPED) + "\n")
        out.flush()
    return answer


# -- Ctrl-C while an answer streams --------------------------------------------------------------------------
class _StopRequests:
    """SIGINT while an answer streams: the first press only asks the answer to stop at its next chunk (no
    exception lands inside the library, so the cache stays consistent); a second press raises
    KeyboardInterrupt at once. Outside the main thread no handler can be installed: Ctrl-C then interrupts."""

    def __init__(self):
        self.count = 0
        self._old = None

    def _handler(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# -- the conversation ----------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Chat:
    """The conversation: one ``Llama``, the message history, and the commands."""

    def __init__(self, llm, args: argparse.Namespace, out: TextIO, err: TextIO, color: bool,
                 sampling: dict | None = None):
        """sampling: the keyword arguments of every turn's call (default: :func:`.options.llama_sampling_kwargs`
        of ``args``: the sampling options, ``max_tokens`` and ``stop``)."""
        from .options import llama_sampling_kwargs

        self.llm, self.args, self.out, self.err, self.color = llm, args, out, err, color
        self.history: list[dict] = []
        self.last = None  # GenerationStats of the last turn (None after /reset)
        self.evicted_before = 0  # evictions of caches cleared earlier (the session's count restarts at reset)
        self.sampling = llama_sampling_kwargs(args) if sampling is None else sampling

    def note(self, text: str) -> None:
        self.err.write(f"{text}\n")
        self.err.flush()

    def error(self, exc: BaseException) -> None:
        self.note(f"{PROG}: error: {first_line(exc)}")

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.args.system}] if self.args.system else []
        return system + self.history

    def clear_cache(self) -> None:
        self.evicted_before += self.llm.session.stats().n_evicted
        self.llm.reset()

    # -- one turn ------------------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        """One exchange. The history changes once, at the end: a turn that fails, or that is stopped before any
        answer text, leaves it as it was."""
        question = {"role": "user", "content": text}
        answer, failed = Answer(), False
        with _StopRequests() as stop:
            try:
                chunks = self.llm.chat_completion_steps(self.messages() + [question], **self.sampling)
                try:
                    render(chunks, self.out, show_reasoning=not self.args.hide_reasoning, color=self.color,
                           should_stop=lambda: stop.count > 0, answer=answer)
                finally:
                    chunks.close()  # runs the library's clean-up now (statistics of a stopped answer)
            except OutputError:  # the screen is gone (closed pipe, full disk): the chat ends (run_main)
                raise
            except EpikvError as e:
                failed = True
                self.error(e)
            except KeyboardInterrupt:  # a second Ctrl-C inside the call itself, before the first chunk
                answer.interrupted = True
                self.out.write(f"{STOPPED}\n")
                self.out.flush()
            hard = stop.count > 1
        if hard:  # the interrupt may have landed half-way through a cache update
            self.clear_cache()
            self.note("(interrupted inside the model: the cache was cleared; the next turn decodes the "
                      "conversation again)")
        if failed:
            return
        self.last = None if hard else answer.stats  # a hard stop's statistics describe a cleared cache
        if answer.interrupted and not answer.content:
            return  # nothing of an answer to keep: forget the question too
        self.history = self.history + [question, {"role": "assistant", "content": answer.content}]

    # -- commands ------------------------------------------------------------------------------------------
    def stats_lines(self) -> list[str]:
        s = self.llm.session.stats()
        n_turns = sum(1 for m in self.history if m["role"] == "user")
        system = " + system" if self.args.system else ""
        lines = [
            f"messages: {len(self.history)} ({n_turns} turn{'' if n_turns == 1 else 's'}){system}",
            f"live cells: {s.n_live} (budget {s.kv_budget})",
            f"max live cells: {s.max_live}",
            f"evicted: {s.n_evicted} (this conversation; {self.evicted_before + s.n_evicted} since start)",
            f"KV bytes: {s.kv_bytes} ({_mib(s.kv_bytes)})",
        ]
        st = self.last
        if st is None:
            lines.append("last turn: none")
        else:
            lines.append(f"last turn: {st.n_prompt_reused} prompt tokens reused, {st.n_prompt_decoded} decoded; "
                         f"{st.n_generated_tokens} generated ({st.decode_tokens_per_s:.1f} tok/s)")
        return lines

    def command(self, text: str) -> bool:
        """Run a /command; False when the chat should end."""
        name = text.split()[0].lower()
        if name in ("/exit", "/quit"):
            return False
        if name == "/stats":
            self.out.write("".join(f"{ln}\n" for ln in self.stats_lines()))
        elif name == "/reset":
            self.clear_cache()
            self.history.clear()
            self.last = None
            self.out.write("(conversation cleared)\n")
        elif name == "/help":
            self.out.write(HELP + "\n")
        else:
            self.note(f"unknown command {name}: /help lists the commands (a message starting with / is typed //...)")
        self.out.flush()
        return True


def read_message(prompt: str = PROMPT) -> str:
    """One message from the prompt (``input()``, with readline's editing when available); a line ending in a
    backslash continues on the next. Raises EOFError (Ctrl-D) and KeyboardInterrupt (Ctrl-C)."""
    lines = []
    while True:
        line = input(prompt if not lines else CONTINUATION_PROMPT)
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def check_input(text: str) -> None:
    """ConfigError unless ``text`` is valid Unicode text: undecodable input bytes (read with surrogateescape)
    and lone surrogates cannot be tokenized, and the message is refused before it reaches the model."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("input is not UTF-8 (the message was not sent)") from None


def _tolerant_stdin() -> None:
    """Read undecodable bytes from stdin as lone surrogates (``surrogateescape``) instead of failing inside
    ``input()``: :func:`check_input` then refuses the one message, and the conversation goes on."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (ValueError, OSError):  # a closed or non-text stdin: input() reports it
            pass


def _check_args(args: argparse.Namespace) -> dict:
    """Every option checked before the model loads; returns the sampling keywords of every turn."""
    from .options import llama_sampling_kwargs

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if any(not s for s in args.stop):
        raise ConfigError("--stop takes a non-empty string")
    return llama_sampling_kwargs(args)  # bad values fail now, not every turn


def _check_grammar(llm, args: argparse.Namespace) -> None:
    """A grammar that does not parse (or lacks its root rule) is refused at start-up, on this model's vocabulary,
    rather than at every turn."""
    from .options import check_grammar, sampling_config

    check_grammar(llm.session.model, sampling_config(args))


def run(args: argparse.Namespace) -> int:
    """The chat loop; returns the exit status (0 on /exit, /quit or end of input)."""
    from ..engine.handles import check_gguf
    from .llama import Llama
    from .options import llama_kwargs

    sampling = _check_args(args)
    model_path = check_gguf(args.model)
    try:
        import readline  # noqa: F401  (input() gets line editing and history)
    except ImportError:
        pass
    _tolerant_stdin()
    out, err = sys.stdout, sys.stderr
    llm = Llama(**{**llama_kwargs(args), "model_path": str(model_path)}, seed=args.seed)
    with llm:
        _check_grammar(llm, args)
        chat = Chat(llm, args, out, err, use_color(out), sampling)
        calib = f", calibration {llm.calibration.path}" if llm.calibration is not None else ""
        chat.note(f"{PROG} chat: {model_path.name}, KV budget {args.kv_budget} cells, policy {args.policy}{calib}")
        chat.note("/help lists the commands; Ctrl-C stops an answer; Ctrl-D or /exit quits.")
        while True:
            try:
                try:
                    text = read_message().strip()
                except EOFError:
                    out.write("\n")
                    out.flush()
                    return 0
                except UnicodeDecodeError:  # a stdin that could not be made tolerant (_tolerant_stdin)
                    chat.error(ConfigError("input is not UTF-8 (the message was not sent)"))
                    continue
                if not text:
                    continue
                try:
                    check_input(text)
                except ConfigError as e:
                    chat.error(e)
                    continue
                if text.startswith("/") and not text.startswith("//"):
                    if not chat.command(text):
                        return 0
                    continue
                chat.turn(text[1:] if text.startswith("//") else text)
            except KeyboardInterrupt:  # at the prompt (or between two steps): a fresh prompt
                out.write("\n")
                out.flush()
                chat.note("(Ctrl-D or /exit quits)")
