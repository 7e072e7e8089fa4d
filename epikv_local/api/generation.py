"""The generation loop (the only one): ``generate_step`` -> ``stream_generate`` -> ``generate``.

``generate_step`` yields token ids (prefill, then sample/decode one token at a time, evicting as needed);
``stream_generate`` turns them into text pieces with stop strings and max tokens; ``generate`` collects the
text and the statistics. Positions are dense token indices; evicted positions leave holes in the cache, so
llama-cpp-python's high-level ``Llama`` (which assumes dense positions) is not used. Sampling settings and
the sampler chain live in :mod:`.sampling`, prompts in :mod:`.chat`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

from ..engine.session import Session
from ..errors import INTERRUPTED, ConfigError
from .sampling import Sampler, SamplingConfig


@dataclass
class GenerationStats:
    """One generation. Units: tokens, cells, bytes, seconds."""

    policy: str
    kv_budget: int
    n_prompt_tokens: int = 0
    n_prompt_reused: int = 0  # prompt tokens already in the cache (common prefix with the previous turn)
    n_generated_tokens: int = 0
    n_evicted: int = 0
    max_live_cells: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    kv_bytes: int = 0
    n_ctx: int = 0
    flash_attn: bool = False
    capture_route: str | None = None
    layers: list[int] = field(default_factory=list)
    stop_reason: str = ""

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


def generate_step(session: Session, prompt_tokens: list[int], sampler: Sampler,
                  stats: GenerationStats | None = None, reuse_prefix: bool = False) -> Iterator[int]:
    """Prefill the prompt, then yield sampled tokens forever (the caller stops). Evicts as needed.

    reuse_prefix: keep the longest common prefix of what the session holds and ``prompt_tokens`` and decode
    only the rest (multi-turn chat on one cache; ``Session.rewind_to_prefix``). Without it the session must
    be fresh (``Session.reset()``).
    """
    if not prompt_tokens:
        raise ConfigError("the prompt is empty")
    with session.generation():
        yield from _steps(session, prompt_tokens, sampler, stats, reuse_prefix)


def _steps(session: Session, prompt_tokens: list[int], sampler: Sampler, stats: GenerationStats | None,
           reuse_prefix: bool) -> Iterator[int]:
    t0 = time.perf_counter()
    if reuse_prefix:
        start = session.rewind_to_prefix(prompt_tokens)
    elif session.n_past:
        raise ConfigError(f"the session already holds a sequence of {session.n_past} tokens: reset() it first, "
                          "or continue it with reuse_prefix=True")
    else:
        start = 0
    sampler.accept(prompt_tokens[max(0, len(prompt_tokens) - sampler.history):])
    session.feed(prompt_tokens[start:], is_prompt=True)
    if stats is not None:
        stats.prefill_seconds = time.perf_counter() - t0
        stats.n_prompt_reused = start
    while True:
        if INTERRUPTED.is_set():  # a Ctrl-C that Python dropped somewhere (see errors.INTERRUPTED)
            raise KeyboardInterrupt
        t1 = time.perf_counter()
        tok = session.sample(sampler)
        yield tok
        session.decode_chunk([tok])
        if stats is not None:
            stats.decode_seconds += time.perf_counter() - t1


@dataclass
class Piece:
    """One streamed step: the token and the text it completed (may be empty for partial UTF-8)."""

    token: int
    text: str


def stream_generate(session: Session, prompt_tokens: list[int], max_tokens: int | None,
                    sampling: SamplingConfig = SamplingConfig(), stop: tuple[str, ...] = (),
                    stats: GenerationStats | None = None, ignore_eog: bool = False, reuse_prefix: bool = False,
                    should_stop: Callable[[list[int]], bool] | None = None) -> Iterator[Piece]:
    """Yield text pieces until EOG (unless ignore_eog), a stop string, ``should_stop(tokens so far)`` or
    ``max_tokens`` (None: no limit; the KV budget bounds memory, not length).

    stats (optional) is filled in place; ``stop_reason`` is "eog", "stop" or "max_tokens"."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError(f"stop strings must be non-empty strings, got {list(stop)!r}")
    model = session.model
    pending = b""
    text_so_far = ""
    emitted = 0  # characters of text_so_far already yielded
    hold = max((len(s) for s in stop), default=0)
    generated: list[int] = []
    with Sampler(model, sampling) as sampler:
        steps = generate_step(session, prompt_tokens, sampler, stats, reuse_prefix)
        reason = "max_tokens"
        for tok in steps:
            if model.is_eog(tok) and not ignore_eog:
                reason = "eog"
                break
            generated.append(tok)
            if stats is not None:
                stats.n_generated_tokens = len(generated)
            pending += model.token_bytes(tok)
            try:
                piece = pending.decode("utf-8")
                pending = b""
            except UnicodeDecodeError:
                piece = ""
                if len(pending) > 8:
                    piece, pending = pending.decode("utf-8", "replace"), b""
            text_so_far += piece
            # a stop string can only end inside the new piece: search the tail, not the whole text
            tail0 = max(0, len(text_so_far) - len(piece) - hold)
            cut = min((k for k in (text_so_far.find(s, tail0) for s in stop) if k >= 0), default=-1)
            if cut >= 0:
                if cut > emitted:
                    yield Piece(tok, text_so_far[emitted:cut])
                reason = "stop"
                break
            safe = len(text_so_far) - hold + 1 if hold else len(text_so_far)
            if safe > emitted:
                yield Piece(tok, text_so_far[emitted:safe])
                emitted = safe
            else:
                yield Piece(tok, "")
            if should_stop is not None and should_stop(generated):
                reason = "stop"
                break
            if max_tokens is not None and len(generated) >= max_tokens:
                break
        if reason != "stop" and emitted < len(text_so_far):
            yield Piece(-1, text_so_far[emitted:])
        steps.close()
    if stats is not None:
        stats.stop_reason = reason


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats


def new_stats(session: Session, prompt_tokens: list[int]) -> GenerationStats:
    return GenerationStats(policy=session.policy.name, kv_budget=session.budget.kv_budget,
                           n_prompt_tokens=len(prompt_tokens))


def fill_session_stats(stats: GenerationStats, session: Session) -> None:
    """Copy the session's eviction and memory figures into ``stats``."""
    st = session.stats()
    stats.n_evicted = st.n_evicted
    stats.max_live_cells = st.max_live
    stats.kv_bytes = st.kv_bytes
    stats.n_ctx = st.n_ctx
    stats.flash_attn = st.flash_attn
    stats.capture_route = st.capture_route
    stats.layers = st.layers


def generate(session: Session, prompt_tokens: list[int], max_tokens: int | None,
             sampling: SamplingConfig = SamplingConfig(), stop: tuple[str, ...] = (),
             on_text=None, ignore_eog: bool = False, reuse_prefix: bool = False) -> GenerationResult:
    """Run stream_generate to the end; on_text(piece) is called for each text piece (streaming output)."""
    stats = new_stats(session, prompt_tokens)
    parts: list[str] = []
    tokens: list[int] = []
    for piece in stream_generate(session, prompt_tokens, max_tokens, sampling, stop, stats, ignore_eog,
                                 reuse_prefix):
        if piece.token >= 0:
            tokens.append(piece.token)
        if piece.text:
            parts.append(piece.text)
            if on_text:
                on_text(piece.text)
    fill_session_stats(stats, session)
    return GenerationResult("".join(parts), tokens, stats)
