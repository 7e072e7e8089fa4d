"""The package's exceptions: every expected failure is an :class:`EpikvError`.

Front doors (the CLI, the server, the terminal chat, the scripts) catch ``EpikvError`` only and show its first line;
anything else is a bug and keeps its traceback. The subclasses also derive from the matching built-in
(``ValueError`` for bad input, ``RuntimeError`` for native failures) so that ``except ValueError`` code
written against llama-cpp-python keeps working. This module imports nothing of the package.
"""

from __future__ import annotations

import threading


class EpikvError(Exception):
    """Base class of every expected epikv-local failure (one-line message naming the problem)."""


class ConfigError(EpikvError, ValueError):
    """A setting is out of range or inconsistent (budget, sampling, policy option, layer index, ...)."""


class BudgetError(ConfigError):
    """The KV budget cannot hold what must be protected (sinks, recent window, prompt)."""


class ModelError(EpikvError, ValueError):
    """The model file or its architecture cannot be used."""


class DataError(EpikvError, ValueError):
    """An input data file (traces, labels, calibration) is missing or malformed."""


class NativeError(EpikvError, RuntimeError):
    """A native call failed; the message names the call and includes llama.cpp's last error lines."""


class KVFullError(NativeError):
    """llama_decode found no KV slot for the batch (return code 1) even after the kv-full hook ran."""


class CancelledError(EpikvError, RuntimeError):
    """The generation was cancelled (``Session.cancel``/``Llama.cancel``, a closing session, a server whose
    client left or that is shutting down) between two of its decode steps."""


class FlashAttnError(NativeError):
    """Flash attention was requested but the decode graph did not run it."""


class DefaultModelError(EpikvError, RuntimeError):
    """The default model could not be fetched or verified."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: set by a Ctrl-C seen by :func:`interrupt_handler` (or a deferred one): a KeyboardInterrupt that Python had to
#: drop (inside a ctypes callback or a __del__) still stops the generation loop at its next token
INTERRUPTED = threading.Event()


def interrupt_handler(signum, frame):
    """SIGINT handler of the commands: Python's behaviour (KeyboardInterrupt), remembered in INTERRUPTED."""
    INTERRUPTED.set()
    raise KeyboardInterrupt


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; ConfigError naming ``what`` for text that is not valid Unicode (a lone surrogate, which
    UTF-8 cannot encode, so llama.cpp could not tokenize or parse it)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid Unicode (a lone surrogate at character {e.start})") from None


class OutputError(EpikvError, OSError):
    """Writing the command's own output (standard output or error) failed: ``target`` names the stream. Raised by
    the streams :func:`run_main` guards, so that it is told apart from every other OSError (which stays a bug).
    It ends the command (one line, or none for a closed pipe): a front door that goes on after an EpikvError
    (the terminal chat's turn) lets this one through."""

    def __init__(self, errno_: int | None, strerror: str | None, target: str):
        super().__init__(errno_, strerror)
        self.target = target


class OutputClosed(OutputError, BrokenPipeError):
    """The reader of the command's output went away (``... | head``): the command ends quietly."""


#: exit status of a command whose output pipe was closed: 128 + SIGPIPE, as a shell reports a Unix tool killed by it
EXIT_PIPE_CLOSED = 141


class _GuardedStream:
    """A text stream (``sys.stdout``/``sys.stderr``) whose write errors become :class:`OutputError` (a closed pipe
    :class:`OutputClosed`); everything else is the stream's own (``fileno``, ``isatty``, ``encoding``: ``input()``
    keeps its line editing)."""

    def __init__(self, stream, target: str):
        self._stream, self._target = stream, target

    def _call(self, name: str, *args):
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError as e:
            raise OutputClosed(e.errno, e.strerror, self._target) from None
        except OutputError:
            raise
        except OSError as e:
            raise OutputError(e.errno, e.strerror, self._target) from None

    def write(self, text):
        return self._call("write", text)

    def writelines(self, lines):
        return self._call("writelines", lines)

    def flush(self):
        return self._call("flush")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _silence(stream) -> None:
    """Point a broken stream's file descriptor at /dev/null, so that what is still buffered in it is dropped at
    interpreter exit instead of raising again there ("Exception ignored ... BrokenPipeError")."""
    import os

    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (AttributeError, OSError, ValueError):
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def _real(sys, name: str):
    """``sys.stdout`` / ``sys.stderr`` without the guard (an outer run_main's guard too)."""
    stream = getattr(sys, name)
    return stream._stream if isinstance(stream, _GuardedStream) else stream


def _say(stream, text: str) -> None:
    """A last line on ``stream`` (standard error), when it can still be written."""
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        pass


def run_main(prog: str, main, argv=None) -> int:
    """Run ``main(argv) -> int`` as a command: an EpikvError becomes one ``<prog>: error: ...`` line on stderr
    and exit status 2, Ctrl-C exit status 130 without a traceback; output that cannot be written (standard
    output on a full disk, ``> /dev/full``) one ``<prog>: error: cannot write standard output: <reason>`` line
    and exit status 2; a closed output pipe (``... | head``) ends quietly with exit status 141 (128 + SIGPIPE,
    as Unix tools); every other exception propagates. The output is flushed before returning, so that an error
    writing its last part is reported here too, not at interpreter exit."""
    import signal
    import sys

    INTERRUPTED.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt_handler)
    saved = {}
    for name, target in (("stdout", "standard output"), ("stderr", "standard error")):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _GuardedStream):
            saved[name] = stream
            setattr(sys, name, _GuardedStream(stream, target))
    try:
        try:
            status = main(argv)
            for name in ("stdout", "stderr"):
                stream = getattr(sys, name)
                if stream is not None:
                    stream.flush()
            return status
        except OutputError:  # an EpikvError too: handled below, with its own line (or none)
            raise
        except EpikvError as e:
            print(f"{prog}: error: {first_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
    except OutputClosed as e:  # raised by the run or by the lines above
        _silence(_real(sys, "stdout" if e.target == "standard output" else "stderr"))
        return EXIT_PIPE_CLOSED
    except OutputError as e:
        _silence(_real(sys, "stdout" if e.target == "standard output" else "stderr"))
        if e.target != "standard error":
            _say(_real(sys, "stderr"), f"{prog}: error: cannot write {e.target}: {e.strerror or e}")
        return 2
    finally:
        for name, stream in saved.items():
            if isinstance(getattr(sys, name), _GuardedStream):
                setattr(sys, name, stream)
