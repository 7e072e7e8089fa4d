"""Differential conformance: one script of calls against stock ``llama_cpp.Llama`` and ``epikv_local.Llama`` in
the same process, on the default model (SmolLM2-135M) — the proof that ours is a drop-in.

What is compared (``SCRIPT``, each case one call made the same way on both):

- completions and chat turns, greedy and seeded, with each sampling parameter (temperature + seed, negative
  temperature, top_k, top_p, min_p, typical_p, repeat / frequency / presence penalty, mirostat 1 and 2 with
  tau / eta, logit_bias, stop), a token-id prompt, and streamed: the whole response (text, token counts,
  finish_reason, message; a stream chunk by chunk), only ``id`` / ``created`` (random, the clock) and our
  ``"epikv"`` statistics left out;
- a ``LlamaGrammar`` (completion and chat), ``response_format`` json_object with and without a schema, a
  named ``tool_choice`` through the GGUF's template (also streamed) and through ``chatml-function-calling``;
- completion ``logprobs`` (0, 2 streamed and 3 alternatives) and chat ``logprobs`` / ``top_logprobs`` (also
  streamed): the same tokens, offsets, keys and order, every log-probability within ``TOL`` (1e-4);
- ``tokenize`` / ``detokenize`` (``add_bos`` and ``special`` both ways; plain, special-token and non-ASCII
  text) and the vocabulary facts (``n_vocab``, BOS / EOS / NL, ``n_embd``, metadata): exactly;
- ``embed`` (plain, normalised, ``return_count``) and ``create_embedding``: the same shapes and usage, every
  value within ``TOL`` (stock needs ``Llama(embedding=True)``: a second stock instance, with the n_ctx /
  n_batch / n_ubatch of our embeddings context).

Each comparison is checked not to be vacuous (``test_the_comparisons_are_not_vacuous``): every penalty and the
logit bias change the greedy output, the seeded samplers give different texts, the grammar / JSON / tool
outputs are what their constraint allows.

Why these settings: nothing that could change the numbers differs. Both run flash attention (ours always
does; stock gets ``flash_attn=True``), ``n_batch`` = ``n_ubatch`` = 64, ``n_threads`` 2, and a 512-cell
context: ours allocates ``kv_budget + n_batch`` cells, so ``kv_budget=448`` against stock's ``n_ctx=512``
(every sequence here is shorter than 150 tokens: nothing is evicted, which each response's ``"epikv"``
confirms). Stock needs ``logits_all=True`` for logprobs; it does not change its sampled tokens. With the same
kernels on the same cells the outputs are bit-identical (measured: logprob difference 0, embedding difference
1e-16, the rounding of the normalisation); the 1e-4 tolerance leaves room for a build whose kernels order a
sum differently, and is far below what would let another token or a wrong row through.

Differences that are not bugs of ours are asserted as such by ``test_documented_*`` (``documented``: the row
of docs/api.md's surface table must say so, and the difference must really be there, so a stale note fails
too): ``n_ctx()`` (the budget); ``response_format`` json_schema (translated here, ignored by llama-cpp-python
0.3.36); chat ``logprobs=True`` without ``top_logprobs``; ``embed`` of a list with pooling NONE
(llama-cpp-python 0.3.36 reads the per-token rows of every input after the first from the wrong offset; ours
equals its one-input results); ``max_tokens`` cutting a character in two (a hard limit here; llama-cpp-python
generates past it); and a stream that a stop string ends (llama-cpp-python adds an empty chunk).

Then the same script runs on a Llama with ``kv_budget=64`` (the prompts share a preamble that makes each
prompt longer than that, so every generation evicts; ``protect_prompt=False`` lets a prompt exceed the
budget), each call on a fresh sequence: each call still works, its response has stock's shape (a stream: only
kinds of chunk stock's has), the live cells never exceed the budget and the call evicted; a second chat turn
reuses the evicted cache. Token and embedding calls do not touch the cache: they still equal stock's exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import epikv_local  # noqa: F401  (before llama_cpp: it points llama_cpp at the patched library)
from epikv_local.api.embeddings import EMBED_N_CTX
from epikv_local.api.llama import Llama

llama_cpp = pytest.importorskip("llama_cpp")
from llama_cpp import LlamaGrammar  # noqa: E402
from llama_cpp import llama_chat_format as lcf  # noqa: E402

#: the tolerance of log-probabilities and embedding values
TOL = 1e-4
N_CTX, N_BATCH, SEED, THREADS = 512, 64, 7, 2
#: ours allocates kv_budget + n_batch cells: the same 512-cell context as stock's n_ctx
KV_BUDGET = N_CTX - N_BATCH
SMALL_BUDGET = 64
#: the largest difference measured per kind of float (reported with -s at the end of the module)
MEASURED = {"logprob": 0.0, "embedding": 0.0}

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BIRDS = ("Mara kept a small notebook of the birds she saw each morning on her walk along the river: herons, "
         "kingfishers, a pair of swans and, once, an osprey that circled twice and left. ")
#: shared by every generation prompt: longer (~75 tokens) than SMALL_BUDGET, so that every call evicts there
PREAMBLE = BIRDS + ("On rainy days she stayed home, sorted her pencils by colour and read old field guides that "
                    "her grandmother had left her. ")
CAPITAL = PREAMBLE + "Unrelated question: the capital of France is"
APPLES = PREAMBLE + "The shopping list: apple, apple, apple,"
STORY = PREAMBLE + "Once upon a time"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": PREAMBLE + text}]


HELLO = user("Greet me in one short sentence.")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
CHOOSE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
YES_NO = 'root ::= "yes" | "no"'


# -- the script ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One call of the script: ``run(llm)`` returns what is compared. kind: what the small-budget run checks
    ("completion", "chat", "stream", "chat_stream": a generation; "exact": not touched by the cache)."""

    name: str
    kind: str
    run: Callable[[Any], Any]


#: each sampling parameter, as completion and chat keyword arguments (the chat defaults differ: all set here)
SAMPLING = {
    "greedy": dict(temperature=0),
    "temperature_seed": dict(temperature=0.9, seed=11),
    "negative_temperature_seed": dict(temperature=-1.0, seed=11),
    "top_k": dict(temperature=1.0, seed=11, top_k=5),
    "top_p": dict(temperature=1.0, seed=11, top_p=0.5),
    "min_p": dict(temperature=1.0, seed=11, min_p=0.2),
    "typical_p": dict(temperature=1.0, seed=11, typical_p=0.5),
    "repeat_penalty": dict(temperature=0, repeat_penalty=1.5),
    "frequency_penalty": dict(temperature=0, frequency_penalty=1.0),
    "presence_penalty": dict(temperature=0, presence_penalty=2.0),
    "mirostat_1": dict(temperature=0.8, seed=11, mirostat_mode=1, mirostat_tau=4.0, mirostat_eta=0.2),
    "mirostat_2": dict(temperature=0.8, seed=11, mirostat_mode=2, mirostat_tau=4.0, mirostat_eta=0.2),
    "logit_bias": dict(temperature=0, logit_bias="ban_paris_and_mara"),
    "stop": dict(temperature=0, stop=["."]),
    "greedy_repeats": dict(temperature=0),  # the penalties' prompt without a penalty
}
#: the penalties need repetition to act on
PENALTIES = ("repeat_penalty", "frequency_penalty", "presence_penalty")
REPEATS = PENALTIES + ("greedy_repeats",)


def sampling(llm, name: str) -> dict:
    kw = dict(SAMPLING[name])
    if kw.get("logit_bias") == "ban_paris_and_mara":  # token ids are looked up through the Llama under test
        kw["logit_bias"] = {t: -100.0 for word in (b" Paris", b"Mara", b"M")
                            for t in llm.tokenize(word, add_bos=False)[:1]}
    return kw


def completion_case(name: str) -> Case:
    prompt = APPLES if name in REPEATS else CAPITAL
    return Case(f"completion-{name}", "completion", lambda llm: llm(prompt, max_tokens=12, **sampling(llm, name)))


def chat_case(name: str) -> Case:
    msgs = user("Type the letter a many times: a a a a") if name in REPEATS else HELLO
    return Case(f"chat-{name}", "chat", lambda llm: llm.create_chat_completion(
        messages=msgs, max_tokens=16 if name in REPEATS else 12, **sampling(llm, name)))


def with_handler(handler_name: str, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run ``call`` with the Llama's chat handler swapped for a registered one (both classes keep it in
    ``chat_handler``): one instance of each serves both chat formats."""
    def run(llm):
        saved = llm.chat_handler
        llm.chat_handler = lcf.get_chat_completion_handler(handler_name)
        try:
            return call(llm)
        finally:
            llm.chat_handler = saved
    return run


GENERATION = [completion_case(n) for n in SAMPLING] + [chat_case(n) for n in SAMPLING] + [
    Case("completion-token_ids", "completion",
         lambda llm: llm(llm.tokenize(CAPITAL.encode()), max_tokens=12, temperature=0)),
    Case("completion-stream", "stream",
         lambda llm: list(llm(STORY, max_tokens=16, temperature=0.9, seed=5, stream=True))),
    Case("chat-stream", "chat_stream",
         lambda llm: list(llm.create_chat_completion(messages=HELLO, max_tokens=12, temperature=0, stream=True))),
    # grammars, JSON modes, tools
    Case("completion-grammar", "completion", lambda llm: llm(
        PREAMBLE + "Is the sky blue? Answer:", grammar=LlamaGrammar.from_string(YES_NO), max_tokens=4,
        temperature=0.8, seed=3)),
    Case("chat-grammar", "chat", lambda llm: llm.create_chat_completion(
        messages=user("Is the sky blue? Answer yes or no."), grammar=LlamaGrammar.from_string(YES_NO),
        max_tokens=4, temperature=0.8, seed=3)),
    Case("chat-json_object", "chat", lambda llm: llm.create_chat_completion(
        messages=user('Output the JSON object {"ok": true} and nothing else.'),
        response_format={"type": "json_object"}, max_tokens=16, temperature=0)),
    Case("chat-json_object_schema", "chat", lambda llm: llm.create_chat_completion(
        messages=user("Give a person as JSON."), response_format={"type": "json_object", "schema": PERSON},
        max_tokens=24, temperature=0)),
    Case("chat-tool_choice", "chat", lambda llm: llm.create_chat_completion(
        messages=user("Weather in Paris?"), tools=WEATHER, tool_choice=CHOOSE_WEATHER, max_tokens=24,
        temperature=0)),
    Case("chat-tool_choice-stream", "chat_stream", lambda llm: list(llm.create_chat_completion(
        messages=user("Weather in Paris?"), tools=WEATHER, tool_choice=CHOOSE_WEATHER, max_tokens=24,
        temperature=0, stream=True))),
    Case("chat-chatml_function_calling", "chat", with_handler("chatml-function-calling", lambda llm: (
        llm.create_chat_completion(messages=[{"role": "system", "content": PREAMBLE + "You call functions."},
                                             {"role": "user", "content": "Weather in Paris?"}],
                                   tools=WEATHER, tool_choice=CHOOSE_WEATHER, max_tokens=24, temperature=0)))),
    # logprobs
    Case("completion-logprobs_0", "completion",
         lambda llm: llm(CAPITAL, max_tokens=8, temperature=0, logprobs=0)),
    Case("completion-logprobs_3", "completion",
         lambda llm: llm(STORY, max_tokens=12, temperature=0.9, seed=5, logprobs=3)),
    Case("completion-logprobs-stream", "stream",
         lambda llm: list(llm(CAPITAL, max_tokens=8, temperature=0, logprobs=2, stream=True))),
    Case("chat-top_logprobs", "chat", lambda llm: llm.create_chat_completion(
        messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)),
    Case("chat-top_logprobs-stream", "chat_stream", lambda llm: list(llm.create_chat_completion(
        messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True))),
]

TEXTS = ("Hello world", "<|im_start|>user\nhi<|im_end|>\n", " héllo ünïcode 🎉 ", "x")


def tokens_case(llm):
    out = {}
    for text in TEXTS:
        for add_bos in (True, False):
            for special in (True, False):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
                out[f"{text!r} add_bos={add_bos} special={special}"] = {
                    "ids": ids, "text": llm.detokenize(ids), "text_special": llm.detokenize(ids, special=True)}
    return out


def vocabulary_case(llm):
    return {"n_vocab": llm.n_vocab(), "bos": llm.token_bos(), "eos": llm.token_eos(), "nl": llm.token_nl(),
            "n_embd": llm.n_embd(), "metadata": dict(llm.metadata)}


EXACT = [Case("tokenize-detokenize", "exact", tokens_case), Case("vocabulary", "exact", vocabulary_case)]
EMBED_TEXTS = ["Hello world", "The cat sat on the mat."]
#: embedding cases: run(llm) on ours, and on stock's embeddings instance
EMBEDDINGS = [
    Case("embed", "exact", lambda llm: llm.embed(EMBED_TEXTS[1])),
    Case("embed-normalize", "exact", lambda llm: llm.embed(EMBED_TEXTS[1], normalize=True)),
    Case("embed-return_count", "exact", lambda llm: llm.embed(EMBED_TEXTS[0], return_count=True)),
    Case("create_embedding", "exact", lambda llm: llm.create_embedding(EMBED_TEXTS[0])),
]
#: streams cut by a stop string: the same text, other chunks (a documented difference)
STOP_STREAMS = [
    Case("completion-stop-stream", "stream",
         lambda llm: list(llm(CAPITAL, max_tokens=12, temperature=0, stop=[".", "\n"], stream=True))),
    Case("chat-stop-stream", "chat_stream", lambda llm: list(llm.create_chat_completion(
        messages=HELLO, max_tokens=12, temperature=0, stop=["."], stream=True))),
]
SCRIPT = GENERATION + STOP_STREAMS + EXACT + EMBEDDINGS
BY_NAME = {c.name: c for c in SCRIPT}
assert len(BY_NAME) == len(SCRIPT)


# -- the Llamas ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ours(model_path):
    with Llama(model_path=str(model_path), kv_budget=KV_BUDGET, n_batch=N_BATCH, n_threads=THREADS,
               seed=SEED) as m:
        yield m


@pytest.fixture(scope="module")
def stock(model_path):
    m = llama_cpp.Llama(model_path=str(model_path), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                        n_threads=THREADS, n_threads_batch=THREADS, seed=SEED, flash_attn=True, logits_all=True,
                        verbose=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def stock_embedder(model_path):
    """Stock's embeddings need ``embedding=True``; ours has a separate context for them (n_ctx = n_batch =
    n_ubatch = EMBED_N_CTX, flash attention on): the same settings here."""
    m = llama_cpp.Llama(model_path=str(model_path), n_ctx=EMBED_N_CTX, n_batch=EMBED_N_CTX, n_ubatch=EMBED_N_CTX,
                        n_threads=THREADS, n_threads_batch=THREADS, flash_attn=True, embedding=True, verbose=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def small(model_path):
    with Llama(model_path=str(model_path), kv_budget=SMALL_BUDGET, n_batch=N_BATCH, n_threads=THREADS, seed=SEED,
               protect_prompt=False) as m:
        yield m


@pytest.fixture(scope="module")
def reference(stock, stock_embedder):
    """Stock's result of a case, computed once (the identical and the small-budget tests share it)."""
    cache: dict[str, Any] = {}

    def get(case: Case):
        if case.name not in cache:
            cache[case.name] = case.run(stock_embedder if case in EMBEDDINGS else stock)
        return cache[case.name]
    return get


@pytest.fixture(scope="module", autouse=True)
def report_measured():
    yield
    print(f"\nlargest differences measured: {MEASURED}")


# -- comparing -------------------------------------------------------------------------------------------------------
#: random (ids) or the clock (created): never equal between two calls
VOLATILE = frozenset({"id", "created"})
EXTENSION = "epikv"
CMPL_ID = re.compile(r"cmpl-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_float(x) -> bool:
    return isinstance(x, (float, np.floating))


def assert_same(ours, theirs, kind: str, path: str = "") -> None:
    """``ours`` equals ``theirs`` exactly, floats within TOL (the largest difference is kept in MEASURED[kind]);
    VOLATILE keys and our extension left out, completion ids inside strings (tool call ids) masked."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{path}: {type(ours).__name__} instead of a dict"
        keys = set(theirs) - VOLATILE
        assert set(ours) - VOLATILE - {EXTENSION} == keys, f"{path}: keys {sorted(set(ours))} != {sorted(theirs)}"
        for k in sorted(keys, key=str):
            assert_same(ours[k], theirs[k], kind, f"{path}.{k}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), \
            f"{path}: {len(ours) if isinstance(ours, (list, tuple)) else ours!r} items, stock {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, kind, f"{path}[{i}]")
    elif isinstance(theirs, np.ndarray):
        assert_same(np.asarray(ours).tolist(), theirs.tolist(), kind, path)
    elif is_float(theirs):
        assert is_float(ours), f"{path}: {ours!r} is not a float"
        diff = abs(float(ours) - float(theirs))
        MEASURED[kind] = max(MEASURED[kind], diff)
        assert diff <= TOL, f"{path}: {ours} vs stock {theirs} (|diff| {diff:.2e} > {TOL})"
    elif isinstance(theirs, str):
        assert isinstance(ours, str) and CMPL_ID.sub("cmpl-*", ours) == CMPL_ID.sub("cmpl-*", theirs), \
            f"{path}: {ours!r} != stock {theirs!r}"
    else:
        assert type(ours) is type(theirs) and ours == theirs, f"{path}: {ours!r} != stock {theirs!r}"


def table_note(name: str) -> tuple[str, str]:
    """(status, note) of ``name``'s row in docs/api.md's surface table."""
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| `{name}` |"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            return cells[2], cells[3]
    raise AssertionError(f"docs/api.md has no row for {name}")


def documented(name: str, phrase: str) -> None:
    """A difference from stock that docs/api.md's surface table lists (status different, ``phrase`` in the
    note): the caller then asserts that the difference is there."""
    status, note = table_note(name)
    assert status == "different" and phrase in note, f"docs/api.md's row {name} should say: {phrase}"


def text_of(out: dict) -> str:
    choice = out["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


# -- the same settings -----------------------------------------------------------------------------------------------
def test_settings_that_change_numbers_match(ours, stock, stock_embedder):
    ours("Hi", max_tokens=1, temperature=0)  # flash attention is verified on the first decode
    assert ours.session.flash_attn is True
    assert stock.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert stock_embedder.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert ours.session.ctx.n_ctx == stock.n_ctx() == llama_cpp.llama_n_ctx(stock.ctx) == N_CTX
    assert ours.session.ctx.n_batch == stock.n_batch == stock.context_params.n_ubatch == N_BATCH
    assert ours.session.ctx.n_threads == stock.context_params.n_threads == THREADS
    assert stock_embedder.n_batch == stock_embedder.context_params.n_ubatch == stock_embedder.n_ctx() == EMBED_N_CTX
    # documented: n_ctx() is the budget, the cells held, not the context
    documented("n_ctx", "returns the KV budget")
    assert ours.n_ctx() == KV_BUDGET != stock.n_ctx()


# -- identical outputs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", GENERATION + EXACT, ids=lambda c: c.name)
def test_same_output_as_llama_cpp(case, ours, reference):
    got, want = case.run(ours), reference(case)
    assert_same(got, want, "logprob", case.name)
    finals = [got] if case.kind in ("completion", "chat") else [got[-1]] if case.kind != "exact" else []
    for final in finals:  # the statistics say it: a 512-cell context, nothing evicted
        st = final[EXTENSION]
        assert st["n_evicted_total"] == 0 and st["n_ctx"] == N_CTX and st["flash_attn"] is True
        assert 0 < st["live_cells"] <= st["max_live_cells"] <= KV_BUDGET


@pytest.mark.parametrize("case", EMBEDDINGS, ids=lambda c: c.name)
def test_same_embeddings_as_llama_cpp(case, ours, reference):
    assert_same(case.run(ours), reference(case), "embedding", case.name)


def test_the_comparisons_are_not_vacuous(reference):
    """Each parameter acts here: the same call without it gives another output (else its case proves
    nothing about the parameter), and the constrained outputs are what their constraint allows."""
    def text(name):
        return text_of(reference(BY_NAME[name]))

    for kind in ("completion", "chat"):
        for name in PENALTIES:
            assert text(f"{kind}-{name}") != text(f"{kind}-greedy_repeats"), f"{kind}-{name} changed nothing"
        assert text(f"{kind}-logit_bias") != text(f"{kind}-greedy")
        seeded = {n: text(f"{kind}-{n}") for n in ("temperature_seed", "negative_temperature_seed", "top_k", "top_p",
                                                   "min_p", "typical_p", "mirostat_1", "mirostat_2")}
        assert len(set(seeded.values())) >= 6, f"{kind}: the seeded samplers hardly differ: {seeded}"
        assert text(f"{kind}-greedy") not in seeded.values()
    assert text("completion-stop") == text("completion-greedy").split(".")[0]
    assert text("completion-grammar") in ("yes", "no") and text("chat-grammar") in ("yes", "no")
    assert json.loads(text("chat-json_object")) == {"ok": True}
    assert set(json.loads(text("chat-json_object_schema"))) == {"name", "age"}
    for name in ("chat-tool_choice", "chat-chatml_function_calling"):
        call = reference(BY_NAME[name])["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
    assert len(reference(BY_NAME["completion-logprobs_3"])["choices"][0]["logprobs"]["top_logprobs"][0]) >= 3


# -- documented differences ------------------------------------------------------------------------------------------
def test_documented_json_schema_is_translated(ours, stock, reference):
    """OpenAI's json_schema response_format: ours constrains the output by the schema (as json_object +
    schema), llama-cpp-python 0.3.36 ignores it."""
    documented("create_chat_completion(response_format)", "llama-cpp-python 0.3.36 ignores it")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = user("Give a person as JSON.")
    got = ours.create_chat_completion(messages=msgs, response_format=fmt, max_tokens=24, temperature=0)
    assert_same(got, reference(BY_NAME["chat-json_object_schema"]), "logprob")
    theirs = stock.create_chat_completion(messages=msgs, response_format=fmt, max_tokens=24, temperature=0)
    unconstrained = stock.create_chat_completion(messages=msgs, max_tokens=24, temperature=0)
    assert text_of(theirs) == text_of(unconstrained) != text_of(got)


def test_documented_chat_logprobs_without_top_logprobs(ours, stock):
    """``logprobs=True`` alone: ours gives each token's logprob (top_logprobs=0, as OpenAI); llama-cpp-python
    returns none unless top_logprobs is set. The tokens and values are those of top_logprobs=1."""
    documented("create_chat_completion(logprobs)", "llama-cpp-python returns none unless top_logprobs is set")
    alone = dict(messages=HELLO, max_tokens=6, temperature=0, logprobs=True)
    assert stock.create_chat_completion(**alone)["choices"][0]["logprobs"] is None
    got = ours.create_chat_completion(**alone)["choices"][0]["logprobs"]["content"]
    want = stock.create_chat_completion(**alone, top_logprobs=1)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want] and len(got) == 6
    assert_same([e["logprob"] for e in got], [e["logprob"] for e in want], "logprob")
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in got)


def test_documented_embed_of_a_list_with_pooling_none(ours, stock_embedder):
    """A list of inputs, pooling NONE (this model's): ours returns each input's per-token rows as stock does
    for that input alone; llama-cpp-python 0.3.36 packs the inputs into one batch and reads the rows of every
    input after the first from the wrong offset (``ptr[pos + j * n_embd]``, pos counting tokens)."""
    documented("embed", "reads the per-token rows of every input after the first from the wrong offset")
    assert ours.pooling_type() == stock_embedder.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_NONE
    alone = [stock_embedder.embed(t) for t in EMBED_TEXTS]
    got = ours.embed(EMBED_TEXTS)
    assert_same(got, alone, "embedding")
    created = ours.create_embedding(EMBED_TEXTS)
    assert_same([d["embedding"] for d in created["data"]], alone, "embedding")
    assert created["usage"] == stock_embedder.create_embedding(EMBED_TEXTS)["usage"]
    batched = stock_embedder.embed(EMBED_TEXTS)
    assert_same(batched[0], alone[0], "embedding")  # the first input is read right ...
    assert np.max(np.abs(np.array(batched[1]) - np.array(alone[1]))) > 1.0  # ... the second is not


def test_documented_max_tokens_is_a_hard_limit(ours, stock):
    """max_tokens ends a generation at that many tokens, even when the last one begins a character that the
    next would complete (its incomplete bytes are dropped, the characters before them kept); llama-cpp-python
    0.3.36 (its ``multibyte_fix``) generates past max_tokens until the character is complete."""
    documented("create_completion(max_tokens)", "generates past it while the text ends in an incomplete UTF-8")
    documented("create_chat_completion(max_tokens)", "generates past it while the text ends in an incomplete UTF-8")
    call = dict(messages=[{"role": "user", "content": BIRDS + "Say hello in French."}], max_tokens=12,
                temperature=0.9, seed=11, logprobs=True, top_logprobs=1)
    got, want = ours.create_chat_completion(**call), stock.create_chat_completion(**call)
    assert got["usage"]["completion_tokens"] == 12 < want["usage"]["completion_tokens"] == 13
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
    entries = [e["token"] for e in got["choices"][0]["logprobs"]["content"]]
    assert entries == [e["token"] for e in want["choices"][0]["logprobs"]["content"]][:12]
    # the 12th token is a space and the first byte of "ê": ours keeps the space, stock's 13th completes the "ê"
    assert text_of(want) == text_of(got) + "ê" and text_of(got).endswith(" ")


def test_documented_stream_chunks_at_a_stop_string(ours, reference):
    """A stream that a stop string ends: the same text; llama-cpp-python 0.3.36 adds an empty chunk (an empty
    content delta in a chat) for the token where the stop string starts, ours does not."""
    documented("create_completion(stop)", "an empty chunk for the token where the stop string starts")
    documented("create_chat_completion(stop)", "an empty chunk for the token where the stop string starts")
    for case in STOP_STREAMS:
        got, want = case.run(ours), reference(case)

        def empty(c):
            choice = c["choices"][0]
            return choice["finish_reason"] is None and (choice.get("text") == "" or choice.get("delta") == {
                "content": ""})
        assert any(empty(c) for c in want) and not any(empty(c) for c in got), case.name
        assert_same(got, [c for c in want if not empty(c)], "logprob", case.name)
        assert got[-1]["choices"][0]["finish_reason"] == "stop" and got[-1][EXTENSION]["n_evicted_total"] == 0


# -- the same script under a small budget ----------------------------------------------------------------------------
def shape(x, key: str | None = None):
    """The structure of a response: dict keys (VOLATILE and the extension left out), the set of element shapes
    of a list, the type of a leaf (numbers: "number"); a completion's top_logprobs entries are maps."""
    if isinstance(x, dict):
        if key == "top_logprobs":  # {token text: logprob}
            return ("map", tuple(sorted({shape(v) for v in x.values()})))
        return tuple(sorted((k, shape(v, k)) for k, v in x.items() if k not in VOLATILE | {EXTENSION}))
    if isinstance(x, (list, tuple)):
        return ("list", tuple(sorted({shape(v, key) for v in x}, key=repr)))
    if is_float(x):
        return "number"
    return type(x).__name__


def check_small(got, want, case: Case) -> dict:
    """A small-budget result has stock's shape and is what its call asks for; returns its statistics."""
    if case.kind in ("stream", "chat_stream"):
        # every chunk is one of the kinds of chunk stock's stream has; the last one ends it
        assert {shape(c) for c in got} <= {shape(c) for c in want}, case.name
        assert got[-1]["choices"][0]["finish_reason"] is not None
        return got[-1][EXTENSION]
    assert shape(got) == shape(want), case.name
    usage, choice = got["usage"], got["choices"][0]
    assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"] > SMALL_BUDGET
    assert 1 <= usage["completion_tokens"] <= 24  # the largest max_tokens of the script
    if choice["logprobs"] and "tokens" in choice["logprobs"]:
        assert len(choice["logprobs"]["tokens"]) == usage["completion_tokens"]
    elif choice["logprobs"]:
        assert len(choice["logprobs"]["content"]) == usage["completion_tokens"]
    if case.name.endswith("grammar"):
        assert text_of(got) in ("yes", "no")
    if "tool_choice" in case.name or "function_calling" in case.name:
        fn = choice["message"]["tool_calls"][0]["function"]
        assert fn["name"] == "get_weather" and isinstance(json.loads(fn["arguments"]), dict)
    if "json" in case.name and choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text_of(got)), dict)
    return got[EXTENSION]


def check_budget_held(st: dict) -> None:
    assert st["kv_budget"] == SMALL_BUDGET and st["live_cells"] <= st["max_live_cells"] <= SMALL_BUDGET, st


@pytest.mark.parametrize("case", SCRIPT, ids=lambda c: c.name)
def test_small_budget_runs_the_same_script(case, small, reference):
    small.reset()  # a new sequence: its prompt alone is over the budget
    got, want = case.run(small), reference(case)
    if case.kind == "exact":  # tokens and embeddings do not touch the cache: still stock's exactly
        assert_same(got, want, "embedding" if case in EMBEDDINGS else "logprob", case.name)
        return
    st = check_small(got, want, case)
    check_budget_held(st)
    assert st["n_evicted_total"] > 0, f"{case.name}: nothing evicted ({st})"


def test_small_budget_continues_on_its_evicted_cache(small, reference):
    """A second turn keeps the common prefix with the evicted cache (holes and all) and still works."""
    small.reset()
    case = BY_NAME["chat-greedy"]
    first = case.run(small)
    check_budget_held(check_small(first, reference(case), case))
    history = HELLO + [first["choices"][0]["message"], {"role": "user", "content": "Now say it in French."}]
    second = small.create_chat_completion(messages=history, max_tokens=12, temperature=0)
    assert shape(second) == shape(first) and second["choices"][0]["message"]["content"]
    st = second[EXTENSION]
    check_budget_held(st)
    assert st["prompt_tokens_reused"] > SMALL_BUDGET and st["n_evicted"] > 0, st
