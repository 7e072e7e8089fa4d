"""``epikv-local``: the one command line, composed of the product's commands (:mod:`epikv_local.api.cli`:
generate, demo, fetch-model, serve, chat, rpc-server) and the evaluation harness's
(:mod:`epikv_local.eval.commands`: labels, calibrate). This module is the composition root: the only one that
sees both sides.

Every expected failure (an :class:`~epikv_local.errors.EpikvError`: bad path, non-GGUF file, unsupported
architecture, a setting out of range, a budget too small for the protected tokens, ...) prints one line
``epikv-local: error: ...`` and exits 2; Ctrl-C exits 130; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import run_main

PROG = "epikv-local"


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser and {command: runner}."""
    from .api.cli import add_commands as product_commands
    from .eval.commands import add_commands as eval_commands

    ap = argparse.ArgumentParser(prog=PROG, description="EPIKV KV-cache eviction on llama.cpp")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    runners = {**product_commands(sub), **eval_commands(sub)}
    return ap, runners


def _main(argv) -> int:
    ap, runners = build_parser()
    args = ap.parse_args(argv)
    return runners[args.cmd](args)


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
