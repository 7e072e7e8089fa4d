"""Property-based tests (hypothesis) of the eviction bookkeeping against a simple model of it.

Random prompt lengths, budgets, sink / recent / prompt-protection settings, policy scores (ties, NaN,
constants, +-inf) and decode chunk sizes. Invariants after every step:

* live cells <= budget;
* protected positions (sinks, a protected prompt, the newest position) are never evicted;
* the engine's live positions equal the context's cell list;
* an evicted position never comes back;
* each round evicts exactly the lowest-scoring unprotected positions (the one selection step).

Twice: against ``FakeKV``, a pure-Python model of llama.cpp's cells that follows the same rules (a decode
must continue right after the sequence's last stored position and needs free cells), with many examples;
and against the real patched llama.cpp on the default model, with fewer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from epikv_local.engine.budget import BudgetConfig, EvictionEngine
from epikv_local.engine.selection import select_evictions
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import BudgetError, KVFullError
from epikv_local.policies.base import Policy


@dataclass
class ScriptedPolicy(Policy):
    """Scores from a table drawn by hypothesis (position -> score), cycled for positions past its end."""

    table: list = field(default_factory=lambda: [0.0])

    def score(self, positions):
        return np.array([self.table[int(p) % len(self.table)] for p in positions], dtype=np.float64)


class FakeKV:
    """The KVContext protocol over a list of cells (-1 = free), with llama.cpp's rules."""

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx
        self.n_batch = n_ctx
        self.cells = [-1] * n_ctx
        self.hook = None

    def decode(self, tokens, positions, logits_last=True, logits_all=False, seq_id=0):
        stored = [p for p in self.cells if p >= 0]
        if stored and int(positions[0]) != max(stored) + 1:
            raise AssertionError(f"llama.cpp would refuse: {positions[0]} does not follow {max(stored)}")
        free = [i for i, p in enumerate(self.cells) if p < 0]
        if len(free) < len(tokens):
            raise KVFullError("no KV slot")
        for i, p in zip(free, positions):
            self.cells[i] = int(p)

    def seq_rm_positions(self, positions, seq_id=0):
        gone = set(int(p) for p in positions)
        n = 0
        for i, p in enumerate(self.cells):
            if p in gone:
                self.cells[i] = -1
                n += 1
        return n

    def seq_rm_range(self, p0, p1, seq_id=0):
        for i, p in enumerate(self.cells):
            if p >= p0 and (p1 < 0 or p < p1):
                self.cells[i] = -1

    def cell_positions(self, seq_id=0):
        return np.array(self.cells, dtype=np.int32)

    def set_kv_full_callback(self, fn):
        self.hook = fn


scores = st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.0), st.just(1.0)),
                  min_size=1, max_size=64)


@st.composite
def scenarios(draw):
    budget = draw(st.integers(4, 80))
    n_sink = draw(st.integers(0, 6))
    explicit_recent = draw(st.booleans())
    n_recent = draw(st.integers(0, budget)) if explicit_recent else None
    frac = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75]))
    protect = draw(st.booleans())
    n_prompt = draw(st.integers(1, 40))
    chunks = draw(st.lists(st.integers(1, 12), min_size=8, max_size=40))
    return dict(budget=budget, n_sink=n_sink, n_recent=n_recent, frac=frac, protect=protect, n_prompt=n_prompt,
                chunks=chunks, table=draw(scores), evict_chunk=draw(st.integers(1, 8)))


def make_budget(sc) -> BudgetConfig:
    try:
        return BudgetConfig(kv_budget=sc["budget"], n_sink=sc["n_sink"], n_recent=sc["n_recent"],
                            recent_fraction=sc["frac"], protect_prompt=sc["protect"], evict_chunk=sc["evict_chunk"])
    except BudgetError:
        assume(False)


def check_round_selection(engine, round_events_before):
    for ev in engine.stats.events[round_events_before:]:
        expect = select_evictions(ev.positions, ev.scores, ev.protected, len(ev.evicted))
        assert np.array_equal(expect, ev.evicted)
        assert not np.isin(ev.evicted, ev.positions[ev.protected]).any()


def drive(engine, decode, live_cells, sc, n_sink, prompt_end):
    """Feed the prompt then the chunks; check the invariants after each step."""
    evicted_ever: set[int] = set()
    pos = 0
    feeds = []
    left = sc["n_prompt"]
    while left:  # the prompt, chunked like Session.feed
        c = min(left, engine.prefill_chunk(12))
        feeds.append(c)
        left -= c
    feeds += sc["chunks"]
    for c in feeds:
        n_events = len(engine.stats.events)
        before = set(engine.live_positions().tolist())
        try:
            engine.make_room(c)
        except BudgetError:
            event("stopped: protection forbids the next chunk")
            return  # protection forbids it: a clear error, nothing decoded
        new = np.arange(pos, pos + c)
        decode(new)
        engine.on_decoded(new)
        pos += c
        check_round_selection(engine, n_events)
        live = engine.live_positions()
        gone = before - set(live.tolist())
        evicted_ever |= gone
        assert engine.n_live == len(live) <= engine.cfg.kv_budget
        assert not evicted_ever & set(live.tolist())                 # never comes back
        assert np.array_equal(live, np.sort(live_cells()))             # engine view == cell list
        assert live[-1] == pos - 1                                     # newest stays
        assert all(p in set(live.tolist()) for p in range(min(n_sink, pos)))  # sinks
        if prompt_end is not None:
            assert all(p in set(live.tolist()) for p in range(min(prompt_end, pos)))
    event(f"evicted {'some' if evicted_ever else 'none'}")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(scenarios())
def test_bookkeeping_against_a_model_of_llama_cpp(sc):
    budget = make_budget(sc)
    kv = FakeKV(budget.kv_budget + 12)
    engine = EvictionEngine(kv, ScriptedPolicy(table=sc["table"]), budget, record=True)
    try:
        engine.begin_prompt(0, sc["n_prompt"])
    except BudgetError:
        # the model of the rule: a protected prompt must leave the sinks, one recent and one evictable cell
        assert sc["protect"] and (sc["n_prompt"] + budget.recent_window + 1 > budget.kv_budget
                                  or budget.kv_budget - budget.n_sink - sc["n_prompt"] - 1 < 1)
        return

    def live_cells():
        c = kv.cell_positions()
        return c[c >= 0]

    drive(engine, lambda new: kv.decode(list(new), new), live_cells, sc, budget.n_sink,
          engine.prompt_end if budget.protect_prompt else None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                  HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_bookkeeping_against_the_real_llama_cpp(model, sc):
    budget = make_budget(sc)
    with Session(model, ScriptedPolicy(table=sc["table"]), budget, SessionConfig(n_batch=12, n_threads=1),
                 record=True) as s:
        try:
            s.begin_prompt(sc["n_prompt"])
        except BudgetError:
            return
        engine = s.engine
        rng = np.random.default_rng(len(sc["chunks"]))

        def decode(new):
            s.ctx.decode([int(t) for t in rng.integers(100, 1000, len(new))], new, logits_last=True)
            s.n_past += len(new)

        def live_cells():
            c = s.ctx.cell_positions()
            return c[c >= 0]

        drive(engine, decode, live_cells, sc, budget.n_sink, engine.prompt_end if budget.protect_prompt else None)


def test_property_suite_finds_a_broken_selection(monkeypatch):
    """The properties can fail: with a selection step that ignores protection they catch it."""
    import epikv_local.engine.budget as budget_mod

    def broken(positions, scores, protected, n):
        return np.sort(np.asarray(positions)[:n]).astype(np.int64)

    monkeypatch.setattr(budget_mod, "select_evictions", broken)
    sc = dict(budget=20, n_sink=4, n_recent=4, frac=0.5, protect=True, n_prompt=6, chunks=[5] * 10, table=[0.0],
              evict_chunk=2)
    budget = make_budget(sc)
    kv = FakeKV(budget.kv_budget + 12)
    engine = EvictionEngine(kv, ScriptedPolicy(table=[0.0]), budget, record=True)
    engine.begin_prompt(0, sc["n_prompt"])
    with pytest.raises(AssertionError):
        drive(engine, lambda new: kv.decode(list(new), new), lambda: np.array([p for p in kv.cells if p >= 0]), sc,
              budget.n_sink, engine.prompt_end)
