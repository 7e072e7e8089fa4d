"""``epikv-local``: the one command line, composed of the product's commands (:mod:`epikv_local.api.cli`:
generate, demo, fetch-model, serve, chat, rpc-server) and the evaluation harness's
(:mod:`epikv_local.eval.commands`: labels, calibrate). This module is the composition root: the only one that
sees both sides, and the one that sets the help format of every command (:class:`HelpFormatter`).

Every expected failure (an :class:`~epikv_local.errors.EpikvError`: bad path, non-GGUF file, unsupported
architecture, a setting out of range, a budget too small for the protected tokens, ...) prints one line
``epikv-local: error: ...`` and exits 2; Ctrl-C exits 130; output that cannot be written is one line and exit 2,
a closed pipe (``... | head``) ends quietly with exit 141; anything else is a bug and keeps its traceback
(:func:`~epikv_local.errors.run_main`).
"""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import run_main

PROG = "epikv-local"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default, shown once: ``(default: X)`` is added unless the help text already speaks of its
    default, and never for options without one (None, flags that are off, empty lists)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default is argparse.SUPPRESS or default is None or default is False \
                or default == []:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser and {command: runner}."""
    from .api.cli import add_commands as product_commands
    from .eval.commands import add_commands as eval_commands

    ap = argparse.ArgumentParser(prog=PROG, description="EPIKV KV-cache eviction on llama.cpp",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    runners = {**product_commands(sub), **eval_commands(sub)}
    for p in sub.choices.values():
        p.formatter_class = HelpFormatter
    return ap, runners


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(what argparse parses, the arguments of a pass-through command or None). The command is the first
    argument that is not an option (the top level has only --help and --version, which take no value); when it
    is a pass-through command (``rpc-server``) everything after it is its program's, untouched."""
    from .api.cli import PASSTHROUGH

    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            if arg in PASSTHROUGH:
                return argv[:i + 1], argv[i + 1:]
            break
    return argv, None


def _main(argv) -> int:
    from .api.cli import PASSTHROUGH

    argv = list(sys.argv[1:] if argv is None else argv)
    ap, runners = build_parser()
    head, rest = split_passthrough(argv)
    args = ap.parse_args(head)
    if rest is not None:
        setattr(args, PASSTHROUGH[args.cmd], rest)
    return runners[args.cmd](args)


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
