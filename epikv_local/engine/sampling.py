"""Sampling settings and the llama.cpp sampler chain built from them (``llama_sampler_*``, like
llama-cpp-python's ``_internals.LlamaSampler``). A :class:`Sampler` is created and owned by a Session
(``Session.sampling``), which frees it with the context it samples from.

The chain is llama-cpp-python's (``Llama._init_sampler``, 0.3.36), so that the same settings and seed draw the
same tokens: logit bias, penalties, grammar, then greedy (temperature 0), a plain seeded draw (temperature < 0),
mirostat 1 / 2, or top-k, typical, top-p, min-p, temperature and a seeded draw.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, utf8
from .handles import Closing, Model

#: llama.cpp's sampler seed is a uint32
MAX_SEED = 2**32 - 1
#: llama.cpp's default grammar root rule
GRAMMAR_ROOT = "root"
#: mirostat v1's m (tokens used to estimate s_hat), as llama-cpp-python sets it
MIROSTAT_M = 100


@dataclass(frozen=True)
class SamplingConfig:
    """llama.cpp's sampler settings (llama-cpp-python's names and meanings).

    temperature: 0 greedy; < 0 a seeded draw from the unmodified distribution; > 0 the top-k ... chain.
    top_k <= 0 / top_p >= 1 / min_p <= 0 / typical_p >= 1: disabled. Penalties (1.0 / 0.0: off) look at the
    last ``penalty_last_n`` tokens: the generated ones, and with ``penalize_prompt`` the prompt's tail too (as
    llama.cpp's own tools do; llama-cpp-python penalizes generated tokens only). seed: 0 .. 2^32 - 1
    (2^32 - 1 = a random seed, as in llama.cpp). logit_bias: {token id: bias added to its logit}.
    mirostat_mode: 0 off, 1 or 2 (mirostat / mirostat 2.0 with ``mirostat_tau`` and ``mirostat_eta``; they
    replace top-k ... temperature). grammar: a GBNF grammar (text) every sampled token must follow, with
    ``grammar_root`` as its start rule.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    penalize_prompt: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    grammar: str | None = None
    grammar_root: str = GRAMMAR_ROOT

    def __post_init__(self):
        given = self.logit_bias
        try:
            bias = tuple((int(t), float(b)) for t, b in (given.items() if isinstance(given, dict) else given))
        except (TypeError, ValueError, AttributeError):
            raise ConfigError(f"logit_bias must map token ids to numbers, got {given!r:.200}") from None
        if any(not math.isfinite(b) and b != -math.inf for _, b in bias):
            raise ConfigError("logit_bias values must be finite (or -inf to ban a token)")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty", "mirostat_tau", "mirostat_eta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k > 2**31 - 1:
            raise ConfigError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in 0..{MAX_SEED}, got {self.seed!r}")
        if not 0.0 <= self.min_p <= 1.0 or not 0.0 < self.typical_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1] and typical_p in (0, 1], got {self.min_p}, {self.typical_p}")
        if self.repeat_penalty <= 0:
            raise ConfigError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if isinstance(self.penalty_last_n, bool) or not isinstance(self.penalty_last_n, int) or not (
                -1 <= self.penalty_last_n <= 2**31 - 1):
            raise ConfigError(f"penalty_last_n must be an integer >= -1, got {self.penalty_last_n!r}")
        if self.mirostat_mode not in (0, 1, 2) or isinstance(self.mirostat_mode, bool):
            raise ConfigError(f"mirostat_mode must be 0, 1 or 2, got {self.mirostat_mode!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ConfigError("grammar must be a non-empty GBNF text")
        if not isinstance(self.grammar_root, str) or not self.grammar_root:
            raise ConfigError(f"grammar_root must be a rule name, got {self.grammar_root!r}")
        for name in ("grammar", "grammar_root"):
            utf8(getattr(self, name) or "", name)

    @property
    def uses_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)


class Sampler(Closing):
    """A llama.cpp sampler chain (owned; context manager). Sampling a token also feeds it to every sampler of
    the chain (``llama_sampler_sample`` accepts it: the penalties' history, the grammar's state)."""

    def __init__(self, model: Model, cfg: SamplingConfig):
        ll = model.nat.llama
        self.ll = ll
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self._penalties = None  # the chain's penalties sampler, fed the prompt's tail (``accept``)
        #: how many tokens of the prompt the penalties should see (``accept``)
        self.history = 0
        try:
            self._build(model, cfg)
        except BaseException:
            self.close()
            raise

    def _add(self, smpl) -> None:
        if not smpl:
            raise ConfigError("llama.cpp refused a sampler setting")
        self.ll.llama_sampler_chain_add(self.chain, smpl)  # the chain owns it from now on

    def _build(self, model: Model, cfg: SamplingConfig) -> None:
        ll, add, n_vocab = self.ll, self._add, model.info.n_vocab
        if cfg.logit_bias:
            bad = [t for t, _ in cfg.logit_bias if not 0 <= t < n_vocab]
            if bad:
                raise ConfigError(f"logit_bias names token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
            arr = (ll.llama_logit_bias * len(cfg.logit_bias))(*[ll.llama_logit_bias(t, b) for t, b in cfg.logit_bias])
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(cfg.logit_bias), arr))
        if cfg.uses_penalties:
            # this llama.cpp's llama.h takes n_vocab first (llama-cpp-python's binding declares it too)
            self._penalties = ll.llama_sampler_init_penalties(n_vocab, cfg.penalty_last_n, cfg.repeat_penalty,
                                                              cfg.frequency_penalty, cfg.presence_penalty)
            add(self._penalties)
            if cfg.penalize_prompt:
                self.history = cfg.penalty_last_n if cfg.penalty_last_n >= 0 else 1 << 30
        if cfg.grammar is not None:
            smpl = ll.llama_sampler_init_grammar(model.vocab, cfg.grammar.encode("utf-8"),
                                                 cfg.grammar_root.encode("utf-8"))
            if not smpl:
                raise ConfigError(f"the grammar does not parse (or has no rule {cfg.grammar_root!r}): "
                                  f"{model.nat.log.recent_errors() or 'llama.cpp refused it'}")
            add(smpl)
        if cfg.temperature == 0:
            add(ll.llama_sampler_init_greedy())
        elif cfg.temperature < 0:
            add(ll.llama_sampler_init_dist(cfg.seed))
        elif cfg.mirostat_mode == 1:
            add(ll.llama_sampler_init_mirostat(n_vocab, cfg.seed, cfg.mirostat_tau, cfg.mirostat_eta, MIROSTAT_M))
        elif cfg.mirostat_mode == 2:
            add(ll.llama_sampler_init_mirostat_v2(cfg.seed, cfg.mirostat_tau, cfg.mirostat_eta))
        else:
            add(ll.llama_sampler_init_top_k(cfg.top_k))
            add(ll.llama_sampler_init_typical(cfg.typical_p, 1))
            add(ll.llama_sampler_init_top_p(cfg.top_p, 1))
            add(ll.llama_sampler_init_min_p(cfg.min_p, 1))
            add(ll.llama_sampler_init_temp(cfg.temperature))
            add(ll.llama_sampler_init_dist(cfg.seed))

    def accept(self, tokens) -> None:
        """Let the penalties see tokens they did not sample (the prompt's tail, with ``penalize_prompt``)."""
        if self.history and self._penalties is not None:
            for t in tokens:
                self.ll.llama_sampler_accept(self._penalties, int(t))

    def accept_generated(self, tokens) -> None:
        """Tokens put into the generation without sampling (a forced ``</think>``): the penalties see them as
        if sampled. The grammar does not (it would reject text outside it: callers do not force under one)."""
        penalties = self._penalties
        if penalties is not None:
            for t in tokens:
                self.ll.llama_sampler_accept(penalties, int(t))

    def sample(self, ctx_handle, idx: int = -1) -> int:
        """The next token from output row ``idx`` of the context's last decode (llama.h's batch index; -1: the
        last output), accepted by the chain."""
        if self.chain is None:
            raise ConfigError("sampler is closed")
        return int(self.ll.llama_sampler_sample(self.chain, ctx_handle, idx))

    def sample_row(self, logits: np.ndarray) -> int:
        """The next token from a kept (n_vocab,) float32 row of logits (the context has decoded since): what
        ``llama_sampler_sample`` does with a context's row (every token a candidate, the chain applied, the
        selected token accepted), so both give the same token for the same row and chain state."""
        if self.chain is None:
            raise ConfigError("sampler is closed")
        ll = self.ll
        n = len(logits)
        data = (ll.llama_token_data * n)()
        view = np.ctypeslib.as_array(data)
        view["id"] = np.arange(n, dtype=np.int32)
        view["logit"] = logits
        view["p"] = 0.0
        cur = ll.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
        ll.llama_sampler_apply(self.chain, ctypes.byref(cur))
        if not 0 <= cur.selected < n:
            raise ConfigError(f"the sampler chain selected no token (selected={cur.selected})")
        token = int(data[cur.selected].id)
        ll.llama_sampler_accept(self.chain, token)
        return token

    def close(self) -> None:
        if getattr(self, "chain", None) is not None:
            self.ll.llama_sampler_free(self.chain)
            self.chain = None
            self._penalties = None
