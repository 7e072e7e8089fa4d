"""Sequences in one context (engine/pool.py): batch invariance, per-sequence budgets and evictions, forks,
and a property test of random arrivals, departures, budgets, forks and cancellations against llama.cpp's own
cell table. Real model (the default one), no mocks."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.pool import SequencePool
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import ConfigError
from epikv_local.policies import make_policy

CFG = SessionConfig(n_batch=64, n_threads=1)
TEXTS = ["The capital of France is", "Once upon a time, a dragon", "def fibonacci(n):", "Water boils at"]
N_TOKENS = 40


def greedy(session: Session, prompt: list[int], n: int = N_TOKENS):
    """(tokens, (n, n_vocab) logits before each, evicted positions) of a greedy generation."""
    toks, rows = [], []
    with session.generation(), session.sampling(SamplingConfig(temperature=0)) as smp:
        session.feed(prompt, is_prompt=True)
        for _ in range(n):
            rows.append(session.logits().copy())
            t = session.sample(smp)
            toks.append(t)
            session.decode_chunk([t])
    evicted = [e.evicted.tolist() for e in session.events] if session.recording else []
    return toks, np.stack(rows), evicted


def alone_and_together(model, policy: str, budget: int):
    prompts = [model.tokenize(t) for t in TEXTS]
    alone = []
    for p in prompts:
        with Session(model, make_policy(policy), BudgetConfig(kv_budget=budget), CFG, record=True) as s:
            alone.append(greedy(s, p))
    pool = SequencePool(model, make_policy(policy), BudgetConfig(kv_budget=budget), CFG, n_seq=len(prompts))
    together: list = [None] * len(prompts)
    sessions = [pool.open(record=True) for _ in prompts]

    def run(i):
        together[i] = greedy(sessions[i], prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    shared = pool.rounds.n_shared
    for s in sessions:
        s.close()
    pool.close()
    return alone, together, shared


def test_batch_invariance_without_eviction_is_exact(model):
    """Budgets larger than the sequences: four streams decoded together give bit-identical logits (and so the
    same greedy tokens) as each decoded alone, and most rounds really carried several sequences."""
    alone, together, shared = alone_and_together(model, "streaming", 256)
    assert shared >= N_TOKENS // 2, shared
    for a, b in zip(alone, together):
        assert a[0] == b[0]
        assert np.array_equal(a[1], b[1])


def test_with_eviction_each_sequence_evicts_the_same_positions(model):
    """Budget 24 < prompt + 40 tokens: each sequence evicts on its own, and a deterministic policy
    (StreamingLLM) evicts the same positions together as alone (logits then differ in rounding: the cells'
    layout changes the attention's f16 accumulation order, see docs/parallel.md)."""
    alone, together, _ = alone_and_together(model, "streaming", 24)
    for a, b in zip(alone, together):
        assert a[2] and a[2] == b[2]


def test_a_sequence_never_holds_more_than_its_budget_or_another_ones_cells(model):
    pool = SequencePool(model, make_policy("epikv"), BudgetConfig(kv_budget=32, n_recent=8), CFG, n_seq=3)
    a, b = pool.open(), pool.open(budget=BudgetConfig(kv_budget=20, n_recent=4))
    a.feed(model.tokenize("one two three four five six seven eight nine ten " * 4), is_prompt=False)
    b.feed(model.tokenize("alpha beta gamma delta " * 6), is_prompt=False)
    for s in (a, b):
        cells = s.ctx.cell_positions(s.seq_id)
        assert sorted(cells[cells >= 0].tolist()) == s.live_positions().tolist()
        assert len(s.live_positions()) <= s.budget.kv_budget
    with pytest.raises(ConfigError, match="exceeds the pool"):
        pool.open(budget=BudgetConfig(kv_budget=64))
    c = pool.open()
    with pytest.raises(ConfigError, match="all 3 sequences"):
        pool.open()
    c.close()
    b.close()
    assert (b.ctx.cell_positions(b.seq_id) < 0).all()  # a departed sequence leaves no cell behind
    a.close()
    pool.close()


def test_fork_shares_the_prompt_cells_and_continues_alike(model):
    """A fork holds the parent's cells without copying them (used cells grow by the new tokens only) and,
    sampled greedily, continues exactly as the parent does."""
    pool = SequencePool(model, make_policy("epikv"), BudgetConfig(kv_budget=128), CFG, n_seq=3)
    parent = pool.open()
    prompt = model.tokenize("Here is a long prompt about the history of mathematics and its great ideas.")
    parent.feed(prompt, is_prompt=True)
    used = pool.used_cells()
    kids = [parent.fork(), parent.fork()]
    assert pool.used_cells() == used  # shared, not copied
    outs = []
    for s in [parent, *kids]:
        with s.sampling(SamplingConfig(temperature=0)) as smp:
            toks = []
            for _ in range(8):
                t = s.sample(smp)
                toks.append(t)
                s.decode_chunk([t])
            outs.append(toks)
    assert outs[0] == outs[1] == outs[2]
    assert pool.used_cells() == used + 3 * 8
    for s in [parent, *kids]:
        s.close()
    pool.close()


def test_a_late_branch_answers_the_prompt_from_its_very_logits(model):
    """``n`` > 1 choices branch the first one after it has generated a few tokens: rewinding the branch to the
    prompt keeps the prompt's own next-token logits (bit for bit) instead of decoding the last prompt token
    again, whose one-token decode rounds differently from the prompt's chunk (a greedy flip on the CI
    machine). A different prompt, or one token less, still decodes."""
    pool = SequencePool(model, make_policy("epikv"), BudgetConfig(kv_budget=128), CFG, n_seq=3)
    parent = pool.open()
    prompt = model.tokenize("Here are some notes about rivers, mountains and the weather in the north:")
    with parent.generation(), parent.sampling(SamplingConfig(temperature=0)) as smp:
        parent.feed(prompt, is_prompt=True)
        first = parent.logits().copy()
        for _ in range(5):
            parent.decode_chunk([parent.sample(smp)])
    kid = parent.fork()
    assert kid.rewind_to_prefix(prompt) == len(prompt) == kid.n_past
    assert np.array_equal(kid.logits(), first)
    assert kid.rewind_to_prefix(prompt[:-1]) == len(prompt) - 2  # not the prompt fed: its last token decodes
    assert parent.rewind_to_prefix(prompt + [prompt[0]]) == len(prompt)  # the prompt's cells kept, one to feed
    for s in (kid, parent):
        s.close()
    pool.close()


def test_callback_route_and_attention_policies_serve_one_sequence(model):
    with pytest.raises(ConfigError, match="one sequence per context"):
        SequencePool(model, make_policy("epikv"), BudgetConfig(kv_budget=64),
                     SessionConfig(n_batch=16, n_threads=1, capture_route="callback"), n_seq=2)


ops = st.lists(st.tuples(st.sampled_from(["open", "feed", "close", "fork", "cancel"]), st.integers(0, 9),
                         st.integers(1, 70)), min_size=4, max_size=24)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_property_random_arrivals_departures_budgets_forks(model, script):
    """Against llama.cpp's own cell table after every step: each sequence's cells are exactly its engine's live
    positions (so no eviction removed another's cell), never more than its budget, and a departed sequence
    leaves none behind."""
    pool = SequencePool(model, make_policy("streaming"), BudgetConfig(kv_budget=48, n_recent=8), CFG, n_seq=4)
    live: list[Session] = []
    gone: list[int] = []
    vocab = model.info.n_vocab
    try:
        for op, pick, n in script:
            if op == "open" and pool.n_free:
                budget = BudgetConfig(kv_budget=16 + (pick % 4) * 8, n_recent=4)
                live.append(pool.open(budget=budget))
            elif op == "fork" and live and pool.n_free:
                live.append(live[pick % len(live)].fork())
            elif op == "close" and live:
                s = live.pop(pick % len(live))
                gone.append(s.seq_id)
                s.close()
            elif op == "cancel" and live:
                live[pick % len(live)].cancel()  # outside a generation: no effect on feeds
            elif op == "feed" and live:
                s = live[pick % len(live)]
                s.feed([(pick * 7919 + i * 104729) % vocab for i in range(n)])
            held = set()
            for s in live:
                cells = s.ctx.cell_positions(s.seq_id)
                mine = sorted(cells[cells >= 0].tolist())
                assert mine == s.live_positions().tolist()
                assert len(mine) <= s.budget.kv_budget
                held.add(s.seq_id)
            for sid in gone:
                if sid not in held:
                    assert (pool.ctx.cell_positions(sid) < 0).all()
    finally:
        for s in live:
            s.close()
        pool.close()


@pytest.mark.parametrize("how", ["ends", "cancelled"])
def test_a_generation_that_stops_releases_a_leader_gathering_for_it(model, how):
    """A round's leader waits for every generating sequence's part (gather_s: here an hour); a generation that
    ends or is cancelled without posting must let it decode at once (SequencePool.wake), not after the hour."""
    toks = model.tokenize(TEXTS[0])
    with SequencePool(model, make_policy("streaming"), BudgetConfig(kv_budget=64), CFG, n_seq=2,
                      gather_s=3600.0) as pool:
        a, b = pool.open(), pool.open()
        done = threading.Event()

        def run():
            with a.generation():
                a.feed(toks, is_prompt=True)
            done.set()

        with b.generation():
            t = threading.Thread(target=run, daemon=True)
            t.start()
            for _ in range(6000):  # until a's part waits for b's (the leader is gathering)
                with pool._cond:
                    if pool._pending and not pool._busy:
                        break
                t.join(0.01)
            else:
                pytest.fail("the first sequence's prompt never waited for the second's")
            assert not done.is_set()
            if how == "cancelled":
                b.cancel()
                t.join(120)
                assert done.is_set()
        t.join(120)
        assert done.is_set() and a.n_past == len(toks)
        a.close()
        b.close()


def test_a_prompt_split_across_shared_rounds_still_counts_down_what_is_left(model):
    """``Observation.prompt_left`` when the pool splits a prompt's chunk: a sequence generating one token per
    round takes a row first, so the other's 64-token prompt chunks are decoded 63 + 1 and so on; every part still
    says how many of the prompt's tokens follow it."""
    from epikv_local.policies.streaming import StreamingLLM

    seen = []

    class Recorder(StreamingLLM):
        def observe(self, obs):
            seen.append((id(self), int(obs.positions[0]), len(obs.positions), obs.prompt_left, bool(obs.given.all())))
            super().observe(obs)

    pool = SequencePool(model, Recorder(), BudgetConfig(kv_budget=1024), CFG, n_seq=2)
    a, b = pool.open(), pool.open()
    long_prompt = model.tokenize("Reasoning notes, step by step. " * 40)
    started = threading.Event()

    def talk():
        with a.generation(), a.sampling(SamplingConfig(temperature=0)) as smp:
            a.feed(model.tokenize("Count to fifty:"), is_prompt=True)
            for i in range(120):
                if i == 2:
                    started.set()
                a.decode_chunk([a.sample(smp)])

    t = threading.Thread(target=talk)
    t.start()
    try:
        assert started.wait(timeout=300)
        b.feed(long_prompt, is_prompt=True)
    finally:
        t.join(timeout=300)
        a.close()
        b.close()
        pool.close()
    mine = [c for c in seen if c[0] == id(b.policy)]
    assert sum(n for _, _, n, _, _ in mine) == len(long_prompt)
    assert any(n not in (CFG.n_batch, len(long_prompt) % CFG.n_batch) for _, _, n, _, _ in mine)  # split parts
    for _, first, n, left, given in mine:
        assert given and left == len(long_prompt) - (first + n)


def test_a_policy_that_raises_when_asked_for_surprisal_fails_its_own_call_not_the_round(model):
    """``Policy.wants_surprise`` runs in the pool's round, like ``make_room``: an exception there is the calling
    sequence's error, raised to its caller as itself, while the sequence generating beside it in the same rounds
    goes on (an error of the round itself would fail every part of it)."""
    from epikv_local.policies.surprise import SurprisePolicy

    class Refusing(SurprisePolicy):
        def wants_surprise(self, given, min_cells):
            if given:  # a prompt's tokens
                raise RuntimeError("refused")
            return True

    pool = SequencePool(model, Refusing(), BudgetConfig(kv_budget=256), CFG, n_seq=2)
    a, b = pool.open(), pool.open()
    a.feed(model.tokenize(TEXTS[0]))  # not a prompt: not refused
    started, errors = threading.Event(), []

    def talk():
        try:
            with a.generation(), a.sampling(SamplingConfig(temperature=0)) as smp:
                for i in range(60):
                    if i == 2:
                        started.set()
                    a.decode_chunk([a.sample(smp)])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            started.set()

    t = threading.Thread(target=talk)
    t.start()
    try:
        assert started.wait(timeout=300)
        with pytest.raises(RuntimeError, match="refused"):
            b.feed(model.tokenize(TEXTS[1]), is_prompt=True)
    finally:
        t.join(timeout=300)
        a.close()
        b.close()
        pool.close()
    assert not t.is_alive() and errors == []
