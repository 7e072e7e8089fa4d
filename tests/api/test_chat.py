"""Prompts rendered from chat messages: which tokens the chat template wrote (``template_marks``), unit tests on
byte pieces, then the marks a real chat turn hands to the policy (``said_words``) on the default model."""

from __future__ import annotations

import numpy as np
import pytest

import epikv_local  # noqa: F401  (before llama_cpp: it points llama_cpp at the patched library)
from epikv_local.api.chat import template_marks
from epikv_local.api.llama import Llama


def pieces(*parts: str) -> list[bytes]:
    return [p.encode() for p in parts]


def test_the_templates_tokens_are_those_outside_every_message():
    toks = pieces("<|im_start|>", "system", "\n", "You", " are", " helpful", ".", "<|im_end|>", "\n",
                  "<|im_start|>", "user", "\n", "What", " is", " 2", "+", "2", "?", "<|im_end|>", "\n",
                  "<|im_start|>", "assistant", "\n")
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": " What is 2+2?\n"}]
    marks = template_marks(toks, msgs)
    words = [t.decode() for t, m in zip(toks, marks) if not m]
    assert words == ["You", " are", " helpful", ".", "What", " is", " 2", "+", "2", "?"]
    # only the user's message given: the system text is the template's (a default system prompt)
    assert template_marks(toks, msgs[1:])[3:7] == [True] * 4


def test_a_token_across_a_contents_edge_is_the_callers():
    toks = pieces("<|im_start|>", "user\nHi", " there", "<|im_end|>")
    assert template_marks(toks, [{"role": "user", "content": "Hi there"}]) == [True, False, False, True]


@pytest.mark.parametrize("msgs", [
    [{"role": "user", "content": "a question the template rewrote"}],  # not in the rendering verbatim
    [{"role": "user", "content": "  "}],  # nothing to find
    [{"role": "assistant", "content": None, "tool_calls": []}],
])
def test_nothing_is_marked_when_a_content_is_not_found_or_there_is_none(msgs):
    assert template_marks(pieces("<|im_start|>", "user", "\n", "A question.", "<|im_end|>"), msgs) is None


def test_contents_are_found_in_order():
    """The second message's text also occurs earlier (inside the first): it is looked up after the first."""
    toks = pieces("<s>", "say yes", " or no", "</s>", "<s>", "yes", "</s>")
    marks = template_marks(toks, [{"role": "user", "content": "say yes or no"}, {"role": "user", "content": "yes"}])
    assert marks == [True, False, False, True, True, False, True]


def test_a_chat_turn_hands_the_policy_the_templates_tokens(model_path):
    """Through ``create_chat_completion``, ``said_words`` learns which prompt tokens the model's template wrote
    (here SmolLM2's default system prompt and role markers) and which are the user's; a raw completion prompt
    carries no marks."""
    question = "A farm has 37 cows and twice as many sheep. How many animals live on the farm?"
    with Llama(model_path=str(model_path), kv_budget=96, protect_prompt=False, n_threads=2, seed=0,
               kv_policy="said_words") as llm:
        out = llm.create_chat_completion(messages=[{"role": "user", "content": question}], max_tokens=4,
                                         temperature=0)
        toks = llm.session.tokens
        marks = llm.session.policy._template.values[:len(toks)]
        n_prompt = out["usage"]["prompt_tokens"]
        assert len(toks) > n_prompt
        words = [llm.detokenize([t], special=True) for t, m in zip(toks[:n_prompt], marks) if m == 0.0]
        assert b"".join(words).strip() == question.encode()
        templ = b"".join(llm.detokenize([t], special=True) for t, m in zip(toks[:n_prompt], marks) if m == 1.0)
        assert b"<|im_start|>" in templ and b"assistant" in templ
        assert np.all(marks[n_prompt:] == 0.0)  # the model's own tokens are not the template's
        llm.reset()
        llm.create_completion("<|im_start|>user\n" + question + "<|im_end|>\n", max_tokens=2, temperature=0)
        assert np.all(llm.session.policy._template.values[:len(llm.session.tokens)] == 0.0)


def test_a_rendered_chat_prompt_marks_the_template_for_generate(model):
    """The CLI's ``generate --chat`` path: the template rendered to text, tokenized, marked with the messages
    (``template_marks``) and handed to ``generate``, whose policy then holds the marks."""
    from epikv_local.api.chat import apply_chat_template, tokenize_prompt
    from epikv_local.api.generation import generate
    from epikv_local.engine.budget import BudgetConfig
    from epikv_local.engine.sampling import SamplingConfig
    from epikv_local.engine.session import Session, SessionConfig
    from epikv_local.policies import make_policy

    question = "Name three colours."
    tokens = tokenize_prompt(model, apply_chat_template(model, question))
    marks = template_marks([model.token_bytes(t, special=True) for t in tokens], [{"role": "user", "content": question}])
    assert marks is not None and 0 < sum(marks) < len(marks)
    assert b"".join(model.token_bytes(t, special=True) for t, m in zip(tokens, marks) if not m).strip() == \
        question.encode()
    with Session(model, make_policy("said_words"), BudgetConfig(kv_budget=96, protect_prompt=False),
                 SessionConfig(n_threads=2)) as s:
        generate(s, tokens, 4, SamplingConfig(), template=marks)
        assert s.policy._template.values[:len(tokens)].tolist() == [float(m) for m in marks]
