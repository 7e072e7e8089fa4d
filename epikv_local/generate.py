"""The generation loop (the only one): ``generate_step`` -> ``stream_generate`` -> ``generate``.

``generate_step`` yields token ids (prefill, then sample/decode one token at a time, evicting as needed);
``stream_generate`` turns them into text pieces with stop strings and max tokens; ``generate`` collects the
text and the statistics. Positions are dense token indices; evicted positions leave holes in the cache, so
llama-cpp-python's high-level ``Llama`` (which assumes dense positions) is not used.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

from .model import Model
from .session import Session


@dataclass(frozen=True)
class SamplingConfig:
    """temperature <= 0: greedy. top_k <= 0 / top_p >= 1: disabled. seed: RNG seed of the dist sampler."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


class Sampler:
    """A llama.cpp sampler chain (owned; context manager)."""

    def __init__(self, model: Model, cfg: SamplingConfig):
        ll = model.nat.llama
        self.ll = ll
        params = ll.llama_sampler_chain_default_params()
        self.chain = ll.llama_sampler_chain_init(params)
        if cfg.temperature <= 0:
            ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_greedy())
        else:
            if cfg.top_k > 0:
                ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_top_k(cfg.top_k))
            if cfg.top_p < 1.0:
                ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_top_p(cfg.top_p, 1))
            ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_temp(cfg.temperature))
            ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_dist(cfg.seed))

    def sample(self, ctx_handle) -> int:
        return int(self.ll.llama_sampler_sample(self.chain, ctx_handle, -1))

    def close(self) -> None:
        if self.chain is not None:
            self.ll.llama_sampler_free(self.chain)
            self.chain = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def apply_chat_template(model: Model, prompt: str, system: str | None = None) -> str:
    """Render a single-turn chat with the model's own template (GGUF ``tokenizer.chat_template``)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = model.meta("tokenizer.chat_template")
    if not template:
        raise ValueError(f"model {model.path.name} has no chat template (tokenizer.chat_template); drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    fmt = Jinja2ChatFormatter(template=template, eos_token=model.eos_text(), bos_token=model.bos_text())
    return fmt(messages=messages).prompt


def tokenize_prompt(model: Model, text: str) -> list[int]:
    """Tokenize, adding BOS only if the rendered text does not already start with it."""
    bos = model.bos_text()
    add_special = not (bos and text.startswith(bos))
    return model.tokenize(text, add_special=add_special, parse_special=True)


@dataclass
class GenerationStats:
    policy: str
    kv_budget: int
    n_prompt_tokens: int = 0
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
    def prefill_tokens_per_s(self) -> float:
        return self.n_prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 3)
        d["prefill_tokens_per_s"] = round(self.prefill_tokens_per_s, 3)
        return d


def generate_step(session: Session, prompt_tokens: list[int], sampler: Sampler,
                  stats: GenerationStats | None = None) -> Iterator[int]:
    """Prefill the prompt, then yield sampled tokens forever (the caller stops). Evicts as needed."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty")
    t0 = time.perf_counter()
    session.feed(prompt_tokens, is_prompt=True)
    if stats is not None:
        stats.prefill_seconds = time.perf_counter() - t0
    while True:
        t1 = time.perf_counter()
        tok = sampler.sample(session.ctx.handle)
        yield tok
        session.decode_chunk([tok])
        if stats is not None:
            stats.decode_seconds += time.perf_counter() - t1


@dataclass
class Piece:
    """One streamed step: the token and the text it completed (may be empty for partial UTF-8)."""

    token: int
    text: str


def stream_generate(session: Session, prompt_tokens: list[int], max_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(), stop: tuple[str, ...] = (),
                    stats: GenerationStats | None = None, ignore_eog: bool = False) -> Iterator[Piece]:
    """Yield text pieces until EOG (unless ignore_eog), a stop string, or max_tokens.

    stats (optional) is filled in place."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    model = session.model
    pending = b""
    text_so_far = ""
    emitted = 0  # characters of text_so_far already yielded
    hold = max((len(s) for s in stop), default=0)
    with Sampler(model, sampling) as sampler:
        steps = generate_step(session, prompt_tokens, sampler, stats)
        n = 0
        reason = "max_tokens"
        for tok in steps:
            if model.is_eog(tok) and not ignore_eog:
                reason = "eog"
                break
            n += 1
            if stats is not None:
                stats.n_generated_tokens = n
            pending += model.token_bytes(tok)
            try:
                piece = pending.decode("utf-8")
                pending = b""
            except UnicodeDecodeError:
                piece = ""
                if len(pending) > 8:
                    piece, pending = pending.decode("utf-8", "replace"), b""
            text_so_far += piece
            cut = min((text_so_far.find(s) for s in stop if s in text_so_far), default=-1)
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
            if n >= max_tokens:
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


def fill_session_stats(stats: GenerationStats, session: Session) -> None:
    stats.n_evicted = session.engine.stats.n_evicted
    stats.max_live_cells = session.engine.stats.max_live
    stats.kv_bytes = session.ctx.kv_bytes
    stats.n_ctx = session.ctx.n_ctx
    stats.flash_attn = bool(session.flash_attn) and session.cfg.flash_attn
    stats.capture_route = session.cfg.capture_route if session.layers else None
    stats.layers = list(session.layers)


def generate(session: Session, prompt_tokens: list[int], max_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), stop: tuple[str, ...] = (),
             on_text=None, ignore_eog: bool = False) -> GenerationResult:
    """Run stream_generate to the end; on_text(piece) is called for each text piece (streaming output)."""
    stats = GenerationStats(policy=session.policy.name, kv_budget=session.budget.kv_budget,
                            n_prompt_tokens=len(prompt_tokens))
    parts: list[str] = []
    tokens: list[int] = []
    for piece in stream_generate(session, prompt_tokens, max_tokens, sampling, stop, stats, ignore_eog):
        if piece.token >= 0:
            tokens.append(piece.token)
        if piece.text:
            parts.append(piece.text)
            if on_text:
                on_text(piece.text)
    fill_session_stats(stats, session)
    return GenerationResult("".join(parts), tokens, stats)
