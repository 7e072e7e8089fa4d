"""``epikv_local.Llama``'s surface beyond completions and chat (``api/llama_extras.py``, ``api/lowlevel.py``), on the
real default model next to stock ``llama_cpp.Llama`` in the same process (bound to the project's patched libllama):
embeddings, in-memory states and the prompt-cache hooks, the low-level eval / sample / generate loop under a small
budget (evictions happen, the budget holds), and the small accessors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from epikv_local.api.llama import Llama
from epikv_local.api.llama_state import LlamaState
from epikv_local.engine.handles import Context, Model
from epikv_local.errors import ConfigError, DataError

BUDGET = 32
PROMPT = b"Once upon a time, there was a dragon who"
TEXTS = ["Hello world, how are you?", "The sky is blue and the grass is green."]


def make(model_path, **kw) -> Llama:
    kw = {"kv_budget": BUDGET, "n_recent": 8, "n_threads": 2, "seed": 3, **kw}
    return Llama(model_path=str(model_path), **kw)


@pytest.fixture(scope="module")
def llm(model_path):
    with make(model_path) as m:
        yield m


@pytest.fixture(scope="module")
def stock(model_path):
    import llama_cpp

    return llama_cpp.Llama(str(model_path), n_ctx=256, n_threads=2, flash_attn=True, verbose=False)


@pytest.fixture(scope="module")
def stock_embed(model_path):
    import llama_cpp

    return llama_cpp.Llama(str(model_path), embedding=True, n_ctx=512, n_threads=2, flash_attn=True, verbose=False)


def greedy(gen, n: int) -> list[int]:
    out = []
    for tok in gen:
        out.append(tok)
        if len(out) == n:
            break
    gen.close()
    return out


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# -- embeddings ----------------------------------------------------------------------------------------------------
def test_embed_equals_stock_llama_cpp(llm, stock_embed):
    llm.reset()
    llm.eval(llm.tokenize(PROMPT))
    held = list(llm.session.tokens)
    assert llm.pooling_type() == stock_embed.pooling_type() == 0  # a generative model: no pooling, per token
    one = llm.embed(TEXTS[0])
    ref = stock_embed.embed(TEXTS[0])
    assert len(one) == len(llm.tokenize(TEXTS[0].encode())) and len(one[0]) == llm.n_embd() == 576
    assert max_diff(one, ref) < 1e-4
    both, count = llm.embed(TEXTS, normalize=True, return_count=True)
    for text, got in zip(TEXTS, both):  # stock per input (its NONE-pooling batch of several misreads rows)
        assert max_diff(got, stock_embed.embed(text, normalize=True)) < 1e-4
        assert np.allclose(np.linalg.norm(got, axis=-1), 1.0)
    assert count == sum(len(llm.tokenize(t.encode())) for t in TEXTS)
    assert llm.session.tokens == held  # the conversation in the budgeted cache was not touched
    resp, want = llm.create_embedding(TEXTS, model="m"), stock_embed.create_embedding(TEXTS, model="m")
    assert set(resp) == set(want) and resp["object"] == "list" and resp["model"] == "m"
    assert resp["usage"] == want["usage"] and [d["index"] for d in resp["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in resp["data"])
    assert llm.create_embedding(TEXTS[0])["model"] == llm.model_path
    with pytest.raises(ConfigError):
        llm.embed(["ok", 3])
    with pytest.raises(ConfigError, match="empty"):
        llm.embed("")


def test_mean_pooling_and_truncation_equal_stock(model_path):
    import llama_cpp

    ref = llama_cpp.Llama(str(model_path), embedding=True, n_ctx=16, n_batch=16, n_threads=2, flash_attn=True,
                          verbose=False, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    with make(model_path) as m:
        m.embedding_pooling_type, m.embedding_n_ctx = llama_cpp.LLAMA_POOLING_TYPE_MEAN, 16
        assert m.pooling_type() == ref.pooling_type() == 1 and m.pooling_type().name == "MEAN"
        long = " ".join(["one two three four five six seven eight nine ten"] * 3)  # 30 tokens
        got, n = m.embed([TEXTS[0], long], return_count=True)
        want, n_ref = ref.embed([TEXTS[0], long], return_count=True)  # stock packs both into one batch
        assert n == n_ref == len(m.tokenize(TEXTS[0].encode())) + 16 and len(got[0]) == 576 and max_diff(got, want) < 1e-4
        with pytest.raises(ConfigError, match="over the 16"):
            m.embed(long, truncate=False)
        with pytest.raises(ValueError):
            ref.embed(long, truncate=False)
        ctx = m._embedder.ctx
    assert ctx.closed  # freed with the Llama
    with pytest.raises(ConfigError, match="closed"):
        m.embed("x")


# -- states and the cache hooks -------------------------------------------------------------------------------------
def run_past_budget(llm, n: int = 30) -> None:
    llm.reset()
    llm.eval(llm.tokenize(PROMPT))
    for _ in range(n):
        llm.eval([llm.sample(temp=0)])
    st = llm.session.stats()
    assert st.n_evicted > 0 and st.max_live <= BUDGET


def test_save_and_load_state_continue_identically(llm, model_path):
    run_past_budget(llm)
    state = llm.save_state()
    assert isinstance(state, LlamaState) and state.n_tokens == llm.n_tokens == len(state.input_ids)
    assert state.input_ids.dtype == np.intc and list(state.input_ids) == llm.session.tokens
    assert state.scores.shape == (1, llm.n_vocab()) and state.llama_state_size == len(state.llama_state)
    assert state.n_evicted > 0 and state.n_live <= BUDGET and state.seed == llm.seed
    first = greedy(llm.generate(state.input_ids, temp=0), 5)
    llm.load_state(state)
    assert llm.session.tokens == list(state.input_ids) and llm.session.stats().n_live == state.n_live
    assert greedy(llm.generate(state.input_ids, temp=0), 5) == first
    llm.load_state(pickle.loads(pickle.dumps(state)))  # what LlamaDiskCache does to it
    assert llm.sample(temp=0) == first[0]  # the last token is decoded again first (llama-cpp-python's too)
    with make(model_path) as other:  # another Llama on the same model continues the same way
        other.load_state(state)
        assert greedy(other.generate(state.input_ids, temp=0), 5) == first
        assert other.session.stats().max_live <= BUDGET


def test_foreign_and_damaged_states_are_refused(llm, stock):
    stock.reset()
    stock.eval(stock.tokenize(b"Hi"))
    with pytest.raises(ConfigError, match="llama_cpp LlamaState"):
        llm.load_state(stock.save_state())
    llm.reset()
    llm.eval(llm.tokenize(PROMPT))
    state = llm.save_state()
    held = list(llm.session.tokens)
    bad = pickle.loads(pickle.dumps(state))
    bad.llama_state = state.llama_state[:-40] + bytes(40)
    with pytest.raises(DataError):
        llm.load_state(bad)
    assert llm.session.tokens == held  # left as it was


@pytest.mark.parametrize("kind", ["ram", "disk"])
def test_cache_hooks_store_and_restore_the_longest_prefix(llm, kind, tmp_path):
    from llama_cpp.llama_cache import LlamaDiskCache, LlamaRAMCache

    cache = LlamaRAMCache() if kind == "ram" else LlamaDiskCache(cache_dir=str(tmp_path / "c"))
    llm.set_cache(cache)
    try:
        run_past_budget(llm, 24)
        saved = list(llm.session.tokens)
        llm._cache_store()
        assert saved in [list(k) for k in (cache.cache_state if kind == "ram" else cache.cache.iterkeys())]
        if kind == "ram":
            assert cache.cache_size > 0
        llm.reset()
        prompt = saved + llm.tokenize(b" The end.", add_bos=False)
        assert llm._cache_lookup(prompt) is True  # the cached state shares more of the prompt than the session
        assert llm.session.tokens == saved and llm.session.stats().n_evicted > 0
        llm._cache_store(prompt)
        assert llm._cache_lookup(prompt) is False  # the session holds that prefix already
        llm.reset()
        assert llm._cache_lookup(llm.tokenize(b"Unrelated")) is False  # no common prefix: a miss
    finally:
        llm.set_cache(None)
    assert llm._cache_lookup(saved) is False and llm.cache is None


# -- the low-level loop ----------------------------------------------------------------------------------------------
def test_eval_sample_match_stock_before_any_eviction(llm, stock):
    toks = llm.tokenize(PROMPT)
    assert toks == stock.tokenize(PROMPT)
    llm.reset()
    llm.eval(toks)
    ours = []
    for _ in range(6):
        ours.append(llm.sample(temp=0, idx=llm.n_tokens - 1))
        llm.eval([ours[-1]])
    stock.reset()
    assert greedy(stock.generate(toks, temp=0), 6) == ours
    assert llm.session.stats().n_evicted == 0  # 6 tokens after a short prompt: within the budget
    assert greedy(llm.generate(toks, temp=0), 6) == ours


def test_eval_sample_under_a_small_budget(llm):
    run_past_budget(llm, 40)
    st = llm.session.stats()
    assert llm.n_tokens == st.n_past == len(llm.input_ids) > BUDGET and st.max_live <= BUDGET
    assert list(llm.eval_tokens) == llm.session.tokens and llm.input_ids.dtype == np.intc
    scores = llm.scores
    assert scores.shape == (1, llm.n_vocab()) and np.array_equal(scores[0], llm.eval_logits[0])
    best = int(np.argmax(scores[0]))
    assert llm.sample(temp=0) == best
    with pytest.raises(ConfigError, match="only the last"):
        llm.sample(idx=0)

    def ban(ids, logits):
        assert len(ids) == llm.n_tokens
        logits[best] = -np.inf
        return logits
    assert llm.sample(temp=0, logits_processor=[ban]) != best
    assert llm.sample(temp=0) == best  # the processor saw a copy: the context's logits are the model's
    llm.set_seed(11)
    a = llm.sample(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert llm.sample(temp=1.0, top_k=0, top_p=1.0, min_p=0.0) == a  # a fresh seeded chain per call
    n = llm.n_tokens
    llm.n_tokens = n - 3  # a rewind, as llama-cpp-python's
    assert llm.n_tokens == n - 3 and len(llm.input_ids) == n - 3
    llm.sample(temp=0)
    with pytest.raises(ConfigError):
        llm.n_tokens = n + 5
    llm.n_tokens = 0
    with pytest.raises(ConfigError, match="eval"):
        llm.sample()
    with pytest.raises(ConfigError):
        llm.eval([llm.n_vocab()])


def test_generate_under_a_small_budget(llm):
    prompt = llm.tokenize(PROMPT)
    llm.reset()
    toks = greedy(llm.generate(prompt, temp=0), 40)
    st = llm.session.stats()
    assert st.n_evicted > 0 and st.max_live <= BUDGET
    assert llm.session.tokens == prompt + toks[:-1]  # each yielded token is decoded before the next sample
    llm.reset()  # the same decode sequence as a completion: the same tokens, evictions and all
    text = llm.create_completion(prompt, max_tokens=40, temperature=0)["choices"][0]["text"]
    assert llm.detokenize(toks).decode("utf-8", "replace").startswith(text)

    seen = []

    def stop(ids, logits):
        seen.append((len(ids), logits.shape))
        return len(seen) == 3
    llm.reset()
    assert len(list(llm.generate(prompt, temp=0, stopping_criteria=stop))) == 2
    assert seen[0] == (len(prompt), (llm.n_vocab(),))

    gen = llm.generate(prompt, temp=0)
    first = next(gen)
    extra = llm.tokenize(b" and", add_bos=False)
    second = gen.send(extra)  # sent tokens are decoded after the yielded one
    assert llm.session.tokens[-len(extra) - 1:] == [first] + extra and isinstance(second, int)
    gen.close()
    llm.reset()
    with pytest.raises(ConfigError):
        next(llm.generate([], reset=True))


def test_generate_with_grammar_and_a_new_call_closes_it(llm):
    from llama_cpp import LlamaGrammar

    llm.reset()
    grammar = LlamaGrammar.from_string('root ::= "yes" | "no"', verbose=False)
    prompt = llm.tokenize(b"Is the sky blue? Answer:")
    toks = []
    for t in llm.generate(prompt, temp=0.8, grammar=grammar):
        if llm._model.is_eog(t):
            break
        toks.append(t)
    assert llm.detokenize(toks) in (b"yes", b"no")
    gen = llm.generate(prompt, temp=0)
    next(gen)
    llm.create_completion("Hello", max_tokens=2, temperature=0)  # supersedes the unfinished generator
    with pytest.raises(StopIteration):
        next(gen)


# -- accessors ------------------------------------------------------------------------------------------------------
def test_accessors_as_llama_cpp(llm, stock):
    from llama_cpp.llama_tokenizer import BaseLlamaTokenizer

    tk = llm.tokenizer()
    assert isinstance(tk, BaseLlamaTokenizer)
    assert tk.encode("Hi there") == stock.tokenizer().encode("Hi there") and tk.decode(tk.encode("Hi")) == "Hi"
    assert tk.tokenize(b"Hi") == stock.tokenizer().tokenize(b"Hi") and tk.detokenize(tk.tokenize(b"Hi")) == b"Hi"
    assert llm.n_embd() == stock.n_embd() and llm.token_nl() == stock.token_nl()
    a, b = [1, 2, 3, 4], [1, 2, 5]
    assert llm.longest_token_prefix(a, b) == Llama.longest_token_prefix(a, b) == stock.longest_token_prefix(a, b) == 2
    x = np.array([[1.0, 2.0, -np.inf], [0.5, 0.5, 0.5]], dtype=np.single)
    np.testing.assert_array_equal(Llama.logits_to_logprobs(x), stock.logits_to_logprobs(x))
    np.testing.assert_array_equal(Llama.logits_to_logprobs(x, axis=0), stock.logits_to_logprobs(x, axis=0))
    assert isinstance(llm.ctx, Context) and llm.ctx is llm.session.ctx and isinstance(llm.model, Model)
    llm.set_seed(5)
    assert llm.seed == 5
    with pytest.raises(ConfigError):
        llm.set_seed(-1)


def test_create_chat_completion_openai_v1(model_path):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    messages = [{"role": "user", "content": "Say hi."}]
    with make(model_path, kv_budget=96) as llm:  # the chat template's prompt alone is over 32 tokens
        chat_as_openai(llm, messages, ChatCompletion, ChatCompletionChunk)


def chat_as_openai(llm, messages, ChatCompletion, ChatCompletionChunk):
    out = llm.create_chat_completion_openai_v1(messages=messages, max_tokens=4, temperature=0)
    assert isinstance(out, ChatCompletion) and out.choices[0].message.role == "assistant"
    chunks = list(llm.create_chat_completion_openai_v1(messages=messages, max_tokens=4, temperature=0, stream=True))
    assert chunks and all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
