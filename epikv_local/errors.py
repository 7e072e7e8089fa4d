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


def run_main(prog: str, main, argv=None) -> int:
    """Run ``main(argv) -> int`` as a command: an EpikvError becomes one ``<prog>: error: ...`` line on stderr
    and exit status 2, Ctrl-C exit status 130 without a traceback; every other exception propagates."""
    import signal
    import sys

    INTERRUPTED.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt_handler)
    try:
        return main(argv)
    except EpikvError as e:
        print(f"{prog}: error: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
