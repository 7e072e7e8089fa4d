"""Sampling settings and the llama.cpp sampler chain built from them (``llama_sampler_*``, like
llama-cpp-python's ``_internals.LlamaSampler``). A :class:`Sampler` is created and owned by a Session
(``Session.sampling``), which frees it with the context it samples from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .handles import Closing, Model
from ..errors import ConfigError

#: llama.cpp's sampler seed is a uint32
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class SamplingConfig:
    """llama.cpp's sampler settings, in llama.cpp's order: logit bias, penalties, top-k, typical, top-p, min-p,
    temperature, then a seeded draw (or greedy when temperature <= 0).

    top_k <= 0 / top_p >= 1 / min_p <= 0 / typical_p >= 1: disabled. Penalties (1.0 / 0.0: off) look at the
    last ``penalty_last_n`` tokens (prompt tail included). seed: 0 .. 2^32 - 1 (2^32 - 1 = a random seed, as
    in llama.cpp). logit_bias: {token id: bias added to its logit}.
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
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        try:
            bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if any(not math.isfinite(b) and b != -math.inf for _, b in bias):
            raise ConfigError("logit_bias values must be finite (or -inf to ban a token)")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty"):
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

    @property
    def uses_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class Sampler(Closing):
    """A llama.cpp sampler chain (owned; context manager)."""

    def __init__(self, model: Model, cfg: SamplingConfig):
        ll = model.nat.llama
        self.ll = ll
        params = ll.llama_sampler_chain_default_params()
        self.chain = ll.llama_sampler_chain_init(params)
        add = lambda smpl: ll.llama_sampler_chain_add(self.chain, smpl)  # noqa: E731  (the chain owns it)
        #: how many tokens of the prompt the penalties should see (``accept``)
        self.history = 0
        if cfg.logit_bias:
            n_vocab = model.info.n_vocab
            bad = [t for t, _ in cfg.logit_bias if not 0 <= t < n_vocab]
            if bad:
                self.close()
                raise ConfigError(f"logit_bias names token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
            arr = (ll.llama_logit_bias * len(cfg.logit_bias))(*[ll.llama_logit_bias(t, b) for t, b in cfg.logit_bias])
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(cfg.logit_bias), arr))
        if cfg.uses_penalties:
            # this llama.cpp's llama.h takes n_vocab first (llama-cpp-python's binding declares it too)
            add(ll.llama_sampler_init_penalties(model.info.n_vocab, cfg.penalty_last_n, cfg.repeat_penalty,
                                                cfg.frequency_penalty, cfg.presence_penalty))
            self.history = cfg.penalty_last_n if cfg.penalty_last_n >= 0 else 1 << 30
        if cfg.temperature <= 0:
            add(ll.llama_sampler_init_greedy())
        else:
            if cfg.top_k > 0:
                add(ll.llama_sampler_init_top_k(cfg.top_k))
            if cfg.typical_p < 1.0:
                add(ll.llama_sampler_init_typical(cfg.typical_p, 1))
            if cfg.top_p < 1.0:
                add(ll.llama_sampler_init_top_p(cfg.top_p, 1))
            if cfg.min_p > 0.0:
                add(ll.llama_sampler_init_min_p(cfg.min_p, 1))
            add(ll.llama_sampler_init_temp(cfg.temperature))
            add(ll.llama_sampler_init_dist(cfg.seed))

    def accept(self, tokens) -> None:
        """Let the chain see tokens it did not sample (the prompt's tail, for the penalties)."""
        if self.history:
            for t in tokens:
                self.ll.llama_sampler_accept(self.chain, int(t))

    def sample(self, ctx_handle) -> int:
        """The next token from the last output row of the context's last decode."""
        if self.chain is None:
            raise ConfigError("sampler is closed")
        return int(self.ll.llama_sampler_sample(self.chain, ctx_handle, -1))

    def close(self) -> None:
        if self.chain is not None:
            self.ll.llama_sampler_free(self.chain)
            self.chain = None

