"""The generation loop (the only one): ``generate_step`` -> ``stream_generate`` -> ``generate``.

``generate_step`` yields token ids (prefill, then sample/decode one token at a time, evicting as needed);
``stream_generate`` turns them into :class:`GenerationResponse` items, as mlx-lm's ``stream_generate`` does:
one per sampled token, each with the text it completed and a snapshot of the generation's and the session's
statistics; the last one has a ``finish_reason``. ``generate`` collects the text and the statistics of the
last item. Positions are dense token indices; evicted positions leave holes in the cache, so
llama-cpp-python's high-level ``Llama`` (which assumes dense positions) is not used. Sampling settings and the
sampler chain live in :mod:`epikv_local.engine.sampling`, prompts in :mod:`.chat`.

A reasoning budget (:class:`ReasoningBudget`) caps the tokens generated inside an open ``<think>`` block: once
it is spent, the closing tag's tokens are forced into the sequence as if generated (``generate_step``'s
``forced`` hook), decoded through the same session step as a sampled token, so eviction, statistics and the
stream see them like any other token.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from ..engine.sampling import Sampler, SamplingConfig
from ..engine.session import Session
from ..errors import INTERRUPTED, ConfigError
from .reasoning import CLOSE, OPEN

#: why a generation ended: an end-of-generation token, a stop string or ``stopping_criteria``, or ``max_tokens``
FINISH_REASONS = ("eog", "stop", "max_tokens")


@dataclass
class GenerationStats:
    """One generation, as of the item that carries it. Units: tokens, cells, bytes, seconds.

    n_evicted / n_rounds-like figures of the session are totals since the session's last reset;
    ``n_evicted_call`` is the share of ``n_evicted`` that happened during this generation.
    """

    policy: str
    kv_budget: int
    n_prompt_tokens: int = 0
    n_prompt_reused: int = 0  # prompt tokens already in the cache (common prefix with the previous turn)
    n_generated_tokens: int = 0
    n_evicted: int = 0
    n_evicted_call: int = 0
    n_live_cells: int = 0
    max_live_cells: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    kv_bytes: int = 0
    n_ctx: int = 0
    flash_attn: bool = False
    capture_route: str | None = None
    layers: list[int] = field(default_factory=list)
    stop_reason: str = ""
    n_reasoning_tokens: int = 0  # generated inside the open <think> block (a forced closing tag not counted)
    reasoning_forced_close: bool = False  # the reasoning budget ran out and </think> was forced

    @property
    def decode_tokens_per_s(self) -> float:
        return self.n_generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def n_prompt_decoded(self) -> int:
        return self.n_prompt_tokens - self.n_prompt_reused

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.n_prompt_decoded / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 3)
        d["prefill_tokens_per_s"] = round(self.prefill_tokens_per_s, 3)
        d["n_prompt_decoded"] = self.n_prompt_decoded
        return d


@dataclass(frozen=True)
class GenerationResponse:
    """One item of :func:`stream_generate`: one sampled token.

    token: the token id. The last item of a generation that ended at an end-of-generation token carries that
        token, which is not part of the generated text or counts (as in mlx-lm).
    text: the characters this token completed (may be empty: partial UTF-8, or text held back while it could
        still start a stop string; the last item carries whatever was held).
    finish_reason: None until the last item: "eog", "stop" (a stop string or ``stopping_criteria``) or
        "max_tokens".
    stats: the statistics as of this item (a snapshot: later items do not change it).
    logits: (n_vocab,) float32 raw logits this token was sampled from (before any logits processor), only
        when ``stream_generate(want_logits=True)``; else None.
    """

    token: int
    text: str
    finish_reason: str | None
    stats: GenerationStats
    logits: np.ndarray | None = None

    @property
    def generated(self) -> bool:
        """Whether ``token`` is part of the generation (False only for a final end-of-generation token)."""
        return self.finish_reason != "eog"


def generate_step(session: Session, prompt_tokens: list[int], sampler: Sampler, reuse_prefix: bool = False,
                  on_prefilled: Callable[[int, float], None] | None = None,
                  on_logits: Callable[[np.ndarray], None] | None = None,
                  forced: Callable[[], int | None] | None = None,
                  template: Sequence[bool] | None = None) -> Iterator[int]:
    """Prefill the prompt, then yield sampled tokens forever (the caller stops). Evicts as needed.

    reuse_prefix: keep the longest common prefix of what the session holds and ``prompt_tokens`` and decode
    only the rest (multi-turn chat on one cache; ``Session.rewind_to_prefix``). Without it the session must
    be fresh (``Session.reset()``). on_prefilled(n_reused, seconds) is called once the prompt is in the cache;
    on_logits(row) before each sample with the (n_vocab,) float32 logits row the sampler will read: it may read
    it, or change it in place (logits processors). forced() is asked before each step for a token to put
    next instead of sampling one (None: sample): it is fed to the chain's penalties as if sampled (not to
    on_logits, which is for sampling), yielded and decoded like a sampled token. template: one flag per prompt
    token, True where a chat template wrote it (``Observation.template``; None: a raw prompt).
    """
    if not prompt_tokens:
        raise ConfigError("the prompt is empty")
    with session.generation():
        yield from _steps(session, prompt_tokens, sampler, reuse_prefix, on_prefilled, on_logits, forced, template)


def _steps(session: Session, prompt_tokens: list[int], sampler: Sampler, reuse_prefix: bool,
           on_prefilled, on_logits, forced, template=None) -> Iterator[int]:
    t0 = time.perf_counter()
    if reuse_prefix:
        start = session.rewind_to_prefix(prompt_tokens)
    elif session.n_past:
        raise ConfigError(f"the session already holds a sequence of {session.n_past} tokens: reset() it first, "
                          "or continue it with reuse_prefix=True")
    else:
        start = 0
    sampler.accept(prompt_tokens[max(0, len(prompt_tokens) - sampler.history):])
    session.feed(prompt_tokens[start:], is_prompt=True, template=None if template is None else template[start:])
    if on_prefilled is not None:
        on_prefilled(start, time.perf_counter() - t0)
    while True:
        if INTERRUPTED.is_set():  # a Ctrl-C that Python dropped somewhere (see errors.INTERRUPTED)
            raise KeyboardInterrupt
        tok = forced() if forced is not None else None
        if tok is None:
            if on_logits is not None:
                on_logits(session.logits())
            tok = session.sample(sampler)
        else:
            sampler.accept_generated([tok])
        yield tok
        session.decode_chunk([tok])


@dataclass(frozen=True)
class ReasoningBudget:
    """The reasoning budget of one generation.

    budget: tokens the model may generate inside an open ``<think>`` block before ``close_tokens`` are forced
        (-1: unlimited, only counted; 0: close at once). close_tokens: the closing tag's token ids (``</think>``
        tokenized with special parsing). starts_open: the prompt ends inside an open block (a reasoning model's
        generation prompt ending with ``<think>``); otherwise the block opens when the model writes ``<think>``
        (only the first one counts, as in the reasoning splitter).
    """

    budget: int = -1
    close_tokens: tuple[int, ...] = ()
    starts_open: bool = False

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < -1:
            raise ConfigError(f"reasoning_budget must be an integer >= -1 (-1: unlimited), got {self.budget!r}")
        if self.budget >= 0 and not self.close_tokens:
            raise ConfigError("a reasoning budget needs the closing tag's tokens")


class _Thinking:
    """Where a generation stands with its ``<think>`` block: counts the tokens generated inside it and, once
    the budget is spent, hands out the closing tag's tokens one step at a time (:meth:`next_forced`)."""

    def __init__(self, cfg: ReasoningBudget, enforce: bool):
        self.cfg = cfg
        self.enforce = enforce and cfg.budget >= 0
        self.open = self.seen_open = cfg.starts_open
        self.n_tokens = 0
        self.forced_close = False
        self._queue: deque[int] = deque()
        self._tail = ""  # the last characters seen: a tag may be split over tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next_forced(self) -> int | None:
        """The token to force at this step, or None (sample)."""
        if not self._queue and self.enforce and self.open and not self.forced_close \
                and self.n_tokens >= self.cfg.budget:
            self._queue.extend(self.cfg.close_tokens)
            self.forced_close = True
        return self._queue.popleft() if self._queue else None

    def on_token(self, data: bytes, forced: bool) -> None:
        """A token was generated (``data``: its bytes): count it and follow the tags in the text."""
        if self.open and not forced:
            self.n_tokens += 1
        text = self._tail + self._decoder.decode(data)
        if self.open:
            if CLOSE in text:
                self.open = False
                self._queue.clear()
        elif not self.seen_open and OPEN in text:
            self.open = self.seen_open = True
            text = text[text.index(OPEN) + len(OPEN):]
        self._tail = text[-(len(CLOSE) - 1):]


class _Text:
    """Incremental detokenization with stop strings, handed out as llama-cpp-python streams it: UTF-8 bytes in
    (one token at a time), text out by whole tokens (a token that ends inside a character waits for the ones
    that complete it); tokens are held back while the text not yet handed out ends with the beginning of a
    stop string, until it cannot be one."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=0)
        self.pending = b""
        self.text = ""
        self.emitted = 0  # characters of text already handed out
        self._ends: deque[int] = deque()  # where the text of each token not yet handed out ends

    def add(self, data: bytes) -> tuple[str, bool]:
        """(new safe text, whether a stop string completed: the text then ends before it)."""
        self.pending += data
        try:
            piece, self.pending = self.pending.decode("utf-8"), b""
        except UnicodeDecodeError:
            piece = ""
            if len(self.pending) > 8:  # not a character in the making: invalid bytes
                piece, self.pending = self.pending.decode("utf-8", "replace"), b""
        if not piece:
            return "", False
        self.text += piece
        self._ends.append(len(self.text))
        # a stop string can only end inside the new piece: search the tail, not the whole text
        tail0 = max(0, len(self.text) - len(piece) - self.hold)
        cut = min((k for k in (self.text.find(s, tail0) for s in self.stop) if k >= 0), default=-1)
        if cut >= 0:
            out = self.text[self.emitted:cut] if cut > self.emitted else ""
            self.emitted = max(self.emitted, cut)
            return out, True
        rest = self.text[self.emitted:]
        held = max((i for s in self.stop for i in range(min(len(s), len(rest)), 0, -1) if rest.endswith(s[:i])),
                   default=0)
        end = self.emitted
        while self._ends and self._ends[0] <= len(self.text) - held:
            end = self._ends.popleft()
        out, self.emitted = self.text[self.emitted:end], end
        return out, False

    def flush(self) -> str:
        """The text held back (at the end of a generation that no stop string ended), with the characters of
        an unfinished last token before its incomplete one (whose bytes are dropped, as llama-cpp-python's
        ``errors="ignore"`` does)."""
        out, self.emitted = self.text[self.emitted:] + self.pending.decode("utf-8", "ignore"), len(self.text)
        self.pending = b""
        self._ends.clear()
        return out


def stream_generate(session: Session, prompt_tokens: list[int], max_tokens: int | None,
                    sampling: SamplingConfig = SamplingConfig(), stop: tuple[str, ...] = (),
                    ignore_eog: bool = False, reuse_prefix: bool = False,
                    stopping_criteria: Callable[[np.ndarray, np.ndarray], bool] | None = None,
                    logits_processor: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                    want_logits: bool = False,
                    reasoning: ReasoningBudget | None = None,
                    template: Sequence[bool] | None = None) -> Iterator[GenerationResponse]:
    """Yield one :class:`GenerationResponse` per sampled token until EOG (unless ignore_eog), a stop string,
    ``stopping_criteria`` or ``max_tokens`` (None: no limit; the KV budget bounds memory, not length). The last
    item's ``finish_reason`` says which; its ``stats.stop_reason`` is the same.

    llama-cpp-python's shapes: ``logits_processor(input_ids, scores) -> scores`` rewrites the (n_vocab,) float32
    logits before each sample, ``stopping_criteria(input_ids, logits) -> bool`` after it (input_ids: (n,) intc
    prompt and generated tokens so far; logits: the raw row the last token was sampled from).
    want_logits: each item carries that raw row (a copy).
    reasoning: count the tokens of the ``<think>`` block (``stats.n_reasoning_tokens``) and, with a budget >= 0,
    force its closing tag once the budget is spent (``stats.reasoning_forced_close``). Not while a grammar
    constrains the sampling: the forced text would leave the grammar's state behind (it never saw it).
    template: one flag per prompt token, True where a chat template wrote it (``Observation.template``)."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError(f"stop strings must be non-empty strings, got {list(stop)!r}")
    model = session.model
    stats = GenerationStats(policy=session.policy.name, kv_budget=session.budget.kv_budget,
                            n_prompt_tokens=len(prompt_tokens))
    evicted_before = 0 if session.closed else session.stats().n_evicted  # a closed one is refused below
    clock = [0.0]  # when the engine last got control back: decode_seconds counts the engine's time only

    def prefilled(n_reused: int, seconds: float) -> None:
        stats.n_prompt_reused, stats.prefill_seconds = n_reused, seconds
        clock[0] = time.perf_counter()

    def snapshot(reason: str | None) -> GenerationStats:
        st = session.stats()
        if not stats.n_ctx:  # what cannot change during a generation is copied once (per token: the counts)
            stats.kv_bytes, stats.n_ctx, stats.capture_route, stats.layers = st.kv_bytes, st.n_ctx, \
                st.capture_route, st.layers
        stats.n_evicted, stats.n_evicted_call = st.n_evicted, st.n_evicted - evicted_before
        stats.n_live_cells, stats.max_live_cells, stats.flash_attn = st.n_live, st.max_live, st.flash_attn
        stats.stop_reason = reason or ""
        return dataclasses.replace(stats)  # the snapshots share the (unchanging) layers list

    text = _Text(tuple(stop))
    generated: list[int] = []
    ids = _TokenIds(prompt_tokens) if stopping_criteria is not None or logits_processor is not None else None
    raw: list[np.ndarray | None] = [None]  # the row the next token is sampled from (when someone reads it)

    def before_sample(row: np.ndarray) -> None:
        keep = want_logits or (stopping_criteria is not None and logits_processor is not None)
        raw[0] = row.copy() if keep else row
        if logits_processor is not None:
            row[:] = logits_processor(ids.view(), row)

    hook = before_sample if (want_logits or ids is not None) else None
    thinking = _Thinking(reasoning, enforce=sampling.grammar is None) if reasoning is not None else None
    was_forced = [False]

    def forced() -> int | None:
        tok = thinking.next_forced()
        was_forced[0] = tok is not None
        if tok is not None and want_logits:
            raw[0] = session.logits().copy()  # the row the forced token stands in for (logprobs read it)
        return tok

    with session.sampling(sampling) as sampler:
        steps = generate_step(session, prompt_tokens, sampler, reuse_prefix, prefilled, hook,
                              forced if thinking is not None and thinking.enforce else None, template)
        try:
            for tok in steps:
                stats.decode_seconds += time.perf_counter() - clock[0]  # decoding the last token, sampling this
                logits = raw[0] if want_logits else None
                if model.is_eog(tok) and not ignore_eog:
                    yield GenerationResponse(tok, text.flush(), "eog", snapshot("eog"), logits)
                    return
                generated.append(tok)
                if ids is not None:
                    ids.append(tok)
                stats.n_generated_tokens = len(generated)
                data = model.token_bytes(tok)
                if thinking is not None:
                    thinking.on_token(data, was_forced[0])
                    stats.n_reasoning_tokens, stats.reasoning_forced_close = thinking.n_tokens, thinking.forced_close
                piece, stopped = text.add(data)
                reason = "stop" if stopped else None
                if reason is None and stopping_criteria is not None and stopping_criteria(ids.view(), raw[0]):
                    reason = "stop"
                if reason is None and max_tokens is not None and len(generated) >= max_tokens:
                    reason = "max_tokens"
                if reason is not None and not stopped:
                    piece += text.flush()
                yield GenerationResponse(tok, piece, reason, snapshot(reason), logits)
                if reason is not None:
                    return
                clock[0] = time.perf_counter()
        finally:
            steps.close()


class _TokenIds:
    """The sequence's token ids as one growing (n,) intc array (llama-cpp-python's ``input_ids``), appended in
    place rather than rebuilt for every token."""

    def __init__(self, prompt: list[int]):
        self.buf = np.empty(max(64, 2 * len(prompt)), dtype=np.intc)
        self.buf[:len(prompt)] = prompt
        self.n = len(prompt)

    def append(self, token: int) -> None:
        if self.n == len(self.buf):
            self.buf = np.concatenate([self.buf, np.empty(len(self.buf), dtype=np.intc)])
        self.buf[self.n] = token
        self.n += 1

    def view(self) -> np.ndarray:
        return self.buf[:self.n]


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats


def generate(session: Session, prompt_tokens: list[int], max_tokens: int | None,
             sampling: SamplingConfig = SamplingConfig(), stop: tuple[str, ...] = (),
             on_text=None, ignore_eog: bool = False, reuse_prefix: bool = False,
             template: Sequence[bool] | None = None) -> GenerationResult:
    """Run stream_generate to the end; on_text(piece) is called for each text piece (streaming output).
    template: one flag per prompt token, True where a chat template wrote it (``Observation.template``)."""
    parts: list[str] = []
    tokens: list[int] = []
    last = None
    for last in stream_generate(session, prompt_tokens, max_tokens, sampling, stop, ignore_eog, reuse_prefix,
                                template=template):
        if last.generated:
            tokens.append(last.token)
        if last.text:
            parts.append(last.text)
            if on_text:
                on_text(last.text)
    return GenerationResult("".join(parts), tokens, last.stats)
