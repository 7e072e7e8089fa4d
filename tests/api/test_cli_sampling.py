"""The sampling flags of ``generate`` / ``demo`` / ``chat`` (llama.cpp's names) and ``--reasoning-budget``: each
flag changes what is handed on (a parsed Namespace through the one translation, ``options.sampling_config`` and
``options.llama_sampling_kwargs``), bad values are one line with exit status 2, and on the default model the
penalties run, a grammar constrains the output and a JSON schema gives valid JSON. KV types (row 9 of the
hostile-inputs table): ``-ctk bf16 -ctv bf16`` runs."""

from __future__ import annotations

import inspect
import io
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from epikv_local.api import options as O
from epikv_local.api import terminal as T
from epikv_local.cli import build_parser
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "epikv_local.cli"]


def parse(cmd: str, *flags: str) -> Namespace:
    base = {"generate": ["generate", "-m", "m.gguf", "-p", "hi"], "chat": ["chat", "-m", "m.gguf"],
            "demo": ["demo"]}[cmd]
    return build_parser()[0].parse_args(base + list(flags))


def cli(*args, timeout=300):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def one_line(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("epikv-local: using calibration")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("epikv-local: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


# -- each flag changes what is passed on (no model) -------------------------------------------------------------------
#: (flags, SamplingConfig field / Llama keyword, value expected)
FLAGS = [
    (["--temp", "0.8"], "temperature", 0.8), (["--temperature", "1.2"], "temperature", 1.2),
    (["--temp", "0"], "temperature", 0.0), (["--temp", "-1"], "temperature", 0.0),  # <= 0: greedy, as llama.cpp
    (["--top-p", "0.5"], "top_p", 0.5), (["--top-k", "7"], "top_k", 7), (["--min-p", "0.1"], "min_p", 0.1),
    (["--typical", "0.7"], "typical_p", 0.7), (["--repeat-penalty", "1.1"], "repeat_penalty", 1.1),
    (["--presence-penalty", "0.4"], "presence_penalty", 0.4),
    (["--frequency-penalty", "0.3"], "frequency_penalty", 0.3), (["--repeat-last-n", "32"], "penalty_last_n", 32),
    (["--repeat-last-n", "-1"], "penalty_last_n", -1), (["--mirostat", "2"], "mirostat_mode", 2),
    (["--mirostat", "1"], "mirostat_mode", 1), (["--mirostat-lr", "0.3"], "mirostat_eta", 0.3),
    (["--mirostat-ent", "3.5"], "mirostat_tau", 3.5), (["-s", "42"], "seed", 42), (["--seed", "7"], "seed", 7),
]


@pytest.mark.parametrize("flags,field,value", FLAGS, ids=[" ".join(f) for f, _, _ in FLAGS])
def test_each_flag_reaches_the_sampling_config(flags, field, value):
    default = O.sampling_config(parse("generate"))
    cfg = O.sampling_config(parse("generate", *flags))
    assert getattr(cfg, field) == value
    assert cfg.penalize_prompt is True  # the CLI's generate penalizes the prompt's tail, as llama.cpp's tools
    changed = {f for f in SamplingConfig.__dataclass_fields__ if getattr(cfg, f) != getattr(default, f)}
    assert changed <= {field}, changed  # that flag, and nothing else


@pytest.mark.parametrize("flags,field,value", [f for f in FLAGS if f[1] not in ("seed", "penalty_last_n")],
                         ids=[" ".join(f) for f, k, _ in FLAGS if k not in ("seed", "penalty_last_n")])
def test_each_flag_reaches_the_chat_call(flags, field, value):
    from epikv_local.api.llama import Llama

    kw = O.llama_sampling_kwargs(parse("chat", *flags))
    assert kw[field] == value
    assert set(kw) <= set(inspect.signature(Llama.create_chat_completion).parameters)  # only keywords it takes


def test_the_chat_sends_the_translated_options_every_turn():
    """The terminal chat uses the same translation: no second copy of the option names."""
    class Recorder:
        def __init__(self):
            self.kw = []
            self.session = Namespace(stats=lambda: None)

        def chat_completion_steps(self, messages, **kw):
            self.kw.append(kw)
            return (c for c in [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}])

    args = parse("chat", "--repeat-penalty", "1.3", "--presence-penalty", "0.5", "--typical", "0.9", "--temp", "0",
                 "-n", "9", "--stop", "END")
    llm = Recorder()
    chat = T.Chat(llm, args, io.StringIO(), io.StringIO(), color=False)
    chat.turn("hi")
    chat.turn("again")
    assert len(llm.kw) == 2 and llm.kw[0] == llm.kw[1] == O.llama_sampling_kwargs(args)
    kw = llm.kw[0]
    assert (kw["repeat_penalty"], kw["presence_penalty"], kw["typical_p"], kw["temperature"]) == (1.3, 0.5, 0.9, 0.0)
    assert kw["max_tokens"] == 9 and kw["stop"] == ["END"]


def test_grammar_flags_give_the_grammar(tmp_path):
    g = 'root ::= "yes" | "no"'
    assert O.sampling_config(parse("generate", "--grammar", g)).grammar == g
    f = tmp_path / "yn.gbnf"
    f.write_text(g)
    assert O.sampling_config(parse("generate", "--grammar-file", str(f))).grammar == g
    schema = O.sampling_config(parse("generate", "--json-schema", '{"type": "object"}')).grammar
    assert "root" in schema and "::=" in schema
    assert O.sampling_config(parse("generate", "-j", "{}")).grammar
    assert O.sampling_config(parse("generate")).grammar is None
    kw = O.llama_sampling_kwargs(parse("chat", "--grammar", g))
    from llama_cpp import LlamaGrammar

    assert isinstance(kw["grammar"], LlamaGrammar) and kw["grammar"]._grammar == g
    assert "grammar" not in O.llama_sampling_kwargs(parse("chat"))


@pytest.mark.parametrize("flags,needle", [
    (["--grammar", "a", "--json-schema", "{}"], "exclusive"), (["--grammar", "  "], "empty"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "cannot read the grammar file"), (["--json-schema", "{bad"], "not JSON"),
    (["--typical", "0"], "typical_p"), (["--typical", "1.5"], "typical_p"), (["--repeat-last-n", "-2"], "penalty_last_n"),
    (["--presence-penalty", "nan"], "presence_penalty"), (["--frequency-penalty", "inf"], "frequency_penalty"),
    (["--mirostat-lr", "nan"], "mirostat_eta"), (["--mirostat-ent", "inf"], "mirostat_tau"),
    (["--mirostat", "2", "--temp", "0"], "--mirostat needs --temp > 0"),
])
def test_bad_sampling_values_are_config_errors(flags, needle):
    for cmd in ("generate", "chat"):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
            (O.sampling_config if cmd == "generate" else O.llama_sampling_kwargs)(parse(cmd, *flags))


def test_repeat_last_n_in_the_chat_is_passed_or_refused():
    """Per call when the call takes it, else as the constructor's ``last_n_tokens_size`` (llama-cpp-python's name),
    else refused when set."""
    from epikv_local.api.llama import Llama

    args = parse("chat", "--repeat-last-n", "16")
    if O.accepts(Llama.create_chat_completion, "penalty_last_n"):
        assert O.llama_sampling_kwargs(args)["penalty_last_n"] == 16
    elif O.accepts(Llama.__init__, "last_n_tokens_size"):
        assert "penalty_last_n" not in O.llama_sampling_kwargs(args)
        assert O.llama_kwargs(args)["last_n_tokens_size"] == 16
        assert O.llama_kwargs(parse("chat"))["last_n_tokens_size"] == 64
    else:
        with pytest.raises(ConfigError, match="--repeat-last-n"):
            O.llama_sampling_kwargs(args)
        assert "penalty_last_n" not in O.llama_sampling_kwargs(parse("chat"))  # the default is llama.cpp's 64
    serve = build_parser()[0].parse_args(["serve", "-m", "m.gguf"])
    assert "last_n_tokens_size" not in O.llama_kwargs(serve)  # serve has no sampling options: requests carry them


def test_reasoning_budget_is_passed_when_the_target_takes_it():
    def takes(prompt, reasoning_budget=-1):
        pass

    def lacks(prompt, **kwargs):
        pass

    class Takes:
        def __init__(self, *, reasoning_budget: int = -1):
            pass

    for cmd in ("generate", "chat", "demo"):
        assert parse(cmd).reasoning_budget == -1
        args = parse(cmd, "--reasoning-budget", "12")
        assert O.reasoning_kwargs(args, takes, cmd) == {"reasoning_budget": 12}
        assert O.reasoning_kwargs(args, Takes, cmd) == {"reasoning_budget": 12}
        with pytest.raises(ConfigError, match="--reasoning-budget is not supported"):
            O.reasoning_kwargs(args, lacks, cmd)
        assert O.reasoning_kwargs(parse(cmd), lacks, cmd) == {}  # unlimited: nothing to pass
        assert O.reasoning_kwargs(parse(cmd), takes, cmd) == {"reasoning_budget": -1}
        with pytest.raises(ConfigError, match="--reasoning-budget must be"):
            O.reasoning_kwargs(parse(cmd, "--reasoning-budget", "-2"), takes, cmd)
    serve = build_parser()[0].parse_args(["serve", "-m", "m.gguf", "--reasoning-budget", "0"])
    assert serve.reasoning_budget == 0


def test_llama_kwargs_pass_the_reasoning_budget_as_llama_takes_it():
    from epikv_local.api.llama import Llama

    args = parse("chat", "--reasoning-budget", "64")
    if O.accepts(Llama.__init__, "reasoning_budget"):
        assert O.llama_kwargs(args)["reasoning_budget"] == 64
    else:
        with pytest.raises(ConfigError, match="--reasoning-budget"):
            O.llama_kwargs(args)
        assert "reasoning_budget" not in O.llama_kwargs(parse("chat"))


# -- on the default model -------------------------------------------------------------------------------------------
def gen(model_path, *flags, n=5):
    return cli("generate", "-m", model_path, "-p", "Is the sky blue? Answer:", "-n", n, "-t", "1", *flags)


def test_repeat_penalty_runs(model_path):
    """It crashed before (the penalties sampler)."""
    r = gen(model_path, "--repeat-penalty", "1.1")
    assert r.returncode == 0, r.stderr
    assert "n_generated_tokens=" in r.stderr and "Traceback" not in r.stderr


def test_every_penalty_and_mirostat_run(model_path):
    for flags in (["--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--repeat-last-n", "-1",
                   "--repeat-penalty", "1.2", "--temp", "0"],
                  ["--temp", "0.8", "--typical", "0.9", "--top-k", "40", "--min-p", "0.05", "-s", "3"],
                  ["--temp", "0.8", "--mirostat", "2", "--mirostat-ent", "4", "--mirostat-lr", "0.2"],
                  ["--temp", "0.8", "--mirostat", "1"]):
        r = gen(model_path, *flags, "--json", "--ignore-eos")
        assert r.returncode == 0, (flags, r.stderr)
        assert json.loads(r.stdout)["n_generated_tokens"] == 5


def test_grammar_constrains_the_output(model_path):
    r = gen(model_path, "--grammar", 'root ::= "yes" | "no"', "--json", n=8)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] in ("yes", "no"), out["text"]


def test_json_schema_gives_valid_json(model_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = cli("generate", "-m", model_path, "-p", "A person, as JSON:", "-n", "80", "-t", "1", "--temp", "0",
            "--json-schema", json.dumps(schema), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stop_reason"] == "eog", out  # the grammar ended it: the object is complete
    doc = json.loads(out["text"])
    assert isinstance(doc["name"], str) and isinstance(doc["age"], int)


@pytest.mark.parametrize("flags,needle", [
    (["--grammar", "root ::= oops"], "the grammar does not parse: Undefined rule identifier 'oops'"),
    (["--grammar", 'start ::= "a"'], "root"), (["--grammar", 'root ::= "a'], "the grammar does not parse"),
    (["--json-schema", "[1"], "not JSON"), (["--typical", "0"], "typical_p"),
    (["--mirostat", "1", "--temp", "0"], "--mirostat needs"), (["--grammar-file", "/nonexistent"], "grammar file"),
])
def test_bad_values_on_the_command_line_are_one_line(model_path, flags, needle):
    one_line(gen(model_path, *flags), needle)


def test_bad_grammar_in_the_chat_is_one_line_at_start(model_path):
    r = subprocess.run(CLI + ["chat", "-m", str(model_path), "-t", "1", "--grammar", "root ::= nothing"],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=REPO, timeout=300)
    one_line(r, "the grammar does not parse")


def test_row9_bf16_kv_cache_runs_on_cpu(model_path):
    """Row 9: -ctk bf16 / -ctv bf16 (offered by --help) work: the engine maps KV types to ggml's enum values."""
    r = cli("generate", "-m", model_path, "-p", "Hello", "-n", "3", "-t", "1", "-ctk", "bf16", "-ctv", "bf16",
            "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n_generated_tokens"] == 3 and out["kv_bytes"] > 0
    assert "Traceback" not in r.stderr


def test_grammar_constrains_the_chat_answer(model_path):
    r = subprocess.run(CLI + ["chat", "-m", str(model_path), "-t", "1", "-n", "10", "--temp", "0", "--grammar",
                              'root ::= "yes" | "no"'], input="Is the sky blue?\nIs fire cold?\n", capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    answers = [ln.removeprefix("> ").strip() for ln in r.stdout.splitlines()]
    answers = [a for a in answers if a]
    assert len(answers) == 2 and set(answers) <= {"yes", "no"}, r.stdout
