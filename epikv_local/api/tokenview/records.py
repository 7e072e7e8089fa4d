"""The token view's records: one :class:`TokenRecord` per position of a generation, gathered in a :class:`TokenRun`.

:func:`collect_run` reads a recorded session through its public API only (``recording``, ``events``,
``live_positions``, ``protection_reasons``, ``recent_window``, ``policy.score``, ``tokens``, ``n_past``,
``budget``, ``layers``); :func:`run_tokens` makes such a session, generates and collects. Nothing here renders.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ...engine.budget import BudgetConfig
from ...engine.handles import Model
from ...engine.session import Session, SessionConfig
from ...errors import ConfigError
from ...policies.base import Policy
from ..generation import GenerationResult, GenerationStats, generate
from ...engine.sampling import SamplingConfig


@dataclass
class TokenRecord:
    """One position of the sequence.

    text: the characters this token completes (its UTF-8 bytes decoded incrementally: a token that only starts
        a multi-byte character has ``""`` and the next one carries it); special tokens are rendered.
    kind: "prompt" or "generated".
    score: the policy's score (higher = keep) when the token was evicted, else its score at the end; None when
        it was never scored (NaN) or not decoded. +/-inf are kept as floats.
    decoded: False only for a generated token that was sampled last and never decoded into the cache.
    evicted_round: index into the run's events of the round that evicted it (None: kept).
    evicted_step: generated tokens in the sequence when that round ran (None: during prefill, or kept).
    evicted_seq_len: sequence length (positions decoded) when that round ran.
    evicted_reason: the round's reason ("budget", "budget_window", "kv_full_hook").
    protected: protections in force at the end for a live token: any of "sink", "prompt", "recent", "newest".
    """

    position: int
    token: int
    text: str
    kind: str
    score: float | None
    decoded: bool = True
    evicted_round: int | None = None
    evicted_step: int | None = None
    evicted_seq_len: int | None = None
    evicted_reason: str | None = None
    protected: tuple[str, ...] = ()

    @property
    def evicted(self) -> bool:
        return self.evicted_round is not None

    @property
    def live(self) -> bool:
        """Held in the KV cache at the end."""
        return self.decoded and not self.evicted

    def as_dict(self) -> dict:
        d = asdict(self)
        d["protected"] = list(self.protected)
        d["evicted"] = self.evicted
        if d["score"] is not None and not math.isfinite(d["score"]):
            d["score"] = str(d["score"])  # JSON has no inf
        return d


@dataclass
class TokenRun:
    """One generation seen token by token: the records, the statistics and the settings that produced them."""

    label: str
    records: list[TokenRecord]
    stats: GenerationStats
    text: str
    budget: BudgetConfig
    recent: int                      # recent window in effect, cells (after a protected prompt shrank it)
    n_prompt: int
    events: list = field(default_factory=list, repr=False)  # the session's EvictionEvents
    calibration: str | None = None   # path of the model calibration used, if any
    settings: dict = field(default_factory=dict)  # policy settings (for the page)

    @property
    def n_evicted(self) -> int:
        return sum(r.evicted for r in self.records)

    @property
    def n_live(self) -> int:
        return sum(r.live for r in self.records)

    def as_dict(self) -> dict:
        return {"label": self.label, "stats": self.stats.as_dict(), "text": self.text,
                "budget": asdict(self.budget), "recent": self.recent, "n_prompt": self.n_prompt,
                "n_rounds": len(self.events), "calibration": self.calibration, "settings": dict(self.settings),
                "records": [r.as_dict() for r in self.records]}


def _token_texts(model: Model, tokens: Sequence[int]) -> list[str]:
    """The characters each token completes (incremental UTF-8 decoding; special tokens rendered)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out = [dec.decode(model.token_bytes(int(t), special=True)) for t in tokens]
    tail = dec.decode(b"", final=True)
    if tail and out:
        out[-1] += tail
    return out


def _clean_score(v: float) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def _sequence(session: Session, prompt_tokens: Sequence[int], result: GenerationResult) -> list[int]:
    """Every token of the run, prompt then generated (len n_prompt + n_generated): the session's decoded ones
    plus the last sampled one(s), which were never decoded. ConfigError when the session does not hold exactly
    this run from position 0."""
    n_prompt, n_past = len(prompt_tokens), session.n_past
    decoded = list(session.tokens)
    if decoded[:n_prompt] != [int(t) for t in prompt_tokens] or n_past < n_prompt:
        raise ConfigError("the session does not hold this prompt from position 0: run the generation on a fresh "
                          "session (no reused prefix) before collecting its token view")
    gen = [int(t) for t in result.tokens]
    if decoded[n_prompt:] != gen[: n_past - n_prompt]:
        raise ConfigError("the session's generated tokens differ from the result's: collect right after generate()")
    return decoded + gen[n_past - n_prompt:]


def _mark_evictions(recs: list[TokenRecord], events: list, n_prompt: int) -> None:
    """Give each evicted record its round, the score it had then, and when that was.

    The newest position is always live (the engine never evicts it), so the sequence length when a round ran
    is ``max(event.positions) + 1``; the generation step is that length minus the prompt length."""
    for k, ev in enumerate(events):
        if not len(ev.evicted):
            continue
        seq_len = int(np.max(ev.positions)) + 1
        index = {int(p): i for i, p in enumerate(ev.positions)}
        for p in ev.evicted:
            r = recs[int(p)]
            if r.evicted:  # a rewound session re-decodes positions: its log no longer maps to one sequence
                raise ConfigError(f"position {int(p)} evicted twice: the session was rewound; collect from a fresh run")
            r.score = _clean_score(ev.scores[index[int(p)]])
            r.evicted_round, r.evicted_seq_len, r.evicted_reason = k, seq_len, ev.reason
            r.evicted_step = seq_len - n_prompt if seq_len >= n_prompt else None


def _mark_live(recs: list[TokenRecord], session: Session) -> None:
    """Give each token still in the cache its final score and why it is protected (empty tuple: evictable)."""
    live = session.live_positions()
    if not len(live):
        return
    final = np.asarray(session.policy.score(live), dtype=np.float64)
    for p, s, why in zip(live.tolist(), final, session.protection_reasons(live)):
        recs[p].score = _clean_score(s)
        recs[p].protected = tuple(why)


def _settings(session: Session) -> dict:
    """The policy settings the page shows: the captured layers and the window, when the policy has them."""
    settings = {}
    for name in ("layers", "window"):
        v = getattr(session.policy, name, None)
        if v is not None:
            settings[name] = list(v) if isinstance(v, tuple) else v
    if session.layers:
        settings["layers"] = list(session.layers)
    return settings


def collect_run(session: Session, prompt_tokens: Sequence[int], result: GenerationResult, label: str | None = None,
                calibration: str | None = None) -> TokenRun:
    """The token records of a generation that ``session`` (created with ``record=True``, fresh before it)
    just ran on ``prompt_tokens``; call it before the session is closed or reused."""
    if not session.recording:
        raise ConfigError("the token view needs a session created with record=True")
    n_prompt = len(prompt_tokens)
    tokens = _sequence(session, prompt_tokens, result)
    texts = _token_texts(session.model, tokens)
    events = list(session.events)  # a copy: the page must not change if the session goes on
    recs = [TokenRecord(position=p, token=t, text=texts[p], kind="prompt" if p < n_prompt else "generated",
                        score=None, decoded=p < session.n_past) for p, t in enumerate(tokens)]
    _mark_evictions(recs, events, n_prompt)
    _mark_live(recs, session)
    return TokenRun(label=label or session.policy.name, records=recs, stats=result.stats, text=result.text,
                    budget=session.budget, recent=int(session.recent_window), n_prompt=n_prompt, events=events,
                    calibration=calibration, settings=_settings(session))


def run_tokens(model: Model, prompt_tokens: Sequence[int], policy: Policy, budget: BudgetConfig,
               cfg: SessionConfig | None = None, sampling: SamplingConfig = SamplingConfig(),
               max_tokens: int | None = 256, stop: tuple[str, ...] = (), ignore_eog: bool = False,
               on_text: Callable[[str], object] | None = None, label: str | None = None,
               calibration: str | None = None, template: Sequence[bool] | None = None) -> TokenRun:
    """Generate from ``prompt_tokens`` under ``policy`` and ``budget`` on a new recording session and return
    the token view of the run (one record per position, prompt and generated). template: one flag per prompt
    token, True where a chat template wrote it (as the chat path passes them: ``said_words`` needs them)."""
    tokens = [int(t) for t in prompt_tokens]
    with Session(model, policy, budget, cfg, record=True) as session:
        session.check_prompt(len(tokens))
        result = generate(session, tokens, max_tokens, sampling, tuple(stop), on_text=on_text,
                          ignore_eog=ignore_eog, template=template)
        return collect_run(session, tokens, result, label=label, calibration=calibration)
