"""The product's commands: ``generate``, ``demo``, ``fetch-model``, ``serve`` (:mod:`.server`), ``chat``
(:mod:`.terminal`) and ``rpc-server``.

:func:`add_commands` adds them to the ``epikv-local`` parser (composed in :mod:`epikv_local.cli`). Policy
settings given on the command line (``--layers``, ``--window``) are handed to the policy registry by name:
a policy that lacks a setting refuses it with one clear line, so this module never branches on policy names.
"""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_budget_args, add_model_args, add_sampling_args

DEMO_PROMPT = (
    "Solve step by step, checking each step: a train travels 60 km in the first hour and 45 km in the second "
    "hour. Then it stops for 30 minutes and travels 90 km in 1.5 hours. What is its average speed over the "
    "whole trip, including the stop? Explain your reasoning in detail before giving the final answer."
)


def _add_run_args(p: argparse.ArgumentParser, demo: bool) -> None:
    add_model_args(p, model=not demo)
    if not demo:
        p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", default=demo, help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("-n", "--max-tokens", type=int, default=600 if demo else None, metavar="N",
                   help="stop after this many tokens (unset: no limit; the KV budget bounds memory, not length)")
    add_budget_args(p, **({"kv_budget": 256} if demo else {}))  # demo: a budget its 600 tokens overrun
    add_sampling_args(p)
    p.add_argument("--capture", choices=["layer_out", "callback"], default="layer_out", help="capture route of g")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the text and the statistics instead of streaming")
    p.add_argument("--html", metavar="PATH", default=None,
                   help="also write a self-contained HTML token view of the run: every token coloured by its "
                        "policy score, evicted ones struck through (docs/token_view.md)")
    p.add_argument("--html-compare", metavar="POLICY", default=None,
                   help="with --html: run the same prompt and settings under POLICY too (its own defaults or "
                        "calibration) and show both runs side by side")


#: commands whose arguments all go, untouched, to another program: {command: the Namespace attribute holding them}.
#: The command line hands over everything after the command's name (options starting with "-" included, which
#: argparse would otherwise claim); see epikv_local.cli
PASSTHROUGH = {"rpc-server": "rpc_args"}


def add_commands(sub) -> dict:
    """Add the product's subcommands to ``sub``; returns {command name: runner(args) -> exit status}. The help
    format (every default shown once) is the composition root's, set on every subparser there."""
    _add_run_args(sub.add_parser("generate", help="generate text under a KV budget"), demo=False)
    _add_run_args(sub.add_parser("demo", help="reasoning prompt on the default model (SmolLM2-135M)"), demo=True)
    sub.add_parser("fetch-model", help="download and cache the default model; print its path")
    from . import server, terminal  # their heavy dependencies are imported by run(), not here

    server.add_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server with a KV budget"))
    terminal.add_args(sub.add_parser("chat", help="interactive terminal chat on one budgeted cache"))
    rp = sub.add_parser("rpc-server", add_help=False,
                        help="llama.cpp's rpc-server (built with this package): offer this machine's backend to "
                             "another machine's epikv-local --rpc; trusted networks only",
                        description="llama.cpp's rpc-server, built with this package. Every argument goes to it "
                                    "untouched ('epikv-local rpc-server --help' prints its own help). The RPC "
                                    "protocol is unauthenticated: trusted networks only (docs/rpc.md).")
    rp.add_argument("rpc_args", nargs=argparse.REMAINDER, metavar="OPTIONS",
                    help="its options: -H HOST (default: 127.0.0.1), -p PORT (default: 50052), -t THREADS, "
                         "-d DEVICES, -c (local file cache)")
    return {"generate": run_generate, "demo": run_generate, "fetch-model": run_fetch_model, "serve": server.run,
            "chat": terminal.run, "rpc-server": run_rpc_server}


def rpc_server_path():
    """The rpc-server binary installed with the package; NativeError when this build has none."""
    from pathlib import Path

    from ..engine.native import default_lib_dir
    from ..errors import NativeError

    exe = Path(default_lib_dir()).parent / "bin" / "epikv-rpc-server"
    if not exe.is_file():
        raise NativeError("this build has no rpc-server: rebuild with CMAKE_ARGS=\"-DGGML_RPC=ON\" (rm -rf build "
                          "first)")
    return exe


def run_rpc_server(args) -> int:
    """Replace this process by the rpc-server binary with the arguments as given (it never returns)."""
    import os

    exe = rpc_server_path()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(exe), [str(exe), *args.rpc_args])


def run_fetch_model(args) -> int:
    from .models import default_model_path

    print(default_model_path())
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from ..engine.handles import Model, check_gguf
    from ..engine.native import load
    from ..errors import ConfigError
    from .chat import chat_prompt, tokenize_prompt
    from .generation import generate
    from .models import default_model_path
    from .options import check_grammar, reasoning_kwargs, sampling_config, session_kwargs
    from .session_spec import resolve_session

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if any(not s for s in args.stop):
        raise ConfigError("--stop takes a non-empty string")
    model_path = default_model_path() if args.cmd == "demo" else check_gguf(args.model)
    prompt = DEMO_PROMPT if args.cmd == "demo" else args.prompt
    spec = resolve_session(model_path, **session_kwargs(args))
    sampling = sampling_config(args)
    reasoning = reasoning_kwargs(args, generate, args.cmd)
    if args.html_compare and reasoning.get("reasoning_budget", -1) != -1:
        raise ConfigError("--html-compare runs without a reasoning budget: drop --reasoning-budget or the comparison")
    if args.system and not args.chat:
        raise ConfigError("--system needs --chat (the system message goes into the chat template)")
    if args.html_compare and not args.html:
        raise ConfigError("--html-compare needs --html PATH (the page the two runs are shown on)")
    view = None
    if args.html:  # checks the output path and the comparison policy before anything runs
        from .tokenview import PageBuilder, page_meta

        view = PageBuilder(args.html, args.html_compare, model_path, session_kwargs(args))
    nat = load(verbose=args.verbose)
    with Model(model_path, n_gpu_layers=args.n_gpu_layers, native=nat, rpc_servers=args.rpc) as model:
        check_grammar(model, sampling)
        # with --chat, which tokens the chat template wrote (said_words ranks them last)
        if args.chat:
            tokens, template = chat_prompt(model, prompt, args.system)
        else:
            tokens, template = tokenize_prompt(model, prompt), None
        stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        with spec.open(model, record=view is not None) as session:
            session.check_prompt(len(tokens))
            if spec.calibration is not None:  # said once the settings are known to work: errors stay one line
                print(f"epikv-local: using calibration {spec.calibration.path}", file=sys.stderr)
            result = generate(session, tokens, args.max_tokens, sampling, tuple(args.stop), on_text=stream,
                              ignore_eog=args.ignore_eos, template=template, **reasoning)
            if view is not None:
                view.add(session, tokens, result, spec.calibration.path if spec.calibration else None)
        if view is not None:
            view.run_compare(model, tokens, sampling, args.max_tokens, tuple(args.stop), args.ignore_eos,
                             template=template)
    if view is not None:
        view.write(prompt, page_meta(model_path, sampling, args.chat))
    stats = result.stats.as_dict()
    compared = [] if view is None else [r.stats.as_dict() for r in view.runs[1:]]
    if args.json:
        stats["text"] = result.text
        stats["model"] = str(model_path)
        if view is not None:
            stats["html"] = str(view.out)
            if compared:
                stats["compare"] = {**compared[0], "text": view.runs[1].text}
        print(json.dumps(stats))
    else:  # the text went to stdout as it was generated; the statistics go to stderr
        sys.stdout.write("\n")
        sys.stdout.flush()
        keys = ["policy", "kv_budget", "n_prompt_tokens", "n_generated_tokens", "n_evicted", "max_live_cells",
                "decode_tokens_per_s", "prefill_tokens_per_s", "kv_bytes", "flash_attn", "capture_route", "layers",
                "stop_reason"]
        for st in [stats] + compared:
            print("  ".join(f"{k}={st[k]}" for k in keys), file=sys.stderr)
        if view is not None:
            print(f"epikv-local: token view written to {view.out}", file=sys.stderr)
    return 0
