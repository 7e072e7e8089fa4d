"""The eviction engine: keeps one sequence's live KV cells within a fixed budget.

Positions are the original token indices (0, 1, 2, ...): evicted positions leave holes, RoPE positions of the
kept tokens never change. Before a batch of ``n`` tokens is decoded, :meth:`EvictionEngine.make_room` evicts
so that ``live + n <= kv_budget``: live cells never exceed the budget. Evictions go through the shared
selection step with the policy's scores and the protection mask (first ``n_sink`` tokens, the recent window
of the newest tokens, and the prompt when ``protect_prompt``), ``evict_chunk`` (or more, if needed) at a time,
removed from llama.cpp in one call (``llama_memory_seq_rm_pos``).

All budget arithmetic lives here: the context size a budget needs (:func:`context_cells`), the prefill chunk
that leaves the protected cells room, and the recent window in effect once a protected prompt is known.

One name per idea: the *recent window* is the count of newest positions never evicted. It is set by
``n_recent`` (cells) or, when that is None, by ``recent_fraction`` (a share of the budget); the number in
effect is ``recent_window`` (``BudgetConfig.recent_window`` as configured, ``EvictionEngine.recent_window``
once a protected prompt has shrunk it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import BudgetError, ConfigError
from ..policies.base import Policy
from .protocol import KVContext
from .selection import protected_mask, select_evictions

#: the KV budget (cells) when none is given: the same for the Python API, the CLI, the server and the chat
DEFAULT_KV_BUDGET = 4096
#: default share of the budget kept for the newest tokens (see BudgetConfig.recent_fraction)
DEFAULT_RECENT_FRACTION = 0.5
#: llama.cpp holds cell counts in int32
MAX_CELLS = 2**31 - 1


def context_cells(kv_budget: int, n_batch: int) -> int:
    """KV cells to allocate for a budget: the budget plus one ubatch, which llama.cpp must be able to place
    before the kv-full hook (patches/0003) can evict."""
    n = kv_budget + n_batch
    if n > MAX_CELLS:
        raise ConfigError(f"kv_budget {kv_budget} + n_batch {n_batch} exceeds llama.cpp's {MAX_CELLS} cells")
    return n


@dataclass(frozen=True)
class BudgetConfig:
    """KV budget and protection. Units: KV cells (= tokens of the sequence).

    kv_budget: maximum live KV cells of the sequence.
    n_sink: the first n_sink positions are never evicted.
    n_recent: the recent window in cells (the newest positions, never evicted); None = round(recent_fraction *
        kv_budget), which
        shrinks to what a protected prompt leaves (an explicit n_recent that does not fit is an error).
    recent_fraction: default share of the budget kept for recent tokens (0.5: the reference measurement in
        docs/calibration.md found EPIKV worse than trivial baselines with a small recent window).
    protect_prompt: never evict prompt tokens (the prompt must then fit the budget with the recent window).
    evict_chunk: minimum number of positions evicted per eviction round.
    """

    kv_budget: int
    n_sink: int = 4
    n_recent: int | None = None
    recent_fraction: float = DEFAULT_RECENT_FRACTION
    protect_prompt: bool = True
    evict_chunk: int = 16

    def __post_init__(self):
        for name in ("kv_budget", "n_sink", "evict_chunk", "n_recent"):
            v = getattr(self, name)
            lo = 0 if name in ("n_sink", "n_recent") else 1
            if name == "n_recent" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_CELLS:
                raise BudgetError(f"{name} must be an integer in {lo}..{MAX_CELLS}, got {v!r}")
        rf = self.recent_fraction
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or not 0.0 <= rf < 1.0:
            raise BudgetError(f"recent_fraction must be in [0, 1), got {self.recent_fraction!r}")
        if self.n_sink + self.recent_window + 1 > self.kv_budget:
            raise BudgetError(
                f"kv_budget {self.kv_budget} is too small for the protected tokens: n_sink {self.n_sink} + "
                f"the recent window {self.recent_window} + at least 1 evictable cell")

    @property
    def recent_window(self) -> int:
        """The recent window as configured (cells): ``n_recent``, or ``recent_fraction`` of the budget."""
        return self.n_recent if self.n_recent is not None else int(round(self.recent_fraction * self.kv_budget))


@dataclass
class EvictionEvent:
    """One eviction round (recorded when ``record=True``): what was live, protected, scored and evicted."""

    positions: np.ndarray
    scores: np.ndarray
    protected: np.ndarray
    evicted: np.ndarray
    reason: str


@dataclass
class EngineStats:
    """Counts since the engine was created; evict_seconds: wall time spent in eviction rounds."""

    n_evicted: int = 0
    n_rounds: int = 0
    max_live: int = 0
    evict_seconds: float = 0.0
    events: list[EvictionEvent] = field(default_factory=list)


class EvictionEngine:
    """Tracks the live positions of sequence ``seq_id`` of ``ctx`` and evicts with ``policy`` under ``cfg``; it
    never removes a cell of another sequence (a cell shared with one, after ``seq_copy``, stays theirs)."""

    def __init__(self, ctx: KVContext, policy: Policy, cfg: BudgetConfig, record: bool = False, seq_id: int = 0):
        self.ctx = ctx
        self.seq_id = seq_id
        self.policy = policy
        self.cfg = cfg
        self.record = record
        self._alive = np.zeros(1024, dtype=bool)
        self.n_live = 0
        self.newest = -1
        self.prompt_end: int | None = None
        self.recent_window = cfg.recent_window  # in effect: a protected prompt can shrink it (begin_prompt)
        self.stats = EngineStats()

    @property
    def fewest_scored(self) -> int:
        """The fewest live cells an eviction round scores: ``make_room`` evicts only when the live cells plus a
        decode of at most one ubatch exceed the budget (``Policy.wants_surprise``'s ``min_cells``)."""
        return max(1, self.cfg.kv_budget - self.ctx.n_batch + 1)

    # -- bookkeeping --------------------------------------------------------------------------------------
    def live_positions(self) -> np.ndarray:
        return np.flatnonzero(self._alive[: self.newest + 1]).astype(np.int64)

    def on_decoded(self, positions: np.ndarray) -> None:
        """Positions (T,) were just written to the KV cache."""
        top = int(positions[-1]) + 1
        if top > len(self._alive):
            grown = np.zeros(max(top, 2 * len(self._alive)), dtype=bool)
            grown[: len(self._alive)] = self._alive
            self._alive = grown
        self._alive[positions] = True
        self.n_live += len(positions)
        self.newest = max(self.newest, top - 1)
        self.stats.max_live = max(self.stats.max_live, self.n_live)

    def prefill_chunk(self, n_batch: int) -> int:
        """Tokens per decode during prefill: n_batch, but small enough to leave the protected cells room."""
        if not self.policy.evicts:
            return n_batch
        room = self.cfg.kv_budget - self.cfg.n_sink - self.recent_window
        return max(1, min(n_batch, room))

    def begin_prompt(self, start: int, n_prompt: int) -> None:
        """A prompt of n_prompt tokens will be decoded from position ``start``: check that it fits (with the
        prompt protected), size the recent window and protect the prompt. BudgetError if it cannot fit."""
        self.recent_window = self.window_for_prompt(n_prompt)
        self.prompt_end = start + n_prompt

    def check_prompt(self, n_prompt: int) -> None:
        """Raise BudgetError if a prompt of n_prompt tokens cannot fit (changes nothing)."""
        self.window_for_prompt(n_prompt)

    def window_for_prompt(self, n_prompt: int) -> int:
        """The recent window in effect with a protected prompt of n_prompt tokens: a window derived from
        ``recent_fraction`` shrinks to what the prompt leaves; BudgetError when the prompt cannot fit."""
        cfg = self.cfg
        if not self.policy.evicts:
            if n_prompt > cfg.kv_budget:
                raise BudgetError(f"prompt of {n_prompt} tokens exceeds kv_budget {cfg.kv_budget} "
                                  "with policy 'none' (no eviction)")
            return cfg.recent_window
        if not cfg.protect_prompt:
            return cfg.recent_window
        room = cfg.kv_budget - cfg.n_sink - n_prompt - 1  # cells left for the recent window
        if cfg.n_recent is None and room >= 1:
            return min(cfg.recent_window, room)
        if n_prompt + cfg.recent_window + 1 > cfg.kv_budget or room < 1:
            raise BudgetError(
                f"prompt of {n_prompt} tokens plus the recent window of {cfg.recent_window} does not fit "
                f"kv_budget {cfg.kv_budget} while the prompt is protected; raise the budget or stop "
                "protecting the prompt (--no-protect-prompt)")
        return cfg.recent_window

    def truncate(self, pos: int) -> int:
        """Drop every position >= pos from the cache and the bookkeeping (a rewind, e.g. to the common prefix
        of a new chat turn). llama.cpp continues a sequence only right after its last stored position, so the
        sequence resumes after the newest live position below ``pos``: returns that next position (<= pos)."""
        pos = max(0, int(pos))
        if pos <= self.newest:
            self.ctx.seq_rm_range(pos, -1, self.seq_id)
            gone = self._alive[pos: self.newest + 1]
            self.n_live -= int(gone.sum())
            gone[:] = False
            live = np.flatnonzero(self._alive[:pos])
            self.newest = int(live[-1]) if len(live) else -1
        if self.prompt_end is not None and self.prompt_end > self.newest + 1:
            self.prompt_end = self.newest + 1
        return self.newest + 1

    # -- eviction -----------------------------------------------------------------------------------------
    def in_protected_prompt(self, positions: np.ndarray) -> np.ndarray:
        """(len(positions),) bool: True where a position lies in the starting prompt that the budget protects
        (``Observation.protected``); all False when the prompt is not protected."""
        positions = np.asarray(positions)
        if not self.cfg.protect_prompt or self.prompt_end is None:
            return np.zeros(len(positions), dtype=bool)
        return positions < self.prompt_end

    def protected(self, positions: np.ndarray, incoming: int = 0) -> np.ndarray:
        """Protection mask of live positions. incoming > 0 counts the recent window from the newest position
        *after* that many new tokens (the window slides over them)."""
        mask = protected_mask(positions, n_sink=self.cfg.n_sink, n_recent=max(1, self.recent_window),
                              newest_pos=self.newest + incoming,
                              prompt_end=self.prompt_end if self.cfg.protect_prompt else None)
        # the newest position always stays: llama.cpp requires new tokens to follow a sequence's last position
        return mask | (positions == self.newest)

    def protection_reasons(self, positions: np.ndarray) -> list[tuple[str, ...]]:
        """Why each live position is protected now: a tuple of "sink", "prompt", "recent", "newest" (empty: it
        may be evicted). The same rules as :meth:`protected`, named."""
        cfg = self.cfg
        prompt_end = self.prompt_end if cfg.protect_prompt else None
        out = []
        for p in np.asarray(positions, dtype=np.int64).tolist():
            kinds = []
            if p < cfg.n_sink:
                kinds.append("sink")
            if prompt_end is not None and p < prompt_end:
                kinds.append("prompt")
            if p > self.newest - max(1, self.recent_window):
                kinds.append("recent")
            if p == self.newest:
                kinds.append("newest")
            out.append(tuple(kinds))
        return out

    # -- saving and restoring ----------------------------------------------------------------------------
    def copy_from(self, other: "EvictionEngine") -> None:
        """Take ``other``'s bookkeeping (a branch of its sequence: ``Session.fork``); the counts start afresh."""
        self._alive = other._alive.copy()
        self.n_live, self.newest, self.prompt_end = other.n_live, other.newest, other.prompt_end
        self.recent_window = other.recent_window
        self.stats.max_live = other.n_live

    def snapshot(self) -> dict:
        """The bookkeeping as plain JSON data: live positions, newest, prompt end, recent window, counts."""
        return {"live": self.live_positions().tolist(), "newest": int(self.newest), "prompt_end": self.prompt_end,
                "recent_window": int(self.recent_window),
                "stats": {"n_evicted": self.stats.n_evicted, "n_rounds": self.stats.n_rounds,
                          "max_live": self.stats.max_live}}

    def restore(self, snap: dict) -> None:
        """Take the bookkeeping of :meth:`snapshot` (on a fresh engine whose context already holds those
        cells); the caller has validated ``snap``."""
        live = np.asarray(snap["live"], dtype=np.int64)
        if len(live):
            self.on_decoded(live)
        self.newest = int(snap["newest"])
        self.prompt_end = snap["prompt_end"]
        self.recent_window = int(snap["recent_window"])
        for k, v in snap["stats"].items():
            setattr(self.stats, k, int(v))

    def evict(self, n: int, reason: str = "budget", incoming: int = 0) -> int:
        """Evict up to n positions (lowest scores, unprotected). Returns how many were evicted."""
        t0 = time.perf_counter()
        pos = self.live_positions()
        scores = self.policy.score(pos)
        prot = self.protected(pos, incoming)
        victims = select_evictions(pos, scores, prot, n)
        if len(victims):
            removed = self.ctx.seq_rm_positions(victims, self.seq_id)
            if removed != len(victims):
                raise RuntimeError(f"llama.cpp removed {removed} cells for {len(victims)} evicted positions")
            self._alive[victims] = False
            self.n_live -= len(victims)
            self.stats.n_evicted += len(victims)
            self.stats.n_rounds += 1
        if self.record:
            self.stats.events.append(EvictionEvent(pos, np.array(scores, dtype=np.float64), prot, victims, reason))
        self.stats.evict_seconds += time.perf_counter() - t0
        return len(victims)

    def make_room(self, n_new: int) -> None:
        """Evict so that n_new more cells fit in the budget. BudgetError if protection forbids it."""
        need = self.n_live + n_new - self.cfg.kv_budget
        if need <= 0:
            return
        if not self.policy.evicts:
            raise BudgetError(f"KV budget {self.cfg.kv_budget} is full and policy 'none' does not evict")
        got = self.evict(max(need, self.cfg.evict_chunk))
        if got < need:
            # a multi-token chunk (a later chat turn's prompt) can need more room than the window in front of
            # it leaves: the recent window then slides over the incoming tokens, which are the newest after it
            got += self.evict(need - got, reason="budget_window", incoming=n_new)
        if got < need:
            raise BudgetError(
                f"cannot free {need} KV cells within budget {self.cfg.kv_budget}: only {got} unprotected "
                "positions (prompt/sinks/recent window are protected)")

    def on_kv_full(self, n_tokens: int) -> bool:
        """llama_decode's kv-full hook: evict a chunk and ask for a retry. An exception of the policy's scoring
        is re-raised by ``Context.decode`` as itself, with a note naming the policy."""
        if not self.policy.evicts:
            return False
        try:
            return self.evict(max(n_tokens, self.cfg.evict_chunk), reason="kv_full_hook") > 0
        except Exception as e:
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(f"raised by policy {self.policy.name!r} in an eviction round inside llama_decode "
                           "(the kv-full hook)")
            raise
