"""llama-cpp-python's completion and chat features on ``epikv_local.Llama`` with the real default model
(SmolLM2-135M, small budgets, a few tokens each): sampling settings, grammars, JSON modes, tools, logprobs,
logits processors, fill-in-the-middle, the reasoning budget and the superseded stream."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import epikv_local  # noqa: F401  (before llama_cpp: it points llama_cpp at the patched library)
from epikv_local.api.llama import Llama
from epikv_local.errors import ConfigError

llama_cpp = pytest.importorskip("llama_cpp")
from llama_cpp import LlamaGrammar, LogitsProcessorList  # noqa: E402

APPLES = "The list: apple, apple, apple,"
THINK_PROMPT = "<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n<think>\n"
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n<think>\n")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
CHOOSE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def llm(model_path):
    with Llama(model_path=str(model_path), kv_budget=192, n_threads=2, seed=3) as m:
        yield m


def text_of(out: dict) -> str:
    return out["choices"][0]["text"]


# -- sampling ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [{"repeat_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 2.0}])
def test_each_penalty_runs_and_changes_the_output(llm, penalty):
    off = text_of(llm(APPLES, max_tokens=10, temperature=0))
    on = text_of(llm(APPLES, max_tokens=10, temperature=0, **penalty))
    assert off.startswith(" apple, apple, apple,") and on != off
    # llama-cpp-python penalizes the generated tokens only: the prompt's apples do not stop the first one
    assert on.startswith(" apple")


def test_penalties_see_generated_tokens_like_llama_cpp(llm, model_path):
    """The first tokens under a penalty are llama-cpp-python's (later ones may drift: other kernels)."""
    stock = llama_cpp.Llama(model_path=str(model_path), n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    try:
        for kw in ({"repeat_penalty": 1.5}, {"presence_penalty": 2.0}):
            ours = llm(APPLES, max_tokens=4, temperature=0, logprobs=0, **kw)["choices"][0]["logprobs"]["tokens"]
            theirs = stock(APPLES, max_tokens=4, temperature=0, logprobs=0, **kw)["choices"][0]["logprobs"]["tokens"]
            assert ours[:3] == theirs[:3], kw
    finally:
        stock.close()


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_runs(llm, mode):
    out = llm("Once upon a time", max_tokens=6, mirostat_mode=mode, mirostat_tau=4.0, mirostat_eta=0.2, seed=5)
    assert 1 <= out["usage"]["completion_tokens"] <= 6
    again = llm("Once upon a time", max_tokens=6, mirostat_mode=mode, mirostat_tau=4.0, mirostat_eta=0.2, seed=5)
    assert text_of(again) == text_of(out)  # seeded


def test_temperatures_and_seeds(llm):
    for t in (-1.0, 0.8):  # < 0: a plain seeded draw; > 0: the top-k ... chain
        a = text_of(llm(APPLES, max_tokens=5, temperature=t, seed=11))
        assert a == text_of(llm(APPLES, max_tokens=5, temperature=t, seed=11))
    assert text_of(llm(APPLES, max_tokens=5, temperature=0)).startswith(" apple, apple")
    with pytest.raises(ConfigError, match="mirostat_mode"):
        llm(APPLES, max_tokens=2, mirostat_mode=3)


# -- grammars, JSON, tools -------------------------------------------------------------------------------------------
def test_grammar_constrains_the_output(llm):
    grammar = LlamaGrammar.from_string('root ::= "yes" | "no"')
    out = llm("Is the sky blue? Answer:", grammar=grammar, max_tokens=5)
    assert text_of(out) in ("yes", "no") and out["choices"][0]["finish_reason"] == "stop"
    assert text_of(llm("Answer:", grammar='root ::= "maybe"', max_tokens=5, temperature=0)) == "maybe"  # GBNF text
    with pytest.raises(ConfigError, match="grammar"):
        llm("Answer:", grammar="root ::= (", max_tokens=2)
    assert llm("Hi", max_tokens=2)["usage"]["completion_tokens"] <= 2  # still usable


def test_response_format_json_object_and_json_schema(llm):
    msgs = [{"role": "user", "content": 'Reply with a JSON object with one key, "ok", set to true.'}]
    r = llm.create_chat_completion(messages=msgs, response_format={"type": "json_object"}, max_tokens=24,
                                   temperature=0)
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    r = llm.create_chat_completion(messages=[{"role": "user", "content": "Give a person as JSON."}],
                                   response_format=fmt, max_tokens=40, temperature=0)
    person = json.loads(r["choices"][0]["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    with pytest.raises(ConfigError, match="response_format"):
        llm.create_chat_completion(messages=msgs, response_format={"type": "xml"})


def test_named_tool_choice_returns_tool_calls_through_the_template(llm):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = llm.create_chat_completion(messages=msgs, tools=WEATHER, tool_choice=CHOOSE_WEATHER, max_tokens=30,
                                   temperature=0)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    # streamed: the tool-call deltas come through (not swallowed by the reasoning splitter)
    chunks = list(llm.create_chat_completion(messages=msgs, tools=WEATHER, tool_choice=CHOOSE_WEATHER,
                                             max_tokens=30, temperature=0, stream=True))
    args = "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks
                   if (c["choices"][0]["delta"] or {}).get("tool_calls"))
    assert args == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and "epikv" in chunks[-1]
    with pytest.raises(ConfigError, match="not one of the tools"):
        llm.create_chat_completion(messages=msgs, tools=WEATHER,
                                   tool_choice={"type": "function", "function": {"name": "nope"}})


def test_chatml_function_calling_format(model_path):
    with Llama(model_path=str(model_path), kv_budget=384, n_threads=2, seed=3,
               chat_format="chatml-function-calling") as m:
        r = m.create_chat_completion(messages=[{"role": "system", "content": "You call functions."},
                                               {"role": "user", "content": "Weather in Paris?"}],
                                     tools=WEATHER, tool_choice=CHOOSE_WEATHER, max_tokens=30, temperature=0)
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


# -- logprobs --------------------------------------------------------------------------------------------------------
def check_completion_logprobs(lp: dict, text: str, prompt: str, n_top: int) -> None:
    assert set(lp) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
    n = len(lp["tokens"])
    assert n and all(len(lp[k]) == n for k in lp)
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"][0] == len(prompt) and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert isinstance(value, float) and value <= 0
        assert top[tok] == value and n_top <= len(top) <= n_top + 1
        assert list(top.values())[:n_top] == sorted(list(top.values())[:n_top], reverse=True)


def test_completion_logprobs_full_and_streamed(llm, model_path):
    prompt = "The capital of France is"
    out = llm(prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    check_completion_logprobs(lp, text_of(out), prompt, 3)
    assert len(lp["tokens"]) == out["usage"]["completion_tokens"] == 4
    chunks = list(llm(prompt, max_tokens=4, temperature=0, logprobs=3, stream=True))
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert all(p["tokens"] and "".join(p["tokens"]) for p in parts)
    merged = {k: sum((p[k] for p in parts), []) for k in lp}
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert np.allclose(merged["token_logprobs"], lp["token_logprobs"], atol=1e-4)
    # the same numbers as llama-cpp-python's (its own kernels: close, not equal)
    stock = llama_cpp.Llama(model_path=str(model_path), n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    try:
        ref = stock(prompt, max_tokens=4, temperature=0, logprobs=3)["choices"][0]["logprobs"]
    finally:
        stock.close()
    assert ref["tokens"] == lp["tokens"] and ref["text_offset"] == lp["text_offset"]
    assert np.allclose(ref["token_logprobs"], lp["token_logprobs"], atol=0.25)
    assert [list(t)[:2] for t in ref["top_logprobs"]] == [list(t)[:2] for t in lp["top_logprobs"]]
    # a stop string cuts the tokens it covers out of the logprobs, as out of the text
    cut = llm(prompt, max_tokens=4, temperature=0, logprobs=1, stop=".")
    assert text_of(cut) == " Paris" and cut["choices"][0]["logprobs"]["tokens"] == [" Paris"]
    with pytest.raises(ConfigError, match="echo"):
        llm(prompt, max_tokens=2, logprobs=1, echo=True)
    assert llm(prompt, max_tokens=2)["choices"][0]["logprobs"] is None


def test_chat_logprobs_full_and_streamed(llm):
    msgs = [{"role": "user", "content": "Say hello."}]
    r = llm.create_chat_completion(messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert {t["token"] for t in e["top_logprobs"]} >= {e["token"]} and len(e["top_logprobs"]) <= 3
    assert "".join(e["token"] for e in content).strip() == r["choices"][0]["message"]["content"].strip()
    chunks = list(llm.create_chat_completion(messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                             top_logprobs=2, stream=True))
    streamed = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    alone = llm.create_chat_completion(messages=msgs, max_tokens=2, temperature=0, logprobs=True)
    assert all(len(e["top_logprobs"]) == 1 for e in alone["choices"][0]["logprobs"]["content"])
    assert llm.create_chat_completion(messages=msgs, max_tokens=2)["choices"][0]["logprobs"] is None


# -- logits processors, stopping criteria ------------------------------------------------------------------------------
def test_logits_processor_banning_a_token_is_obeyed(llm):
    prompt = "The capital of France is"
    paris = llm.tokenize(b" Paris", add_bos=False)[0]
    assert text_of(llm(prompt, max_tokens=1, temperature=0)) == " Paris"

    def ban(input_ids, scores):
        scores[paris] = -np.inf
        return scores

    for proc in (ban, LogitsProcessorList([ban]), [ban]):
        out = llm(prompt, max_tokens=3, temperature=0, logits_processor=proc, logprobs=0)
        assert out["choices"][0]["logprobs"]["tokens"][0] != " Paris"
    seen = []

    def stop_after_two(input_ids, logits):
        seen.append((len(input_ids), logits.shape))
        return len(seen) == 2

    out = llm(prompt, max_tokens=8, temperature=0, stopping_criteria=[stop_after_two])
    assert out["usage"]["completion_tokens"] == 2 and out["choices"][0]["finish_reason"] == "stop"
    assert seen[1][0] == seen[0][0] + 1 and seen[0][1] == (llm.n_vocab(),)
    with pytest.raises(ConfigError, match="logits_processor"):
        llm(prompt, max_tokens=2, logits_processor=5)


# -- fill-in-the-middle ----------------------------------------------------------------------------------------------
def test_suffix_follows_the_models_fim_tokens(llm, monkeypatch):
    m = llm._model
    fim = tuple(int(f(m.vocab)) for f in (m.nat.llama.llama_vocab_fim_pre, m.nat.llama.llama_vocab_fim_suf,
                                          m.nat.llama.llama_vocab_fim_mid))
    if min(fim) < 0:  # SmolLM2 has none: a clear error, and the Llama stays usable
        with pytest.raises(ConfigError, match="fill-in-the-middle"):
            llm("def add(a, b):\n", suffix="\n    return c\n", max_tokens=4)
        assert llm("Hi", max_tokens=2)["usage"]["completion_tokens"] <= 2
        fim = (1, 2, 0)  # stand-ins, to check how the prompt is built
        monkeypatch.setattr(llm, "_fim_tokens", lambda: fim)
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    out = llm(prefix, suffix=suffix, max_tokens=2, temperature=0)
    pre, suf, mid = fim
    expect = [pre] + llm.tokenize(prefix.encode(), add_bos=False) + [suf] + \
        llm.tokenize(suffix.encode(), add_bos=False) + [mid]
    assert out["usage"]["prompt_tokens"] == len(expect)
    assert llm.session.tokens[:len(expect)] == expect
    monkeypatch.setattr(llm, "spm_infill", True)
    llm(prefix, suffix=suffix, max_tokens=1, temperature=0)
    assert llm.session.tokens[0] == suf


# -- reasoning budget ------------------------------------------------------------------------------------------------
def test_reasoning_budget_forces_the_closing_tag(llm):
    close = llm.tokenize(b"</think>", add_bos=False, special=True)
    for budget in (0, 3):
        steps = list(llm.completion_steps(THINK_PROMPT, max_tokens=budget + len(close) + 4, temperature=0,
                                          reasoning_budget=budget))
        text = "".join(s.chunk["choices"][0]["text"] for s in steps)
        st = steps[-1].stats
        assert "</think>" in text and st.reasoning_forced_close and st.n_reasoning_tokens == budget
        # the closing tag came right after the budget: within N + len(close) generated tokens
        head = llm.detokenize(llm.session.tokens[st.n_prompt_tokens:st.n_prompt_tokens + budget + len(close)])
        assert head.decode().endswith("</think>")
        assert steps[-1].chunk["epikv"]["reasoning_tokens"] == budget
    free = llm(THINK_PROMPT, max_tokens=6, temperature=0)
    assert free["epikv"]["reasoning_forced_close"] is False and free["epikv"]["reasoning_tokens"] == 6
    with pytest.raises(ConfigError, match="reasoning_budget"):
        llm(THINK_PROMPT, max_tokens=2, reasoning_budget=-2)


def test_reasoning_budget_when_the_model_opens_thinking(llm):
    opening = llm.tokenize(b"<think>", add_bos=False, special=True)

    def write_think(input_ids, scores):  # the model "writes" <think> first
        n = len(input_ids) - n_prompt[0]
        if n < len(opening):
            keep = scores[opening[n]]
            scores[:] = -np.inf
            scores[opening[n]] = keep
        return scores

    prompt = "Question: what is 2 + 2? Answer:"
    n_prompt = [len(llm.tokenize(prompt.encode()))]
    out = llm(prompt, max_tokens=len(opening) + 2 + 3 + 2, temperature=0, logits_processor=write_think,
              reasoning_budget=2)
    text = text_of(out)
    assert text.startswith("<think>") and "</think>" in text
    assert out["epikv"]["reasoning_tokens"] == 2 and out["epikv"]["reasoning_forced_close"]


def test_reasoning_budget_splits_a_chat(model_path):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    handler = Jinja2ChatFormatter(THINK_TEMPLATE, eos_token="<|im_end|>", bos_token="").to_chat_handler()
    with Llama(model_path=str(model_path), kv_budget=128, chat_handler=handler, n_threads=2, seed=1,
               reasoning_budget=3) as m:
        msgs = [{"role": "user", "content": "What is 6 times 7?"}]
        r = m.create_chat_completion(messages=msgs, max_tokens=12, temperature=0)
        msg = r["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["content"] and "</think>" not in msg["content"] + msg["reasoning_content"]
        assert r["epikv"]["reasoning_forced_close"] and r["epikv"]["reasoning_tokens"] == 3
        deltas = [c["choices"][0]["delta"] for c in m.create_chat_completion(messages=msgs, max_tokens=12,
                                                                             temperature=0, stream=True)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        # per call: unlimited here, so no answer within 12 tokens
        r = m.create_chat_completion(messages=msgs, max_tokens=12, temperature=0, reasoning_budget=-1)
        assert not r["epikv"]["reasoning_forced_close"] and r["choices"][0]["message"]["content"] == ""


# -- a second stream ---------------------------------------------------------------------------------------------------
def test_a_newer_call_supersedes_an_older_stream(llm):
    old = llm.create_completion("Once upon a time", max_tokens=20, stream=True)
    next(old), next(old)
    assert llm("Hello", max_tokens=2)["usage"]["completion_tokens"] <= 2
    with pytest.raises(ConfigError, match="superseded by a newer call"):
        next(old)
    chat = llm.create_chat_completion(messages=[{"role": "user", "content": "Tell a story."}], max_tokens=20,
                                      stream=True)
    next(chat)
    llm.reset()
    with pytest.raises(ConfigError, match="superseded"):
        list(chat)
    done = llm.create_completion("Hi", max_tokens=2, stream=True)
    while next(done)["choices"][0]["finish_reason"] is None:  # read to its last chunk: finished
        pass
    llm("Hello", max_tokens=1)
    assert list(done) == []  # ends as usual


def test_a_stream_read_in_another_thread_is_not_superseded(llm):
    inside, release = threading.Event(), threading.Event()
    result = {}

    def slow(input_ids, logits):  # holds the reading thread inside next()
        inside.set()
        release.wait(60)
        return False

    def reader():
        try:
            result["n"] = llm(APPLES, max_tokens=3, temperature=0, stopping_criteria=slow)["usage"]["completion_tokens"]
        except Exception as e:  # pragma: no cover - reported below
            result["error"] = e

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert inside.wait(60)
        with pytest.raises(ConfigError, match="already generating|in use"):
            llm("Hello", max_tokens=1)
    finally:
        release.set()
        t.join(120)
    assert result == {"n": 3}
    assert llm("Hello", max_tokens=1)["usage"]["completion_tokens"] == 1
