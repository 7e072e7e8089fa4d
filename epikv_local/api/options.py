"""The command-line options that ``generate``, ``serve`` and ``chat`` share (llama.cpp's names), in one place,
and their translation into the keyword arguments of ``resolve_session`` / ``epikv_local.Llama``.

Importing this module loads nothing native (the CLI builds its parser from it).
"""

from __future__ import annotations

import argparse

from ..engine.budget import DEFAULT_KV_BUDGET
from ..errors import ConfigError
from ..policies import DEFAULT_POLICY, REGISTRY


def layers_arg(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes one or two comma-separated integers, got {text!r}")
    if not 1 <= len(vals) <= 2:
        raise argparse.ArgumentTypeError(f"--layers takes one or two layers, got {len(vals)}")
    return vals


def add_model_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """-m (unless ``model`` is False: the default model), -ngl, --rpc, -ctk/-ctv, --no-flash-attn, -t, -b,
    --verbose."""
    from ..engine.handles import KV_TYPES

    if model:
        p.add_argument("-m", "--model", required=True, help="path to a GGUF model file")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1, metavar="N",
                   help="layers offloaded to the GPU on a GPU build (-1: all; CPU builds ignore it)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="offload layers to llama.cpp rpc-server processes (trusted network only; docs/rpc.md)")
    p.add_argument("-ctk", "--cache-type-k", choices=list(KV_TYPES), default="f16", metavar="TYPE",
                   help=f"KV cache type of K: {', '.join(KV_TYPES)}")
    p.add_argument("-ctv", "--cache-type-v", choices=list(KV_TYPES), default="f16", metavar="TYPE",
                   help="KV cache type of V (the same types)")
    p.add_argument("--no-flash-attn", action="store_true", help="run with flash attention off")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="llama.cpp threads (default: CPUs available - 1, at most 8)")
    p.add_argument("-b", "--batch", type=int, default=64, metavar="N", help="tokens per decode call (ubatch)")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")


def add_budget_args(p: argparse.ArgumentParser, kv_budget: int = DEFAULT_KV_BUDGET) -> None:
    """--kv-budget, --policy, the budget's protection, the policy settings --layers / --window, and the
    reasoning budget --reasoning-budget."""
    attn = sorted(n for n, s in REGISTRY.items() if s.cls.needs_attention)
    p.add_argument("--kv-budget", type=int, default=kv_budget, metavar="N", help="maximum live KV cells")
    p.add_argument("--policy", "--kv-policy", dest="policy", choices=sorted(REGISTRY), default=DEFAULT_POLICY,
                   metavar="POLICY",
                   help=f"eviction policy: {', '.join(sorted(REGISTRY))} (the attention-based ones need "
                        f"--no-flash-attn: {', '.join(attn)})")
    p.add_argument("--n-sink", type=int, default=4, metavar="N", help="first tokens never evicted")
    p.add_argument("--n-recent", type=int, default=None, metavar="N",
                   help="recent tokens kept (default: the recent share of the budget: 0.5, the policy's own "
                        "(said_facts: 0.25) or the calibration's)")
    p.add_argument("--evict-chunk", type=int, default=16, metavar="N", help="minimum positions evicted per round")
    p.add_argument("--no-protect-prompt", action="store_true", help="allow evicting the first prompt's tokens")
    p.add_argument("--layers", type=layers_arg, default=None, metavar="A[,B]",
                   help="policy setting 'layers': EPIKV layers A[,B] of this model (default: 10,21 of 32 mapped "
                        "by relative depth, or the model's calibration)")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help="policy setting 'window': rolling z-score window in tokens (default: 128, or the "
                        "model's calibration)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="reasoning tokens (<think>...</think>) allowed per answer (-1: unlimited, 0: none)")


#: the sampling options' defaults (SamplingConfig's field names): the parser's and those of a Namespace that lacks
#: an option (a script's own Namespace, a command without it)
SAMPLING_DEFAULTS = {
    "temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "penalty_last_n": 64, "mirostat_mode": 0,
    "mirostat_eta": 0.1, "mirostat_tau": 5.0, "seed": 0,
}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags (reasoning-model defaults for --temp / --top-p): --temp, --top-p, --top-k,
    --min-p, --typical, the penalties, mirostat, the grammar (--grammar, --grammar-file, --json-schema), -s,
    --stop. :func:`sampling_config` / :func:`llama_sampling_kwargs` translate them."""
    d = SAMPLING_DEFAULTS
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=d["temperature"], metavar="T",
                   help="sampling temperature (<= 0: greedy); 0.6 as reasoning model cards recommend")
    p.add_argument("--top-p", type=float, default=d["top_p"], metavar="P",
                   help="top-p (nucleus) sampling: keep the most likely tokens whose probabilities add up to P "
                        "(1: off); 0.95 as reasoning model cards recommend")
    p.add_argument("--top-k", type=int, default=d["top_k"], metavar="K",
                   help="top-k sampling: keep the K most likely tokens (0: off)")
    p.add_argument("--min-p", type=float, default=d["min_p"], metavar="P",
                   help="min-p sampling: drop tokens less likely than P times the most likely one (0: off)")
    p.add_argument("--typical", dest="typical_p", type=float, default=d["typical_p"], metavar="P",
                   help="locally typical sampling, parameter p (1: off)")
    p.add_argument("--repeat-penalty", type=float, default=d["repeat_penalty"], metavar="X",
                   help="penalize repeating any of the last --repeat-last-n tokens (1: off)")
    p.add_argument("--presence-penalty", type=float, default=d["presence_penalty"], metavar="X",
                   help="presence penalty of the last --repeat-last-n tokens (0: off)")
    p.add_argument("--frequency-penalty", type=float, default=d["frequency_penalty"], metavar="X",
                   help="frequency penalty of the last --repeat-last-n tokens (0: off)")
    p.add_argument("--repeat-last-n", dest="penalty_last_n", type=int, default=d["penalty_last_n"], metavar="N",
                   help="tokens the penalties look back on, the prompt's tail included (0: off, -1: all)")
    p.add_argument("--mirostat", dest="mirostat_mode", type=int, choices=(0, 1, 2), default=d["mirostat_mode"],
                   help="mirostat sampling instead of top-k/typical/top-p/min-p (0: off, 1: mirostat, "
                        "2: mirostat 2.0; with --temp > 0)")
    p.add_argument("--mirostat-lr", dest="mirostat_eta", type=float, default=d["mirostat_eta"], metavar="ETA",
                   help="mirostat learning rate, parameter eta")
    p.add_argument("--mirostat-ent", dest="mirostat_tau", type=float, default=d["mirostat_tau"], metavar="TAU",
                   help="mirostat target entropy, parameter tau")
    p.add_argument("--grammar", default=None, metavar="GBNF",
                   help="constrain the output with a GBNF grammar (start rule 'root'), e.g. 'root ::= \"yes\" | "
                        "\"no\"'")
    p.add_argument("--grammar-file", default=None, metavar="PATH", help="read the GBNF grammar from a file")
    p.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to JSON following this JSON schema (e.g. '{}' for any JSON object)")
    p.add_argument("-s", "--seed", type=int, default=d["seed"], metavar="N",
                   help="sampler seed, 0..4294967295 (4294967295: a random seed)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def _value(args: argparse.Namespace, name: str):
    return getattr(args, name, SAMPLING_DEFAULTS.get(name))


def grammar_text(args: argparse.Namespace) -> str | None:
    """The GBNF grammar of --grammar, --grammar-file or --json-schema (at most one of them), or None."""
    given = {flag: getattr(args, dest, None) for flag, dest in (("--grammar", "grammar"),
                                                                ("--grammar-file", "grammar_file"),
                                                                ("--json-schema", "json_schema"))}
    given = {flag: v for flag, v in given.items() if v is not None}
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} are exclusive: give one grammar")
    if not given:
        return None
    flag, value = next(iter(given.items()))
    if flag == "--grammar":
        text = value
    elif flag == "--grammar-file":
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise ConfigError(f"--grammar-file {value}: not UTF-8 text") from None
        except OSError as e:
            raise ConfigError(f"cannot read the grammar file {value}: {e.strerror or e}") from None
    else:
        text = json_schema_grammar(value)
    if not text.strip():
        raise ConfigError(f"{flag} is empty: a GBNF grammar needs a 'root' rule")
    return text


def json_schema_grammar(schema: str) -> str:
    """GBNF text for a JSON schema (llama-cpp-python's converter, as ``llama_cpp.LlamaGrammar.from_json_schema``)."""
    import json

    try:
        json.loads(schema)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--json-schema is not JSON: {e}") from None
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(schema)
    except Exception as e:  # the converter raises plain exceptions (ValueError, KeyError, ...) for what it lacks
        raise ConfigError(f"--json-schema cannot be converted to a grammar: {type(e).__name__}: {e}") from None


def _sampling_values(args: argparse.Namespace) -> dict:
    """The options above as SamplingConfig's fields: the one translation behind :func:`sampling_config` and
    :func:`llama_sampling_kwargs`. A temperature <= 0 is greedy (llama.cpp's meaning on its command line;
    SamplingConfig reads < 0 as a plain seeded draw, llama-cpp-python's)."""
    vals = {name: _value(args, name) for name in SAMPLING_DEFAULTS}
    if vals["temperature"] is not None and vals["temperature"] <= 0:
        vals["temperature"] = 0.0
        if vals["mirostat_mode"]:
            raise ConfigError("--mirostat needs --temp > 0 (a temperature <= 0 is greedy)")
    vals["grammar"] = grammar_text(args)
    return vals


def sampling_config(args: argparse.Namespace):
    """The :class:`~epikv_local.engine.sampling.SamplingConfig` of the options (ConfigError for a bad value). The
    penalties see the prompt's tail too, as in llama.cpp's tools (``penalize_prompt``)."""
    from ..engine.sampling import SamplingConfig

    return SamplingConfig(**_sampling_values(args), penalize_prompt=True)


def check_grammar(model, cfg) -> None:
    """ConfigError (one line, llama.cpp's reason) unless the grammar of ``cfg`` (a SamplingConfig) parses on
    ``model``'s vocabulary; nothing to check without one. llama.cpp prints a parse error straight to the process's
    stderr (not through its log): that text is caught here and becomes the message, so that a bad --grammar is
    one line."""
    if cfg.grammar is None:
        return
    import os
    import re
    import sys
    import tempfile

    from ..engine.sampling import Sampler
    from ..errors import first_line

    sys.stderr.flush()
    with tempfile.TemporaryFile() as said:
        saved = os.dup(2)
        os.dup2(said.fileno(), 2)
        try:
            try:
                Sampler(model, cfg).close()
                return
            except ConfigError as e:
                error = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        said.seek(0)
        text = said.read().decode("utf-8", "replace")
    m = re.search(r"error parsing grammar: *(.+)", text)
    raise ConfigError(f"the grammar does not parse: {m.group(1).strip()}" if m else first_line(error)) from None


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument called ``name`` (named in its signature: not through **kwargs)."""
    import inspect

    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def _unsupported(flag: str, where: str) -> ConfigError:
    return ConfigError(f"{flag} is not supported by {where} in this version of epikv-local")


def llama_sampling_kwargs(args: argparse.Namespace, call=None) -> dict:
    """``epikv_local.Llama.create_chat_completion`` sampling keywords of the options (llama-cpp-python's names;
    the grammar as a ``llama_cpp.LlamaGrammar``), checked like SamplingConfig checks them, plus ``max_tokens``
    and ``stop`` when the Namespace has them. ``call``: the method the keywords are for (default: that one);
    an option it has no keyword for is refused when set to anything but its default."""
    from .llama import Llama

    if call is None:
        call = Llama.create_chat_completion
    vals = _sampling_values(args)
    sampling_config(args)  # every value checked once, here, with SamplingConfig's messages
    grammar = vals.pop("grammar")
    vals.pop("seed")  # the Llama's (constructor) seed: llama_kwargs
    kw = {k: v for k, v in vals.items() if k != "penalty_last_n"}
    if accepts(call, "penalty_last_n"):
        kw["penalty_last_n"] = vals["penalty_last_n"]
    elif not accepts(Llama.__init__, "last_n_tokens_size") and \
            vals["penalty_last_n"] != SAMPLING_DEFAULTS["penalty_last_n"]:  # else the constructor's: llama_kwargs
        raise _unsupported("--repeat-last-n", "chat")
    if grammar is not None:
        from llama_cpp.llama_grammar import LlamaGrammar

        kw["grammar"] = LlamaGrammar.from_string(grammar, verbose=False)
    if hasattr(args, "max_tokens"):
        kw["max_tokens"] = args.max_tokens
    if hasattr(args, "stop"):
        kw["stop"] = list(args.stop) or None
    return kw


def reasoning_kwargs(args: argparse.Namespace, target, where: str) -> dict:
    """``{"reasoning_budget": N}`` for ``target`` (a function or class) when it takes that keyword; {} when it
    does not and --reasoning-budget is unlimited (-1); ConfigError when it does not and a budget is set."""
    n = getattr(args, "reasoning_budget", -1)
    if isinstance(n, bool) or not isinstance(n, int) or n < -1:
        raise ConfigError(f"--reasoning-budget must be -1 (unlimited) or a number of tokens >= 0, got {n!r}")
    fn = target.__init__ if isinstance(target, type) else target
    if accepts(fn, "reasoning_budget"):
        return {"reasoning_budget": n}
    if n != -1:
        raise _unsupported("--reasoning-budget", where)
    return {}


def session_kwargs(args: argparse.Namespace) -> dict:
    """``resolve_session`` keyword arguments (the names of ``Llama``'s constructor) from the options above."""
    return dict(kv_budget=args.kv_budget, kv_policy=args.policy,
                kv_policy_settings={"layers": args.layers, "window": args.window}, n_sink=args.n_sink,
                n_recent=args.n_recent, protect_prompt=not args.no_protect_prompt, evict_chunk=args.evict_chunk,
                n_batch=args.batch, n_threads=args.threads, flash_attn=not args.no_flash_attn,
                type_k=args.cache_type_k, type_v=args.cache_type_v,
                capture_route=getattr(args, "capture", "layer_out"))


def llama_kwargs(args: argparse.Namespace) -> dict:
    """``epikv_local.Llama`` keyword arguments from the options above: the model's, the session's, the reasoning
    budget and (a command with the sampling options) --repeat-last-n as llama-cpp-python's ``last_n_tokens_size``,
    each passed when this Llama takes it."""
    from .llama import Llama

    kw = dict(model_path=args.model, n_gpu_layers=args.n_gpu_layers, rpc_servers=args.rpc, verbose=args.verbose,
              **session_kwargs(args), **reasoning_kwargs(args, Llama, "chat and serve"))
    if hasattr(args, "penalty_last_n") and accepts(Llama.__init__, "last_n_tokens_size"):
        kw["last_n_tokens_size"] = args.penalty_last_n
    return kw
