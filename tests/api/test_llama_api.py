"""The llama-cpp-python-shaped ``epikv_local.Llama`` on the real default model: a chat script whose only change
is the import line (+ kv_budget), response shapes, multi-turn prefix reuse, reasoning split, defaults, bad
input, the hub loader (offline, on a locally laid-out cache) and coexistence with llama_cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from epikv_local.policies import DEFAULT_POLICY
from epikv_local.api.llama import Llama, check_messages
from epikv_local.api.reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning
from epikv_local.errors import BudgetError, ConfigError, EpikvError, ModelError

REPO = Path(__file__).resolve().parents[2]
EXT_KEYS = {"policy", "kv_budget", "live_cells", "max_live_cells", "n_evicted", "n_evicted_total", "kv_bytes",
            "n_ctx", "flash_attn", "prompt_tokens_reused", "prompt_tokens_decoded", "decode_tokens_per_s"}


def run_py(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def llm(model_path):
    with Llama(model_path=str(model_path), kv_budget=128, n_threads=2, seed=3) as m:
        yield m


# -- the drop-in script ----------------------------------------------------------------------------------------------
CHAT_SCRIPT = '''
import json, sys
from epikv_local import Llama          # was: from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=8192, n_gpu_layers=-1, flash_attn=True, kv_budget=96, seed=7, n_threads=2)
messages = [{"role": "user", "content": "Write a long story about a dragon who learns to count."}]
report = []
for turn in range(2):
    if turn == 0:
        parts = []
        for chunk in llm.create_chat_completion(messages=messages, stream=True, max_tokens=120):
            delta = chunk["choices"][0]["delta"]
            parts.append(delta.get("content", ""))
            print(delta.get("content", ""), end="", flush=True)
        report.append({"chunk": chunk, "text": "".join(parts)})
        answer = "".join(parts)
    else:
        resp = llm.create_chat_completion(messages=messages, max_tokens=60)
        report.append({"response": resp})
        answer = resp["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me another one."}]
print()
print("REPORT " + json.dumps(report))
'''


def test_llama_cpp_chat_script_with_only_the_import_changed(model_path, tmp_path):
    script = tmp_path / "chat.py"
    script.write_text(CHAT_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(model_path)], capture_output=True, text=True, timeout=600,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert "n_ctx=8192 is not used" in r.stderr  # explained, not silently ignored
    report = json.loads(r.stdout.split("REPORT ", 1)[1])
    last_chunk, text1 = report[0]["chunk"], report[0]["text"]
    assert last_chunk["object"] == "chat.completion.chunk" and last_chunk["id"].startswith("chatcmpl-")
    assert last_chunk["choices"][0]["finish_reason"] in ("stop", "length") and text1
    ext1 = last_chunk["epikv"]
    assert EXT_KEYS <= set(ext1) and ext1["policy"] == DEFAULT_POLICY and ext1["flash_attn"] is True
    assert ext1["max_live_cells"] <= 96 and ext1["n_evicted"] > 0  # up to 120 tokens after a ~40-token prompt
    resp = report[1]["response"]
    assert resp["object"] == "chat.completion" and resp["choices"][0]["message"]["role"] == "assistant"
    u = resp["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    ext2 = resp["epikv"]
    # turn two decoded only its new tokens: the conversation so far stayed in the (evicted) cache
    assert ext2["prompt_tokens_reused"] >= 100
    assert ext2["prompt_tokens_decoded"] == u["prompt_tokens"] - ext2["prompt_tokens_reused"]
    assert ext2["prompt_tokens_decoded"] < 40
    assert ext2["max_live_cells"] <= 96 and ext2["live_cells"] <= 96


# -- shapes --------------------------------------------------------------------------------------------------------
def test_completion_shapes_and_call(llm):
    llm.reset()
    out = llm("The capital of France is", max_tokens=6, temperature=0)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    ch = out["choices"][0]
    assert set(ch) == {"text", "index", "logprobs", "finish_reason"} and ch["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6 and EXT_KEYS <= set(out["epikv"])
    chunks = list(llm.create_completion("The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ch["text"]  # greedy: same text, second call
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "epikv" in chunks[-1]
    # the second call found its whole prompt in the cache, and the logits after it (kept from the first call):
    # nothing decoded again
    assert chunks[-1]["epikv"]["prompt_tokens_reused"] == out["usage"]["prompt_tokens"]
    assert chunks[-1]["epikv"]["prompt_tokens_decoded"] == 0
    echo = llm("Paris is", max_tokens=2, temperature=0, echo=True)
    assert echo["choices"][0]["text"].startswith("Paris is")


def test_chat_response_shape_and_defaults(llm):
    llm.reset()
    resp = llm.create_chat_completion(messages=[{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Say hello."}], max_tokens=20)
    assert resp["id"].startswith("chatcmpl-") and resp["object"] == "chat.completion"
    msg = resp["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert "<think>" not in msg["content"]
    s = llm._sampling(None, None, 40, 0.05, 1.0, 1.0, 0.0, 0.0, 5, None)
    assert (s.temperature, s.top_p) == (0.6, 0.95)  # reasoning models' recommended sampling unless set
    assert llm._sampling(0.2, 0.5, 40, 0.05, 1.0, 1.0, 0.0, 0.0, 5, None).temperature == 0.2
    assert llm.n_ctx() == 128 and llm.chat_format == "chat_template.default"


def test_tokenize_detokenize_round_trip(llm):
    toks = llm.tokenize(b"Hello world", add_bos=False)
    assert llm.detokenize(toks) == b"Hello world"
    with pytest.raises(ConfigError):
        llm.detokenize([10**9])


# -- reasoning ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pieces", [["<think>a b</think>answer"], ["<th", "ink>a", " b</t", "hink>\n\nans", "wer"],
                                    list("<think>a b</think>answer")])
def test_reasoning_splitter_any_chunking(pieces):
    sp = ReasoningSplitter()
    out = [sp.feed(p) for p in pieces] + [sp.flush()]
    assert "".join(r for r, _ in out) == "a b"
    assert "".join(c for _, c in out) == "answer"


def test_reasoning_starts_open_and_unclosed():
    assert split_reasoning("step 1\nstep 2</think>\n42", starts_open=True) == ("step 1\nstep 2", "42")
    assert split_reasoning("still thinking", starts_open=True) == ("still thinking", "")
    assert split_reasoning("plain answer") == ("", "plain answer")
    assert prompt_opens_thinking("<|Assistant|><think>\n") and not prompt_opens_thinking("<|Assistant|>")


THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n<think>\n")


def test_reasoning_content_end_to_end(model_path):
    """A template that opens the thinking block (as DeepSeek-R1's does): the model's text goes to
    reasoning_content, in the response and in streamed deltas, and never into content."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    handler = Jinja2ChatFormatter(THINK_TEMPLATE, eos_token="<|im_end|>", bos_token="").to_chat_handler()
    with Llama(model_path=str(model_path), kv_budget=128, chat_handler=handler, n_threads=2, seed=1) as m:
        msgs = [{"role": "user", "content": "What is 6 times 7?"}]
        resp = m.create_chat_completion(messages=msgs, max_tokens=16, temperature=0)
        msg = resp["choices"][0]["message"]
        assert msg.get("reasoning_content") and msg["content"] == ""
        deltas = [c["choices"][0]["delta"] for c in m.create_chat_completion(messages=msgs, max_tokens=16,
                                                                             temperature=0, stream=True)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert not any(d.get("content") for d in deltas)


# -- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages,needle", [
    ("hello", "non-empty list"), ([], "non-empty list"), (["hi"], "must be a dict"),
    ([{"role": "wizard", "content": "x"}], "unknown role"), ([{"role": "user", "content": 5}], "content"),
    ([{"content": "x"}], "unknown role"),
])
def test_bad_messages(messages, needle):
    with pytest.raises(ConfigError, match=needle):
        check_messages(messages)


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"), ({"temperature": float("nan")}, "finite"),
    ({"stop": [""]}, "stop"), ({"tools": [{"type": "function"}]}, "not supported"), ({"seed": -1}, "seed"),
])
def test_bad_call_arguments_leave_the_object_usable(llm, kwargs, needle):
    with pytest.raises(EpikvError, match=needle):
        llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], **kwargs)
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_prompt_that_cannot_fit_is_a_budget_error_then_usable(model_path):
    with Llama(model_path=str(model_path), kv_budget=48, n_recent=16, n_threads=2) as m:
        with pytest.raises(BudgetError, match="does not fit"):
            m.create_chat_completion(messages=[{"role": "user", "content": "word " * 80}], stream=True)
        out = m.create_completion("Hi", max_tokens=3)
        assert out["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("kwargs,exc,needle", [
    ({"chat_format": "no-such-format"}, ConfigError, "unknown chat_format"),
    ({"kv_budget": 0}, ConfigError, "kv_budget"), ({"kv_policy": "h3o"}, ConfigError, "unknown policy"),
    ({"type_k": "q3_weird"}, ConfigError, "type_k"), ({"reasoning_format": "xml"}, ConfigError, "reasoning_format"),
])
def test_bad_constructor_arguments(model_path, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        Llama(model_path=str(model_path), **kwargs)


def test_not_gguf_and_unknown_keyword(tmp_path, model_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="not a GGUF"):
        Llama(model_path=str(bad))
    with pytest.raises(TypeError, match="n_ctxx"):
        Llama(model_path=str(model_path), n_ctxx=5)


# -- hub (offline, local cache) ------------------------------------------------------------------------------------
def test_from_pretrained_offline_from_a_local_hub_cache(model_path, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--epikv--smol-gguf"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snap / "smol.Q4_1.gguf").symlink_to(model_path)
    code = textwrap.dedent("""
        from epikv_local import Llama
        from epikv_local.errors import ModelError
        a = Llama.from_pretrained("epikv/smol-gguf", "smol.Q4_1.gguf", kv_budget=64, n_threads=1)
        b = Llama.from_pretrained("epikv/smol-gguf", "*.gguf", kv_budget=64, n_threads=1)
        print(a.model_path.endswith("smol.Q4_1.gguf"), b.model_path.endswith("smol.Q4_1.gguf"))
        print(a("Hello", max_tokens=2)["usage"]["completion_tokens"] <= 2)
        try:
            Llama.from_pretrained("epikv/smol-gguf", "missing.gguf")
        except ModelError as e:
            print("ModelError", "not in the Hugging Face cache" in str(e))
    """)
    r = run_py(code, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True", "ModelError", "True"]


# -- coexistence with llama_cpp ----------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["import llama_cpp, epikv_local", "import epikv_local, llama_cpp"])
def test_import_order_and_stock_llama_cpp_still_works(model_path, order):
    code = textwrap.dedent(f"""
        {order}
        from epikv_local import Llama
        stock = llama_cpp.Llama(model_path={str(model_path)!r}, n_ctx=256, verbose=False)
        print(stock("The sky is", max_tokens=3, temperature=0)["usage"]["completion_tokens"])
        ours = Llama(model_path={str(model_path)!r}, kv_budget=64, n_threads=1)
        print(ours("The sky is", max_tokens=3, temperature=0)["usage"]["completion_tokens"])
    """)
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "3"]
