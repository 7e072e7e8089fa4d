"""Hostile input on the Python ``Llama`` (the hostile report's rows 7, 8 and 17 as the Python API meets them):
each is a ConfigError naming the field, never a TypeError, a Jinja ``UndefinedError`` or a
``UnicodeEncodeError``, and the Llama stays usable after it. The server's side of the same rows is in
tests/api/test_server_security.py."""

from __future__ import annotations

import pytest

from epikv_local.api.llama import Llama
from epikv_local.errors import ConfigError

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


@pytest.fixture(scope="module")
def llm(model_path):
    with Llama(model_path=str(model_path), kv_budget=128, n_threads=2, seed=1) as m:
        yield m


def chat(llm, messages, **kw):
    return llm.create_chat_completion(messages=messages, max_tokens=2, temperature=0, **kw)


@pytest.mark.parametrize("message,state", [({"role": "user", "content": None}, "null"), ({"role": "user"}, "missing")])
def test_row7_null_or_missing_content_is_a_config_error_naming_the_message(llm, message, state):
    with pytest.raises(ConfigError, match=rf"messages\[1\]\.content is {state}"):
        chat(llm, [{"role": "system", "content": "Be brief."}, message])
    assert chat(llm, [{"role": "user", "content": "Hi"}])["choices"][0]["message"]["role"] == "assistant"


def test_row7_an_assistant_turn_with_tool_calls_and_null_content_is_rendered(llm):
    """What OpenAI clients send back after a tool call: the turn's null content renders as "" (the template gets
    text), and the conversation goes on."""
    out = chat(llm, [{"role": "user", "content": "Weather in Oslo?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert out["usage"]["prompt_tokens"] > 0 and out["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("call,field", [
    (lambda m: chat(m, [{"role": "user", "content": "a\ud800b"}]), r"messages\[0\]\.content"),
    (lambda m: chat(m, [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), r"messages\[0\]\.content"),
    (lambda m: m.create_completion("x\ud800", max_tokens=2), "prompt"),
    (lambda m: m.tokenize("\ud800"), "the text to tokenize"),
    (lambda m: m.create_embedding(["ok", "\ud800"]), "input 1"),
])
def test_row8_a_lone_surrogate_is_a_config_error_naming_the_field(llm, call, field):
    with pytest.raises(ConfigError, match=rf"{field} is not valid Unicode \(a lone surrogate"):
        call(llm)
    assert llm.tokenize(b"fine") == llm.tokenize("fine")


@pytest.mark.parametrize("bias", [{"x": 1}, {"1": "high"}, {None: 1}, ["not", "pairs"], {1: float("nan")}])
def test_row17_a_malformed_logit_bias_is_a_config_error(llm, bias):
    with pytest.raises(ConfigError, match="logit_bias"):
        llm("Hi", max_tokens=2, logit_bias=bias)
    # ids as JSON sends them (string keys) are accepted, as llama-cpp-python accepts them
    assert llm("Hi", max_tokens=2, temperature=0, logit_bias={"1": 0.0})["usage"]["completion_tokens"] >= 1


def test_row17_save_session_during_an_open_stream_ends_that_stream_with_an_error(llm, tmp_path):
    stream = llm.create_completion("Once upon a time", max_tokens=16, stream=True, temperature=0)
    next(stream)
    llm.save_session(tmp_path / "s.epikv")
    with pytest.raises(ConfigError, match="superseded"):
        list(stream)
    assert (tmp_path / "s.epikv").stat().st_size > 0


def test_row17_nothing_answers_after_close(model_path):
    m = Llama(model_path=str(model_path), kv_budget=64, n_threads=1)
    m.close()
    for call in (m.n_vocab, m.n_ctx, lambda: m.tokenize(b"hi"), lambda: m.detokenize([1]), lambda: m("Hi")):
        with pytest.raises(ConfigError, match="closed"):
            call()


@pytest.mark.parametrize("calls,field", [
    ([{"id": "c", "type": "function", "function": {"name": "f"}}], r"tool_calls\[0\]"),
    ("ab", "tool_calls"), ([5], r"tool_calls\[0\]"),
    ([{"id": "c", "type": "function", "function": {"name": 3, "arguments": "{}"}}], r"tool_calls\[0\]")])
def test_row7_malformed_tool_calls_are_a_config_error_naming_them(llm, calls, field):
    with pytest.raises(ConfigError, match=rf"messages\[1\]\.{field} must be"):
        chat(llm, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c", "content": "x"}])


def test_row7_a_template_that_refuses_the_conversation_is_a_config_error(model_path):
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}x"
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter, chat_formatter_to_chat_completion_handler

    handler = chat_formatter_to_chat_completion_handler(Jinja2ChatFormatter(template, "</s>", "<s>"))
    with Llama(model_path=str(model_path), kv_budget=64, n_threads=1, chat_handler=handler) as m:
        with pytest.raises(ConfigError, match="the chat template cannot render these messages: system first"):
            chat(m, [{"role": "user", "content": "Hi"}])


def test_row4_a_fill_in_the_middle_prompt_is_size_checked_before_tokenizing(model_path, monkeypatch):
    with Llama(model_path=str(model_path), kv_budget=64, n_threads=1, max_prompt_tokens=100) as m:
        monkeypatch.setattr(m, "_fim_tokens", lambda: (1, 2, 0))  # SmolLM2 has no FIM tokens: stand-ins
        monkeypatch.setattr(m, "tokenize", lambda *a, **k: pytest.fail("tokenized before the size check"))
        big = "x " * 10_000
        with pytest.raises(ConfigError, match=r"bytes has at least \d+ tokens.*max_prompt_tokens"):
            m.create_completion(big, suffix="", max_tokens=1)
        with pytest.raises(ConfigError, match=r"bytes has at least \d+ tokens.*max_prompt_tokens"):
            m.create_completion("def f(", suffix=big, max_tokens=1)


def test_row8_a_lone_surrogate_in_a_grammar_is_a_config_error(llm):
    with pytest.raises(ConfigError, match=r"grammar is not valid Unicode"):
        llm("Hi", max_tokens=2, grammar='root ::= "\ud800"')  # GBNF text is accepted as a grammar too
