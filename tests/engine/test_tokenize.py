"""Tokenizing with special-token parsing (llama_tokenize, parse_special), against a reference and for scaling.

patches/0004-tokenizer-st-partition-linear.patch rewrites llama.cpp's ``tokenizer_st_partition`` (the split of
a text at special tokens) so that its cost is linear in the number of special tokens in the text instead of
quadratic. Its output must not change:

* the tokens are checked against a pure-Python port of the upstream partition (special tokens longest first,
  every occurrence of one split out of every remaining text piece, left of an LSTRIP token and right of an
  RSTRIP token ASCII whitespace dropped), whose text pieces are tokenized on their own with
  ``parse_special=False``, on hundreds of random texts (special tokens, partial ones, whitespace, unicode,
  long texts), on the real model and on three of llama.cpp's vocabulary-only GGUFs (from the pinned sdist) that
  have RSTRIP tokens (phi-3: ignoring the attribute changes the tokens of most of its random texts), an LSTRIP
  token (nomic-bert-moe's <mask>; its UGM normalizer drops the same whitespace, so LSTRIP does not show in its
  tokens) and 180 USER_DEFINED whitespace tokens (mpt);
* the scaling check compares the time of N and 8N special tokens measured side by side in one run (linear: ~8x,
  upstream's quadratic partition: ~57x), not a wall-clock threshold.
"""

from __future__ import annotations

import ctypes
import os
import random
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WS = " \t\n\v\f\r"  # C isspace() in the C locale: what the partition strips
TURN = "<|im_start|>user\nhi<|im_end|>\n"
DENSE = "<|im_start|><|im_end|>"
# llama.h enum llama_token_attr
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_LSTRIP, ATTR_RSTRIP = 1, 8, 16, 128, 256


class Vocab:
    """llama_tokenize and the special tokens of one vocabulary, in the order the partition uses them."""

    def __init__(self, nat, vocab):
        self.ll = nat.llama
        self.vocab = vocab
        self.specials = []  # (id, text, attr), longest first
        for i in range(self.ll.llama_vocab_n_tokens(vocab)):
            attr = self.ll.llama_vocab_get_attr(vocab, i)
            if attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                text = self.ll.llama_vocab_get_text(vocab, i).decode("utf-8")
                self.specials.append((i, text, attr))
        self.specials.sort(key=lambda s: -len(s[1].encode()))
        self._used: dict[bool, list] = {}

    def tokenize(self, text: str, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        arr = (ctypes.c_int32 * cap)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), arr, cap, False, parse_special)
        assert n >= 0, n
        return list(arr[:n])

    def unambiguous(self, parse_special: bool) -> list[tuple[int, str, int]]:
        """The special tokens the partition uses. Upstream orders them with std::sort by length (ties in an
        unspecified order); the reference is exact when no two of equal length can overlap in a text."""
        if parse_special not in self._used:
            used = [s for s in self.specials if parse_special or not s[2] & (ATTR_CONTROL | ATTR_UNKNOWN)]
            for a in used:
                for b in used:
                    if a is not b and len(a[1].encode()) == len(b[1].encode()):
                        assert not any(a[1].endswith(b[1][:k]) for k in range(1, len(b[1]))), (a, b)
            self._used[parse_special] = used
        return self._used[parse_special]

    def reference(self, text: str, parse_special: bool) -> list[int]:
        """Upstream's partition in Python, then each text piece tokenized alone (the tokenizers handle each
        piece independently: BPE/UGM/WPM per piece; SPM prefixes a space after a special token or at the
        start, and every text piece is at the start or after a special token)."""
        frags: list[str | int] = [text] if text else []
        for tid, tok, attr in self.unambiguous(parse_special):
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                pos = 0
                while (m := f.find(tok, pos)) >= 0:
                    left = f[pos:m]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(WS)
                    if left:
                        out.append(left)
                    out.append(tid)
                    pos = m + len(tok)
                    if attr & ATTR_RSTRIP:
                        while pos < len(f) and f[pos] in WS:
                            pos += 1
                if f[pos:]:
                    out.append(f[pos:])
            frags = out
        toks: list[int] = []
        for f in frags:
            toks += [f] if isinstance(f, int) else self.tokenize(f, parse_special=False)
        return toks


def random_text(rng: random.Random, specials: list[str], n_max: int = 40) -> str:
    """A mixture of special tokens, broken ones, whitespace (also around the tokens), words and unicode."""
    words = ["hi", "user", "assistant", "Hello, world!", "x = 5", "<", ">", "|", "<|", "|>", "</", "im", "_",
             "é", "中文", "日本語のテキスト", "🎉", "e\u0301", "\u00a0", "\u3000", "Ω≈ç", "\U0001f600\U0001f64f",
             "’"]
    spaces = [" ", "  ", "\n", "\t", "\r\n", " \n ", "\v", "\f", "\n\n"]
    parts = []
    for _ in range(rng.randint(0, n_max)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(specials))
        elif r < 0.5:  # a partial special token: a prefix, a suffix or one with a character dropped
            s = rng.choice(specials)
            k = rng.randint(1, max(1, len(s) - 1))
            parts.append(rng.choice([s[:k], s[k:], s[:k - 1] + s[k:]]))
        elif r < 0.7:
            parts.append(rng.choice(spaces))
        else:
            parts.append(rng.choice(words))
    return "".join(parts)


FIXED = ["", " ", "\n", "<|im_start|>", "<|im_start|><|im_end|>", "<|im_start|><|im_start|><|im_start|>",
         "<|im_<|im_end|>start|>", "<|im_start", "im_start|>", "a<|im_start|>b", "<|im_start|>user\nhi<|im_end|>\n",
         " <|im_end|> ", "\n\n<|im_end|>\n\n", "<|endoftext|><|im_end|>x<|im_start|>", "<<|im_end|>>",
         TURN * 50, "é<|im_end|>中文<|im_start|>🎉", "<|im_start|>" * 100 + "tail"]


def check_texts(v: Vocab, texts: list[str], parse_special: bool = True) -> int:
    bad = [t for t in texts if v.tokenize(t, parse_special) != v.reference(t, parse_special)]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ from the reference, e.g. {bad[:3]!r}"
    return len(texts)


@pytest.fixture(scope="module")
def smollm(nat, model):
    return Vocab(nat, model.vocab)


def test_tokens_match_the_reference_partition_on_the_model(smollm):
    assert len(smollm.specials) >= 10  # SmolLM2: 17 control tokens
    rng = random.Random(4)
    specials = [s[1] for s in smollm.specials]
    texts = FIXED + [random_text(rng, specials) for _ in range(400)] \
        + [random_text(rng, specials, n_max=3000) for _ in range(5)]
    assert check_texts(smollm, texts) == len(texts)
    # Model.tokenize (the product's entry point) is the same call
    assert smollm.tokenize(TURN * 3, True) == smollm.reference(TURN * 3, True)


def test_chat_text_tokens(model, smollm):
    toks = model.tokenize(TURN * 1000, add_special=False, parse_special=True)
    assert toks == smollm.reference(TURN * 1000, True)
    ids = {s[1]: s[0] for s in smollm.specials}
    assert toks.count(ids["<|im_start|>"]) == 1000 and toks.count(ids["<|im_end|>"]) == 1000


def sdist_path() -> Path:
    explicit = os.environ.get("EPIKV_LLAMA_SDIST")
    if explicit:
        return Path(explicit)
    line = next(ln for ln in (REPO / "patches" / "SOURCE").read_text().splitlines()
                if ln.strip() and not ln.startswith("#"))
    base = os.environ.get("EPIKV_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "epikv-local"
    return Path(base) / "sdist" / line.split()[1]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    """llama.cpp's vocabulary-only GGUFs (models/ggml-vocab-*.gguf of the pinned sdist)."""
    sdist = sdist_path()
    if not sdist.is_file():
        pytest.fail(f"the llama-cpp-python sdist the build used is missing: {sdist}")
    out = tmp_path_factory.mktemp("vocab")
    names = ("phi-3", "nomic-bert-moe", "mpt")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if any(m.name.endswith(f"models/ggml-vocab-{n}.gguf") for n in names)]
        tf.extractall(out, members=members, filter="data")
    files = {n: next(out.rglob(f"ggml-vocab-{n}.gguf")) for n in names}
    return files


@pytest.fixture
def load_vocab(nat, vocab_files):
    ll, handles = nat.llama, []

    def load(name):
        params = ll.llama_model_default_params()
        params.vocab_only = True
        m = ll.llama_model_load_from_file(str(vocab_files[name]).encode(), params)
        assert m, f"llama.cpp could not load {vocab_files[name]}"
        handles.append(m)
        return Vocab(nat, ll.llama_model_get_vocab(m))

    yield load
    for m in handles:
        ll.llama_model_free(m)


@pytest.mark.parametrize("name,attr", [("phi-3", ATTR_RSTRIP), ("nomic-bert-moe", ATTR_LSTRIP), ("mpt", 0)])
def test_tokens_match_the_reference_partition_on_other_vocabularies(load_vocab, name, attr):
    v = load_vocab(name)
    if attr:  # the strip attributes llama.cpp sets by model name: exercised here
        assert any(s[2] & attr for s in v.specials), f"{name}: no special token has attribute {attr}"
    else:
        assert any(s[2] & ATTR_USER_DEFINED for s in v.specials), f"{name}: no user-defined token"
    rng = random.Random(name)
    # the tokens a text is most likely to contain, plus the strip ones; the vocabularies have many more
    pool = [s[1] for s in v.specials if s[2] & (ATTR_LSTRIP | ATTR_RSTRIP)][:20] + \
        [s[1] for s in v.specials[-40:]] + [s[1] for s in rng.sample(v.specials, min(20, len(v.specials)))]
    texts = FIXED + [random_text(rng, pool) for _ in range(200)] + [random_text(rng, pool, n_max=1500)]
    check_texts(v, texts, parse_special=True)
    check_texts(v, texts[:80], parse_special=False)  # user-defined tokens are split out even then


def test_special_token_partition_scales_linearly(model):
    """N and 8N special tokens back to back, alternated in one run, best of 5 each: linear gives ~8x (measured
    7.5-14x), the quadratic upstream partition ~57x (N = 2000: 0.06 s vs 3.5 s). The bound (8 x 3) leaves a
    wide margin on both sides for a loaded machine. The tokens have no text between them: in a chat text the
    tokenizer's per-piece cost (a std::regex compiled per text piece, linear) hides the quadratic term at sizes
    a test can afford."""
    n = 2000
    small, large = DENSE * n, DENSE * (8 * n)
    model.tokenize(small, add_special=False, parse_special=True)  # warm-up
    t_small, t_large = [], []
    for _ in range(5):
        for text, times in ((small, t_small), (large, t_large)):
            t0 = time.perf_counter()
            toks = model.tokenize(text, add_special=False, parse_special=True)
            times.append(time.perf_counter() - t0)
            assert len(toks) == len(text) // len(DENSE) * 2
    ratio = min(t_large) / min(t_small)
    assert ratio < 24, f"tokenizing {16 * n} special tokens took {ratio:.1f}x the time of {2 * n} (linear: ~8): " \
                       f"{min(t_small):.4f} s vs {min(t_large):.4f} s"


def test_max_piece_bytes_bounds_the_token_count_from_below(model):
    """The bound the prompt-size check relies on: no text tokenizes to fewer than bytes / max_piece_bytes tokens
    (random mixtures of words, special tokens, long whitespace runs, U+2581, digits and non-ASCII)."""
    longest = model.max_piece_bytes()
    assert longest is not None and longest >= max(len(model.token_bytes(t, special=True)) for t in range(200))
    parts = ["hello", " world", "<|im_start|>", "<|im_end|>", "\n", " " * 64, "\t\t", "\u2581" * 5, "1234567",
             "ééé", "日本語", "\U0001f600", "http://example.com/a/b?c=d", "=" * 40, "<think>", "</think>"]
    rnd = random.Random(5)
    for _ in range(300):
        text = "".join(rnd.choice(parts) for _ in range(rnd.randint(1, 60)))
        n_bytes = len(text.encode())
        for special in (True, False):
            n = len(model.tokenize(text, add_special=False, parse_special=special))
            assert n * longest >= n_bytes, (text, n, n_bytes, longest)
