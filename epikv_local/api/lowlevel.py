"""llama-cpp-python's low-level loop over the budgeted cache, as a mixin of ``epikv_local.Llama`` (through
:class:`~epikv_local.api.llama_extras.LlamaExtras`): ``eval`` / ``sample`` / ``generate``, ``n_tokens``,
``input_ids``, ``scores``, ``eval_tokens``, ``eval_logits``.

The difference from llama-cpp-python: its positions are the token indices of a dense cache of n_ctx cells;
here ``eval`` decodes through ``Session.feed``, which evicts so that the live cells never exceed kv_budget,
and positions keep counting past it (``n_tokens`` can exceed ``n_ctx()``). Only the logits of the last decoded
token are kept (llama-cpp-python's ``logits_all=False``): ``sample(idx=...)`` and ``scores`` offer that row.
"""

from __future__ import annotations

import collections
from typing import Iterator, Sequence

import numpy as np

from ..engine.sampling import MAX_SEED, SamplingConfig
from ..errors import ConfigError, NativeError

#: llama-cpp-python's ``last_n_tokens_size`` default: the tokens its penalties look back over
LAST_N_TOKENS = 64


def grammar_text(grammar) -> tuple[str | None, str]:
    """(GBNF text, root rule) of a ``llama_cpp.LlamaGrammar`` (or of GBNF text), or (None, "root")."""
    if grammar is None:
        return None, "root"
    if isinstance(grammar, str):
        return grammar, "root"
    text = getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise ConfigError(f"grammar must be a llama_cpp.LlamaGrammar or GBNF text, got {type(grammar).__name__}")
    return text, getattr(grammar, "_root", "root") or "root"


class LowLevel:
    """Mixed into ``Llama`` (see the module docstring); uses its ``session``, ``seed`` and ``_lock``."""

    #: (session, n_past, decode seconds) when the logits stopped matching the last token (a loaded state, a
    #: rewind): sampling first decodes that token again, as llama-cpp-python's ``_requires_eval`` does
    _stale_at = None

    # -- what the session holds -----------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Positions decoded (evicted ones included). Setting it lower rewinds the sequence, as in
        llama-cpp-python; tokens just before the new end that were evicted are decoded again."""
        return self.session.n_past

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        session = self.session
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= session.n_past:
            raise ConfigError(f"n_tokens can only be lowered (0..{session.n_past}), got {n!r}")
        n = int(n)
        if n == session.n_past:
            return
        self._supersede()
        if n == 0:
            session.reset()
            return
        keep = list(session.tokens[:n])
        # the sentinel is never compared: rewind_to_prefix keeps at most len(tokens) - 1 of them
        start = session.rewind_to_prefix(keep + [-1])
        session.feed(keep[start:])
        if start == n:  # nothing decoded: the logits are those of a token that is gone
            self._stale_at = self._logits_mark()

    @property
    def input_ids(self) -> np.ndarray:
        """(n_tokens,) intc: the token at each position (a copy). llama-cpp-python's is an (n_ctx,) buffer whose
        first n_tokens entries are these."""
        return np.asarray(self.session.tokens, dtype=np.intc)

    @property
    def _input_ids(self) -> np.ndarray:
        return self.input_ids

    @property
    def scores(self) -> np.ndarray:
        """(1, n_vocab) float32: the logits of the last decoded token (a copy), or (0, n_vocab) before any.
        llama-cpp-python's is (n_ctx, n_vocab), filled only with ``logits_all=True``."""
        row = self._last_logits()
        n_vocab = self._open_model.info.n_vocab
        return row[None, :].copy() if row is not None else np.zeros((0, n_vocab), dtype=np.single)

    @property
    def eval_tokens(self) -> collections.deque:
        """The tokens of every position (a deque; llama-cpp-python bounds it at n_ctx, positions here run on)."""
        return collections.deque(self.session.tokens)

    @property
    def eval_logits(self) -> collections.deque:
        """A deque (maxlen 1) with the last token's logits as a list, as llama-cpp-python's with
        ``logits_all=False`` (whose row stays zeros; this one holds the logits)."""
        row = self._last_logits()
        return collections.deque([row.tolist()] if row is not None else [], maxlen=1)

    # -- eval / sample / generate -----------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` at the next positions (``Session.feed``: in chunks of n_batch, evicting first so that
        the live cells stay within kv_budget). Supersedes a stream still being read, as every call does."""
        tokens = self._token_ids(tokens)
        self._supersede()
        self.session.feed(tokens)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx: int | None = None) -> int:
        """A token id from the last decode's logits, with a fresh sampler chain of these settings (llama-cpp-
        python's order; ``tfs_z`` and ``penalize_nl`` are ignored there too). idx: None or n_tokens - 1 (only
        the last token's logits are kept). logits_processor(input_ids, logits) -> logits is applied to a
        copy of the row: the context's logits stay the model's."""
        session = self.session
        if session.n_past == 0:
            raise ConfigError("sample() needs a decoded token: eval() the prompt first")
        if idx is not None and idx != session.n_past - 1:
            raise ConfigError(f"sample(idx={idx}): only the last token's logits (idx={session.n_past - 1}) are "
                              "kept (llama-cpp-python's logits_all=False)")
        cfg = self._lowlevel_sampling(top_k, top_p, min_p, typical_p, temp, repeat_penalty, frequency_penalty,
                                      presence_penalty, mirostat_mode, mirostat_eta, mirostat_tau, grammar)
        self._refresh_logits()
        with session.sampling(cfg) as sampler:
            return self._draw(sampler, logits_processor)

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None,
                 grammar=None) -> Iterator[int]:
        """A generator of sampled token ids, as llama-cpp-python's: with ``reset`` (default) the longest common
        prefix of ``tokens`` and what the session holds is kept (``Session.rewind_to_prefix``: evictions and
        all) and only the rest is decoded; without it ``tokens`` go at the next positions. Each yielded token
        is decoded before the next sample; ``gen.send(ids)`` decodes ``ids`` after it too. One sampler chain for
        the whole generation (penalties see the generated tokens, grammar state advances).
        stopping_criteria(input_ids, logits) -> True ends it before the token is yielded (input_ids: the
        decoded tokens; logits: the (n_vocab,) row the token was drawn from). Evicts as needed."""
        session = self.session
        tokens = self._token_ids(tokens)
        if not tokens and (reset or session.n_past == 0):
            raise ConfigError("generate() needs prompt tokens (or reset=False to continue the held sequence)")
        cfg = self._lowlevel_sampling(top_k, top_p, min_p, typical_p, temp, repeat_penalty, frequency_penalty,
                                      presence_penalty, mirostat_mode, mirostat_eta, mirostat_tau, grammar)
        gen = self._generate(session, tokens, cfg, reset, logits_processor, stopping_criteria)
        # registered as the Llama's active stream: a later call closes it instead of sharing the sequence
        self._supersede(gen)
        return gen

    def _generate(self, session, tokens: list[int], cfg: SamplingConfig, reset: bool, logits_processor,
                  stopping_criteria) -> Iterator[int]:
        with session.generation(), session.sampling(cfg) as sampler:
            pending = tokens[session.rewind_to_prefix(tokens):] if reset else tokens
            # the first tokens are a prompt: protected when they start the sequence (as a completion's prompt)
            session.feed(pending, is_prompt=True)
            while True:
                if not pending:
                    self._refresh_logits()
                tok = self._draw(sampler, logits_processor)
                if stopping_criteria is not None and stopping_criteria(self.input_ids, session.logits().copy()):
                    return
                sent = yield tok
                pending = [tok] + (self._token_ids(sent) if sent is not None else [])
                session.feed(pending)

    # -- helpers ----------------------------------------------------------------------------------------------
    def _lowlevel_sampling(self, top_k, top_p, min_p, typical_p, temp, repeat_penalty, frequency_penalty,
                           presence_penalty, mirostat_mode, mirostat_eta, mirostat_tau, grammar) -> SamplingConfig:
        text, root = grammar_text(grammar)
        # penalize_prompt=False: llama-cpp-python's penalties see only the tokens its chain sampled
        return SamplingConfig(
            temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
            repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            penalty_last_n=LAST_N_TOKENS, penalize_prompt=False, mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=text, grammar_root=root,
            seed=self.seed if 0 <= self.seed <= MAX_SEED else MAX_SEED)

    def _draw(self, sampler, logits_processor) -> int:
        """Sample with ``sampler`` from the last row, through the logits processors (a list of them, or one)."""
        session = self.session
        if logits_processor is None:
            return session.sample(sampler)
        procs = logits_processor if isinstance(logits_processor, (list, tuple)) else [logits_processor]
        row = session.logits()  # a view of the context's row: the sampler chain reads it from there
        saved = row.copy()
        try:
            ids, scores = self.input_ids, row.copy()
            for proc in procs:
                scores = proc(ids, scores)
            row[:] = scores
            return session.sample(sampler)
        finally:
            row[:] = saved

    def _token_ids(self, tokens) -> list[int]:
        """``tokens`` (any iterable of ints, e.g. a list or an intc array) as a checked list of token ids."""
        try:
            if isinstance(tokens, (str, bytes)):
                raise TypeError
            tokens = list(tokens)
        except TypeError:
            raise ConfigError(f"tokens must be a sequence of token ids, got {type(tokens).__name__}") from None
        n_vocab = self._open_model.info.n_vocab
        out = [int(t) for t in tokens if isinstance(t, (int, np.integer)) and not isinstance(t, bool)]
        if len(out) != len(tokens) or any(not 0 <= t < n_vocab for t in out):
            raise ConfigError(f"token ids must be integers in 0..{n_vocab - 1}, got {list(tokens)[:8]}")
        return out

    def _logits_mark(self) -> tuple:
        s = self.session
        return id(s), s.n_past, s.decode_seconds  # decode_seconds grows with every decode

    def _logits_stale(self) -> bool:
        return self._stale_at is not None and self._stale_at == self._logits_mark()

    def _last_logits(self) -> np.ndarray | None:
        """The (n_vocab,) logits row of the last decoded token (a view), or None when there is none."""
        session = self.session
        if session.n_past == 0 or self._logits_stale():
            return None
        try:
            return session.logits()
        except NativeError:  # the context has no output row (no decode since it was created)
            return None

    def _refresh_logits(self) -> None:
        """Decode the last token again when its logits are not in the context (a state just loaded, a rewind)."""
        session = self.session
        if self._last_logits() is not None:
            return
        toks = list(session.tokens)
        start = session.rewind_to_prefix(toks)  # keeps all but the last token (fewer when those were evicted)
        session.feed(toks[start:])
        self._stale_at = None

    def _supersede(self, gen=None) -> None:
        """End the Llama's stream still being read (as each of its calls does) and make ``gen`` the active one."""
        with self._lock:
            self._generation = getattr(self, "_generation", 0) + 1
            close = getattr(self, "_close_active", None)
            if close is not None:
                close()
            self._active = gen
