"""The ``said`` policy: the words a caller gave outrank the model's own tokens; unit tests on synthetic marks, then
a two-turn conversation on the real model where a later turn's words survive evictions that StreamingLLM makes."""

from __future__ import annotations

import numpy as np
import pytest

from epikv_local.api.generation import generate
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.policies import ModelShape, Observation, make_policy

SHAPE = ModelShape(n_layer=30, n_embd=576, n_head=9, n_head_kv=3)


def fed(policy, *chunks):
    """Observe chunks of (positions, given) in order; returns the policy."""
    policy.bind(SHAPE)
    for pos, given in chunks:
        pos = np.asarray(pos, dtype=np.int64)
        policy.observe(Observation(positions=pos, given=None if given is None else np.full(len(pos), given)))
    return policy


@pytest.mark.parametrize("order", ["oldest", "base"])
def test_a_later_turns_words_outrank_the_models_own(order):
    p = fed(make_policy("said", given_order=order), (range(0, 4), True), (range(4, 10), False), (range(10, 16), True))
    s = p.score(np.arange(16))
    assert s[10:16].min() > s[0:10].max()
    assert np.all(np.diff(s[0:10]) > 0)  # the starting prompt and the model's own: the streaming base, newer = keep
    # a later turn's words: the oldest kept longest (as a protected prompt), or the base's order
    assert np.all(np.diff(s[10:16]) < 0) if order == "oldest" else np.all(np.diff(s[10:16]) > 0)
    assert np.array_equal(np.argsort(s, kind="stable")[:10], np.arange(10))  # what goes first


def test_the_starting_prompt_is_left_to_the_base():
    """One prompt (a passkey context with the prompt counted): no token has the tier, the base decides."""
    q = fed(make_policy("said"), (range(0, 12), True), (range(12, 20), True))
    s = q.score(np.arange(20))
    assert s.max() <= 1.0 and np.array_equal(np.argsort(s), np.arange(20))


def test_prompt_puts_the_starting_prompt_in_the_tier_up_to_its_share():
    """``said_prompt``: with the prompt counted, the question (the oldest given words first) outranks the model's
    own tokens, but only ``share`` of the live cells keep the tier."""
    named = make_policy("said_prompt")
    assert (named.prompt, named.share, named.base) == (True, 0.5, "epikv") and make_policy("said_epikv").prompt is False
    p = fed(make_policy("said", prompt=True, share=0.5), (range(0, 6), True), (range(6, 16), False))
    s = p.score(np.arange(16))
    assert s[0:6].min() > s[6:16].max()  # 6 of 16 given: all within round(0.5 * 16) = 8
    assert np.all(np.diff(s[0:6]) < 0)  # oldest kept longest
    q = fed(make_policy("said", prompt=True, share=0.5), (range(0, 12), True), (range(12, 16), False))
    t = q.score(np.arange(16))
    assert np.flatnonzero(t >= 2.0).tolist() == list(range(8))  # the share bounds it: the 8 oldest
    r = fed(make_policy("said", prompt=True, share=1.0), (range(0, 12), True), (range(12, 16), False))
    assert np.flatnonzero(r.score(np.arange(16)) >= 2.0).tolist() == list(range(12))


def test_a_protected_prompt_takes_no_slot_of_the_tier():
    """With the starting prompt protected (``Observation.protected``), ``prompt=True`` leaves it out of the tier:
    its cells are never candidates, so the share's slots all go to a later turn's words."""
    def chunks(protect):
        p = make_policy("said", prompt=True, share=0.5)
        p.bind(SHAPE)
        for pos, given in ((range(0, 8), True), (range(8, 12), False), (range(12, 20), True), (range(20, 24), False)):
            pos = np.arange(pos.start, pos.stop)
            p.observe(Observation(positions=pos, given=np.full(len(pos), given),
                                  protected=np.full(len(pos), protect and pos[0] < 8)))
        return np.flatnonzero(p.score(np.arange(24)) >= 2.0).tolist()

    assert chunks(protect=False) == list(range(8)) + list(range(12, 16))  # 12 slots: the prompt first
    assert chunks(protect=True) == list(range(12, 20))  # the later turn's 8 words, all of them


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_prompt_setting_is_a_bool(bad):
    from epikv_local.errors import ConfigError

    with pytest.raises(ConfigError, match="prompt must be true or false"):
        make_policy("said", prompt=bad)


def test_said_facts_puts_the_models_numbers_under_the_prompt_and_over_its_other_text():
    """``said_facts``: the counted prompt's tier on top, then the model's own numbers and the tokens beside them
    (the ``facts`` base, which asks the engine for the digit marks), then the rest of its text."""
    p = make_policy("said_facts")
    sig = p.bind(SHAPE)
    assert (p.prompt, p.share, p.base) == (True, 0.5, "facts") and sig.numbers
    pos = np.arange(20, dtype=np.int64)
    g = np.random.default_rng(0).random((20, len(sig.g_layers)))  # EPIKV's input: any scores will do
    p.observe(Observation(positions=pos[:6], g=g[:6], given=np.ones(6, bool), numeric=np.isin(pos[:6], [2])))
    p.observe(Observation(positions=pos[6:], g=g[6:], given=np.zeros(14, bool), numeric=np.isin(pos[6:], [12])))
    s = p.score(pos)
    assert s[0:6].min() > s[6:].max()
    own = np.setdiff1d(np.arange(6, 20), [11, 12, 13])
    assert s[[11, 12, 13]].min() > s[own].max()


@pytest.mark.parametrize("order,tier", [("oldest", [6, 7, 8, 9]), ("base", [12, 13, 14, 15])])
def test_share_bounds_the_given_tier(order, tier):
    p = fed(make_policy("said", share=0.25, given_order=order), (range(0, 2), True), (range(2, 6), False),
            (range(6, 16), True))
    s = p.score(np.arange(16))
    assert np.flatnonzero(s >= 2.0).tolist() == tier  # round(0.25 * 16) = 4 given tokens keep the tier
    assert s[[i for i in range(16) if i not in tier]].max() <= 1.0  # the rest rank with the model's


def test_unmarked_tokens_leave_the_base_order_unchanged():
    p = fed(make_policy("said"), (range(0, 20), None), (range(20, 24), None))
    s = p.score(np.arange(3, 20))
    assert np.array_equal(np.argsort(s), np.arange(17))
    assert s.max() <= 1.0  # no tier


def test_state_follows_a_branch_and_a_reset():
    import copy

    p = fed(make_policy("said"), (range(0, 4), False), (range(4, 8), True))
    q = make_policy("said")
    q.bind(SHAPE)
    vars(q).update(copy.deepcopy(vars(p)))
    assert np.array_equal(q.score(np.arange(8)), p.score(np.arange(8)))
    p.reset()
    assert p.score(np.arange(8)).max() <= 1.0


@pytest.mark.parametrize("base", ["streaming", "epikv", "keydiff"])
def test_a_later_turn_survives_evictions_that_streaming_makes(model, base):
    """Turn 1 is the protected prompt; turn 2's words are fed as a prompt after 120 generated tokens. At a budget
    of 128 with a 32-token recent window, 200 more generated tokens force evictions: ``said`` keeps every cell
    of turn 2 (the model's own tokens go), StreamingLLM evicts them."""
    turn1 = model.tokenize("Tell me a long story about a ship.")
    turn2 = model.tokenize(" Now remember this: my locker code is 4412. Continue the story.", add_special=False)
    budget = BudgetConfig(kv_budget=128, n_recent=32, evict_chunk=8)
    kept = {}
    for name, options in (("said", {"base": base}), ("streaming", {})):
        with Session(model, make_policy(name, **options), budget, SessionConfig(n_threads=2)) as s:
            generate(s, turn1, 120, SamplingConfig(), ignore_eog=True)
            start = s.n_past
            generate(s, s.tokens + turn2, 200, SamplingConfig(), ignore_eog=True, reuse_prefix=True)
            live = s.live_positions()
            assert s.stats().max_live <= 128 and s.stats().n_evicted > 0
            kept[name] = np.isin(np.arange(start, start + len(turn2)), live).mean()
    assert kept["said"] == 1.0
    assert kept["streaming"] == 0.0


@pytest.mark.parametrize("name,n_recent,repeat", [("said_epikv", None, 2), ("said_words_deep", None, 2),
                                                  ("streaming", None, 2), ("said_words_deep", 16, 3),
                                                  ("said_epikv", 16, 3)])
def test_a_long_protected_first_prompt_leaves_a_later_turn_its_tier(model, name, n_recent, repeat):
    """``said_words_deep``'s tier (half the cells) holds a protected first prompt's words only where they are not
    protected, so a long first prompt cannot crowd a later turn out, whatever the recent window: a first prompt
    of 39 tokens (the default window, half the budget) or 58 (a 16-cell window, where 58 prompt words would leave
    6 of the tier's 64 slots) at 128 cells, 40 generated tokens, a 19-token turn 2 and 200 more: every cell of
    turn 2 kept, as ``said_epikv`` keeps it (StreamingLLM: none)."""
    turn1 = model.tokenize("Here are my notes on ships, harbours, tides and the old lighthouse by the bay. " * repeat)
    turn2 = model.tokenize(" Now remember this: my locker code is 4412. Continue the story.", add_special=False)
    assert len(turn1) in (39, 58) and len(turn2) <= 20  # the turn fits the cells the prompt and window leave
    # a round evicts 4 of the 25 (or 54) cells a policy may choose: room for turn 2 beside the model's own tokens
    budget = BudgetConfig(kv_budget=128, n_recent=n_recent, evict_chunk=4)
    with Session(model, make_policy(name), budget, SessionConfig(n_threads=2)) as s:
        generate(s, turn1, 40, SamplingConfig(), ignore_eog=True)
        start = s.n_past
        generate(s, s.tokens + turn2, 200, SamplingConfig(), ignore_eog=True, reuse_prefix=True)
        assert s.stats().max_live <= 128 and s.stats().n_evicted > 150
        kept = np.isin(np.arange(start, start + len(turn2)), s.live_positions()).mean()
    assert kept == (0.0 if name == "streaming" else 1.0)


@pytest.mark.parametrize("name,protect", [("said_epikv", True), ("said_epikv", False), ("said_words_deep", True)])
def test_on_one_prompt_said_epikv_is_epikv(model, name, protect):
    """On one prompt, protected or counted against the budget, no token has the tier: the evictions (and so the
    tokens) of ``said_epikv`` are EPIKV's own, so single-turn figures of EPIKV hold for it. ``said_words_deep``
    puts the starting prompt in its tier, but a protected prompt is never a candidate: the same evictions."""
    prompt = model.tokenize("Explain step by step how to compute 17 * 23, then check the result. " * (1 + 3 * (not protect)))
    budget = BudgetConfig(kv_budget=96, n_recent=32, evict_chunk=8, protect_prompt=protect)
    runs = {}
    for policy in ("epikv", name):
        with Session(model, make_policy(policy), budget, SessionConfig(n_threads=2), record=True) as s:
            res = generate(s, prompt, 160, SamplingConfig(), ignore_eog=True)
            runs[policy] = (res.tokens, [ev.evicted.tolist() for ev in s.events])
    assert runs["epikv"][1] and runs[name] == runs["epikv"]


def test_said_prompt_keeps_a_counted_prompt_where_epikv_evicts_it(model, kept_of_counted_prompt):
    """A 24-token question counted against a 96-cell budget, then 200 generated tokens: ``said_prompt`` keeps
    every cell of the question (24 < half of 96), EPIKV evicts some of it; both stay within the budget."""
    prompt = model.tokenize("A farm has 37 cows and twice as many sheep. How many animals live on the farm?")
    assert 16 <= len(prompt) <= 40
    kept = {name: kept_of_counted_prompt(name, prompt, np.arange(len(prompt))) for name in ("said_prompt", "epikv")}
    assert kept["said_prompt"] == 1.0
    assert kept["epikv"] < 1.0


def test_said_surprise_keeps_the_prompts_most_surprising_words_in_its_tier():
    """``said_surprise``: a counted prompt's tier (at most ``share`` of the cells) holds its most surprising words
    (the window score of ``surprise``), not its oldest; the model's own tokens below, by surprise too."""
    p = make_policy("said_surprise")
    assert (p.prompt, p.share, p.base, p.given_order) == (True, 0.5, "surprise", "base")
    p.bind(SHAPE)
    nll = np.full(40, 0.1)
    nll[20:24] = 5.0  # a surprising span late in the prompt
    nll[34:36] = 3.0  # a surprising pair in the model's own text
    for pos, given in ((np.arange(0, 30), True), (np.arange(30, 40), False)):
        p.observe(Observation(positions=pos, given=np.full(len(pos), given), surprise=nll[pos]))
    s = p.score(np.arange(40))
    tier = np.flatnonzero(s >= 2.0)
    assert set(range(20, 24)) <= set(tier)  # the surprising late span has the tier, not only the oldest words
    assert s[20:24].min() > s[0:8].max()  # it outranks the oldest words
    assert s[34] > s[39]  # below the tier, the model's own text by surprise (39 is newer and less surprising)


def test_said_prompt_surprise_orders_the_tier_by_surprise_and_the_models_own_by_the_base():
    """``given_order="surprise"`` over another base: the caller's words ranked by the model's surprisal (the
    window score of ``surprise``), the model's own tokens by the base (streaming here: newer = keep; EPIKV in the
    registered ``said_prompt_surprise``, which asks for EPIKV's layers and for the surprisal together)."""
    reg = make_policy("said_prompt_surprise")
    assert (reg.prompt, reg.share, reg.base, reg.given_order) == (True, 0.5, "epikv", "surprise")
    sig = reg.bind(SHAPE)
    assert sig.surprise and len(sig.g_layers) > 0
    p = make_policy("said", prompt=True, share=0.5, given_order="surprise")
    p.bind(SHAPE)
    nll = np.random.default_rng(7).gamma(1.0, 1.0, 60)  # nats, no ties
    for pos, given in ((np.arange(0, 40), True), (np.arange(40, 60), False)):
        p.observe(Observation(positions=pos, given=np.full(len(pos), given), surprise=nll[pos]))
    s = p.score(np.arange(60))
    tier = set(np.flatnonzero(s >= 2.0).tolist())
    alone = make_policy("surprise")
    alone.bind(SHAPE)
    alone.observe(Observation(positions=np.arange(60), surprise=nll))
    w = alone.score(np.arange(40))
    out = sorted(set(range(40)) - tier)
    assert len(tier) == 30  # share 0.5 of 60 cells: 30 of the 40 given words
    assert w[sorted(tier)].min() >= w[out].max() and w[sorted(tier)].mean() > w[out].mean()  # the most surprising
    assert tier != set(range(30)) and tier != set(range(10, 40))  # neither the oldest words nor the newest
    assert np.all(np.diff(s[40:60]) > 0)  # the model's own text: the base's order, newer = keep
    p.reset()
    assert np.isnan(p._order.score(np.arange(4))).all()  # the order's state goes with a reset


def test_template_last_puts_the_templates_words_below_the_callers_in_the_tier():
    """``said_words``: the tokens a chat template wrote (a default system prompt, role markers, the generation
    prompt) rank below the caller's words inside the tier, each group oldest first; where the tier is too small
    for the whole prompt, the template's words go and the whole question stays. Without marks it is
    ``said_prompt``."""
    reg = make_policy("said_words")
    assert (reg.prompt, reg.share, reg.base, reg.given_order, reg.template_last) == (True, 0.5, "epikv", "oldest", True)
    template = np.zeros(30, dtype=bool)
    template[0:8] = True  # the system turn and the user's role marker
    template[26:30] = True  # the end of turn and the generation prompt
    p = make_policy("said", prompt=True, share=0.5, template_last=True)
    p.bind(SHAPE)
    p.observe(Observation(positions=np.arange(30), given=np.ones(30, dtype=bool), template=template))
    p.observe(Observation(positions=np.arange(30, 50), given=np.zeros(20, dtype=bool)))
    s = p.score(np.arange(50))
    tier = np.flatnonzero(s >= 2.0).tolist()
    assert tier == list(range(0, 7)) + list(range(8, 26))  # 25 cells: the 18 words, then the 7 oldest template
    assert s[8:26].min() > s[:30][template].max()  # every caller's word above every template word
    assert np.all(np.diff(s[8:26]) < 0)  # the caller's words: oldest kept longest
    assert np.all(np.diff(s[30:50]) > 0)  # the model's own text: the base's order (streaming: newer = keep)
    plain = make_policy("said", prompt=True, share=0.5)
    plain.bind(SHAPE)
    plain.observe(Observation(positions=np.arange(30), given=np.ones(30, dtype=bool), template=template))
    plain.observe(Observation(positions=np.arange(30, 50), given=np.zeros(20, dtype=bool)))
    assert np.flatnonzero(plain.score(np.arange(50)) >= 2.0).tolist() == list(range(25))  # said_prompt: oldest 25
    q = make_policy("said", prompt=True, share=0.5, template_last=True)
    q.bind(SHAPE)
    q.observe(Observation(positions=np.arange(30), given=np.ones(30, dtype=bool)))  # no marks: a raw prompt
    q.observe(Observation(positions=np.arange(30, 50), given=np.zeros(20, dtype=bool)))
    assert np.array_equal(q.score(np.arange(50)), plain.score(np.arange(50)))
    p.reset()
    assert np.isnan(p._template.values).all()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_template_last_setting_is_a_bool(bad):
    from epikv_local.errors import ConfigError

    with pytest.raises(ConfigError, match="template_last"):
        make_policy("said", template_last=bad)


def test_template_last_with_the_surprise_order_ranks_the_callers_words_by_surprise_and_the_templates_last():
    """``template_last`` with ``given_order="surprise"``: inside the tier the caller's words are ranked by the
    model's surprisal, and the template's tokens (a role marker is very surprising to the model) still leave the
    tier first."""
    p = make_policy("said", prompt=True, share=0.5, given_order="surprise", template_last=True)
    p.bind(SHAPE)
    nll = np.full(40, 0.2)
    nll[0:4] = 20.0  # role markers: very surprising
    nll[20:24] = 30.0  # a fact late in the caller's words, more surprising still
    template = np.zeros(30, dtype=bool)
    template[0:4] = True
    p.observe(Observation(positions=np.arange(30), given=np.ones(30, dtype=bool), template=template, surprise=nll[:30]))
    p.observe(Observation(positions=np.arange(30, 40), given=np.zeros(10, dtype=bool), surprise=nll[30:]))
    s = p.score(np.arange(40))
    tier = set(np.flatnonzero(s >= 2.0).tolist())
    assert len(tier) == 20 and set(range(20, 24)) <= tier  # share 0.5 of 40 cells; the fact has the tier
    assert 11 not in tier  # an older, unsurprising word does not: not the oldest first
    assert not tier & set(range(4))  # no template token while caller's words are left out


def test_oldest_or_surprise_keeps_the_oldest_words_and_the_most_surprising_ones():
    """``given_order="oldest_or_surprise"`` (registered ``said_words_either``, with the template last): a caller's
    word keeps the tier while it is among the oldest or among the most surprising, so a tier far smaller than the
    words holds both the start of the text and a fact deep inside it, and a template token still leaves first."""
    reg = make_policy("said_words_either")
    assert (reg.prompt, reg.share, reg.base, reg.given_order, reg.template_last) == \
        (True, 0.5, "epikv", "oldest_or_surprise", True)
    sig = reg.bind(SHAPE)
    assert sig.surprise and len(sig.g_layers) > 0
    p = make_policy("said", prompt=True, share=0.5, given_order="oldest_or_surprise", template_last=True)
    p.bind(SHAPE)
    nll = np.random.default_rng(3).uniform(0.1, 1.0, 100)  # nats, no ties
    nll[60:64] = 12.0 + np.arange(4)  # a fact deep in the caller's words
    template = np.zeros(80, dtype=bool)
    template[0:3] = True  # a role marker: as surprising as the fact
    nll[0:3] = 15.0
    p.observe(Observation(positions=np.arange(80), given=np.ones(80, dtype=bool), template=template, surprise=nll[:80]))
    p.observe(Observation(positions=np.arange(80, 100), given=np.zeros(20, dtype=bool), surprise=nll[80:]))
    s = p.score(np.arange(100))
    tier = set(np.flatnonzero(s >= 2.0).tolist())
    assert len(tier) == 50  # share 0.5 of 100 cells: 50 of the 77 caller's words
    assert set(range(60, 64)) <= tier  # the fact, deep in the text: by surprise
    assert set(range(3, 20)) <= tier  # the text's start: the oldest words
    assert not tier & set(range(3))  # the template's tokens first out, surprising as they are
    oldest = make_policy("said", prompt=True, share=0.5, template_last=True)
    oldest.bind(SHAPE)
    oldest.observe(Observation(positions=np.arange(80), given=np.ones(80, dtype=bool), template=template))
    oldest.observe(Observation(positions=np.arange(80, 100), given=np.zeros(20, dtype=bool)))
    assert not set(range(60, 64)) & set(np.flatnonzero(oldest.score(np.arange(100)) >= 2.0).tolist())
    with pytest.raises(Exception, match="given_order"):
        make_policy("said", given_order="newest")


def test_surprise_beyond_gives_slots_to_surprising_words_only_when_the_callers_words_far_overflow_the_tier():
    """``surprise_beyond=b``: while the caller's words given so far (evicted ones included, the template's not)
    number at most b tiers, the tier keeps the oldest words, a question that nearly fits whole from its start;
    beyond that, the overflow's worth of slots (the whole tier at most) go to the most surprising words, so a
    fact deep in a long text is kept; a template token never gets a slot."""
    nll = np.random.default_rng(5).uniform(0.1, 1.0, 100)  # nats, no ties
    nll[60:64] = 12.0 + np.arange(4)  # a fact deep in the caller's words
    nll[0:3] = 15.0  # a role marker: as surprising as the fact
    template = np.zeros(80, dtype=bool)
    template[0:3] = True

    def tier(scored=np.arange(100), **kw):
        p = make_policy("said", prompt=True, share=0.5, template_last=True, **kw)
        assert p.bind(SHAPE).surprise == bool(kw)  # the logits are asked for only when the slots read them
        p.observe(Observation(positions=np.arange(80), given=np.ones(80, dtype=bool), template=template,
                              surprise=nll[:80]))
        p.observe(Observation(positions=np.arange(80, 100), given=np.zeros(20, dtype=bool), surprise=nll[80:]))
        return set(scored[p.score(scored) >= 2.0].tolist())

    plain = tier()
    assert len(plain) == 50 and plain == set(range(3, 53))  # share 0.5 of 100 cells: the oldest caller's words
    assert tier(surprise_beyond=2.0) == plain  # 77 words, not beyond 2 tiers of 50: oldest first
    slots = tier(surprise_beyond=1.0)  # 27 words beyond one tier: 27 slots by surprise, 23 oldest
    assert len(slots) == 50 and set(range(60, 64)) <= slots and not slots & set(range(3))
    assert set(range(3, 26)) <= slots and not slots & set(range(45, 53)) - set(np.argsort(-nll[3:80])[:27] + 3)
    # 20 older cells evicted: 80 scored, a tier of 40; the 77 words given so far (not the 60 live) are 17 beyond
    # 1.5 tiers, and the fact, outside the oldest 40 live words, gets slots
    assert not set(range(60, 64)) & tier(np.arange(20, 100))
    assert set(range(60, 64)) <= tier(np.arange(20, 100), surprise_beyond=1.5)
    # a prompt's first chunk says how much of it is still to come: 37 words + 1,000 to come are beyond 2 tiers of 20,
    # so the fact gets its slots at once, before "oldest first" (3..22) would have evicted it
    def first_chunk(left):
        p = make_policy("said", prompt=True, share=0.5, template_last=True, surprise_beyond=2.0)
        p.bind(SHAPE)
        p.observe(Observation(positions=np.arange(40), given=np.ones(40, dtype=bool), template=template[:40],
                              surprise=np.r_[nll[:30], nll[60:64], nll[30:36]], prompt_left=left))
        return set(np.flatnonzero(p.score(np.arange(40)) >= 2.0).tolist())

    assert set(range(30, 34)) <= first_chunk(1000)
    assert first_chunk(0) == set(range(3, 23))  # a short prompt: oldest first
    # the slots rank among themselves by surprise, not age: when eviction must cut into the tier (its slots in the
    # protected recent window), the most surprising words outlast older, duller ones
    rising = make_policy("said", prompt=True, share=0.5, surprise_beyond=1.0)
    rising.bind(SHAPE)
    rising.observe(Observation(positions=np.arange(80), given=np.ones(80, dtype=bool),
                               surprise=np.linspace(0.1, 8.0, 80)))  # newer words more surprising
    rising.observe(Observation(positions=np.arange(80, 100), given=np.zeros(20, dtype=bool), surprise=np.ones(20)))
    s = rising.score(np.arange(100))
    slots = np.flatnonzero(s >= 2.0)[-30:]  # 80 words, 30 beyond a tier of 50: the 30 newest, most surprising
    assert np.array_equal(slots, np.arange(50, 80)) and np.all(np.diff(s[50:64]) > 0)  # (windows inside the words)
    # a rewind forgets the dropped branch's words: a long text, then a short question from position 10 on
    branch = make_policy("said", prompt=True, share=0.5, surprise_beyond=2.0)
    branch.bind(SHAPE)
    branch.observe(Observation(positions=np.arange(200), given=np.ones(200, dtype=bool),
                               surprise=np.linspace(0.1, 8.0, 200)))
    branch.observe(Observation(positions=np.arange(10, 30), given=np.ones(20, dtype=bool),
                               surprise=np.linspace(0.1, 8.0, 20)))
    assert set(np.flatnonzero(branch.score(np.arange(30)) >= 2.0).tolist()) == set(range(15))  # 30 words: oldest
    reg = make_policy("said_words_deep")
    assert (reg.prompt, reg.share, reg.base, reg.given_order, reg.template_last, reg.surprise_beyond) == \
        (True, 0.5, "epikv", "oldest", True, 2.0)
    from epikv_local.errors import ConfigError

    for bad in (-1.0, 0.5, True, "2", float("nan")):
        with pytest.raises(ConfigError, match="surprise_beyond"):
            make_policy("said", surprise_beyond=bad)


def test_surprise_beyond_judges_each_turn_by_its_own_length():
    """A turn is the caller's words between two of the model's tokens. Only a turn too long for ``surprise_beyond``
    tiers gets slots by surprise; the words of the turns that fit (a fact, a question) rank above them, oldest
    first, and several short turns are kept oldest first however many words they add up to. Why: with the
    count over the whole chat, 3 turns of ~150 pasted words each put every tier slot on surprise, and the facts
    of the short turns before them, decoded without surprisal, lost their place (the pasted-notes chat, dev)."""
    def chat(turns, scored=None, **kw):
        p = make_policy("said", prompt=True, share=0.5, surprise_beyond=1.0, **kw)
        p.bind(SHAPE)
        at = 0
        for words, surprise in turns:  # each turn, then 20 of the model's own tokens
            p.observe(Observation(positions=np.arange(at, at + words), given=np.ones(words, dtype=bool),
                                  surprise=np.asarray(surprise, dtype=np.float64)))
            p.observe(Observation(positions=np.arange(at + words, at + words + 20), given=np.zeros(20, dtype=bool),
                                  surprise=np.zeros(20)))
            at += words + 20
        scored = np.arange(at) if scored is None else scored
        return p, set(scored[p.score(scored) >= 2.0].tolist()), at

    # a fact of 10 words (no surprisal: decoded while the chat was short), then a pasted text of 320 words with 4
    # surprising ones deep inside, of which the newest 120 are live: 150 cells scored, a tier of 75; the text
    # alone overflows one tier by 245, so the tier holds the fact and the text's 65 most surprising words
    text = np.full(320, 0.5)
    text[270:274] = 9.0
    live = np.r_[np.arange(10), np.arange(230, 370)]
    p, tier, n = chat([(10, np.full(10, np.nan)), (320, text)], scored=live)
    assert n == 370 and len(tier) == 75
    assert set(range(10)) <= tier  # the short turn's words all kept (the count over the chat gave every slot to surprise)
    assert set(range(300, 304)) <= tier  # the surprising words of the long one
    # two turns of 100 words: 240 cells scored, a tier of 120; neither turn is beyond one tier, so oldest first
    # (the count over the chat, 200 words, would have put 80 slots on surprise, here the newest words)
    _, tier, n = chat([(100, np.linspace(0.1, 1.0, 100)), (100, np.linspace(2.0, 9.0, 100))])
    assert n == 240 and tier == set(range(100)) | set(range(120, 140))
    # the surprisal is asked for by the turn being decoded: a new turn counts from zero, a prompt's next chunk
    # continues its turn
    q = make_policy("said", prompt=True, share=0.5, template_last=True, surprise_beyond=1.0)
    q.bind(SHAPE)
    q.observe(Observation(positions=np.arange(100), given=np.ones(100, dtype=bool)))
    assert not q.wants_surprise(given=50, min_cells=300)  # 100 + 50: one chunk more of a prompt within a tier of 150
    assert q.wants_surprise(given=51, min_cells=300)
    q.observe(Observation(positions=np.arange(100, 120), given=np.zeros(20, dtype=bool)))
    assert not q.wants_surprise(given=150, min_cells=300)  # a new turn of 150 words: the 100 before do not count
    assert q.wants_surprise(given=151, min_cells=300)
    assert not q.wants_surprise(given=0, min_cells=300)  # no turn beyond a tier
    # a rewind into the first turn forgets the turn after it: its words, and that it was a turn
    q.observe(Observation(positions=np.arange(120, 320), given=np.ones(200, dtype=bool)))
    assert q.wants_surprise(given=0, min_cells=300) and q._turns.tolist() == [100, 200]
    q.observe(Observation(positions=np.arange(90, 95), given=np.ones(5, dtype=bool)))
    assert q._turns.tolist() == [95] and not q.wants_surprise(given=0, min_cells=300)


@pytest.mark.parametrize("edit", [
    {"_turns": np.array([-5, -10**12], dtype=np.int64)}, {"_turns": np.array([2**62, 3], dtype=np.int64)},
    {"_turn_of": np.full(300, 1e18)}, {"_turn_of": np.r_[np.full(150, -3.0), np.full(150, np.inf)]},
    {"_end": 10**9}, {"_end": -7}])
def test_turn_state_from_a_session_file_never_breaks_the_policy(edit):
    """Whatever values of the right types a session file gives the turn counts, the turn of each position and the
    newest position, the policy keeps scoring, asking and observing (a rewind included) with finite scores (a
    turn id beyond the counts, with the marks saying a turn continues, once raised an IndexError mid-decode)."""
    p = make_policy("said", prompt=True, share=0.5, template_last=True, surprise_beyond=2.0)
    p.bind(SHAPE)
    p.observe(Observation(positions=np.arange(100), given=np.ones(100, dtype=bool), surprise=np.ones(100)))
    p.observe(Observation(positions=np.arange(100, 120), given=np.zeros(20, dtype=bool), surprise=np.ones(20)))
    for k, v in edit.items():
        if k == "_turn_of":
            p._turn_of.values = v
        else:
            setattr(p, k, v)
    p.wants_surprise(given=10, min_cells=100)
    assert np.isfinite(p.score(np.arange(120))).all()
    p.observe(Observation(positions=np.arange(50, 60), given=np.ones(10, dtype=bool), surprise=np.ones(10)))
    p.observe(Observation(positions=np.arange(60, 61), given=np.zeros(1, dtype=bool), surprise=np.ones(1)))
    assert np.isfinite(p.score(np.arange(61))).all()
    p.wants_surprise(given=0, min_cells=100)


def test_a_session_tells_the_policy_how_much_of_a_prompt_is_still_to_come(model):
    """``Observation.prompt_left``: a prompt counted against a small budget is decoded in several chunks, and each
    chunk's observation says how many of the prompt's tokens follow it, so ``surprise_beyond`` knows a long
    text's length from its first chunk; a later turn's prompt counts down the same way and a generated token
    says 0."""
    from epikv_local.policies.streaming import StreamingLLM

    seen = []

    class Recorder(StreamingLLM):
        def observe(self, obs):
            seen.append((int(obs.positions[0]), len(obs.positions), obs.prompt_left, bool(obs.given.all())))
            super().observe(obs)

    prompt = model.tokenize("Reasoning notes. " * 40)
    turn = model.tokenize(" And one more thing to remember: the code is 4412." * 6, add_special=False)
    budget = BudgetConfig(kv_budget=64, n_recent=16, protect_prompt=False, evict_chunk=8)
    with Session(model, Recorder(), budget, SessionConfig(n_threads=2)) as s:
        generate(s, prompt, 3, SamplingConfig(), ignore_eog=True)
        generate(s, s.tokens + turn, 2, SamplingConfig(), ignore_eog=True, reuse_prefix=True)
    runs, run = [], []  # the given decodes, in runs between the model's own tokens
    for c in seen + [(0, 0, 0, False)]:
        if c[3]:
            run.append(c)
        elif run:
            runs, run = runs + [run], []
    assert len(runs) == 2
    for chunks, text in zip(runs, (prompt, turn)):
        assert len(chunks) > 1  # the budget splits the prompt
        end = chunks[-1][0] + chunks[-1][1]
        assert end - chunks[0][0] == len(text)
        for first, n, left, _ in chunks:
            assert left == end - (first + n)  # the tokens after this chunk
    assert all(left == 0 for _, _, left, given in seen if not given)  # the model's own tokens


def test_surprise_beyond_asks_for_surprisal_only_once_the_slots_could_open():
    """``wants_surprise``: ``surprise_beyond`` is the only reader of surprisal in ``said_words_deep``, so it asks
    for the logits of a decode only when the words given so far plus those coming exceed two tiers of the fewest
    cells a round scores; policies whose order or base reads surprisal always ask."""
    p = make_policy("said", prompt=True, share=0.5, template_last=True, surprise_beyond=2.0)  # streaming base
    p.bind(SHAPE)
    assert p.bound.surprise
    assert not p.wants_surprise(given=100, min_cells=100)  # 100 words: two tiers of 50 hold them
    assert p.wants_surprise(given=101, min_cells=100)
    assert not p.wants_surprise(given=0, min_cells=100)  # a sampled token after a short prompt
    p.observe(Observation(positions=np.arange(120), given=np.ones(120, dtype=bool), surprise=np.ones(120)))
    assert p.wants_surprise(given=0, min_cells=100)  # 120 words given: the model's own tokens too, from now on
    for name in ("said_prompt_surprise", "said_surprise", "surprise"):
        q = make_policy(name)
        q.bind(SHAPE)
        assert q.bound.surprise and q.wants_surprise(given=0, min_cells=10_000)


@pytest.mark.parametrize("sentences", [1, 12])
def test_said_words_deep_evicts_as_with_every_tokens_surprisal_while_computing_it_only_when_read(model, sentences):
    """The same session of ``said_words_deep`` at 64 cells (chunks of 16, so an eviction round scores at least 49
    cells: two tiers of 24), the prompt counted, and a copy of it that asks for every token's surprisal: the
    same evictions and the same greedy tokens. A short prompt (about 20 tokens) decodes with no surprisal at all
    (no extra logits rows); a long one (about 200) has it for every token from its first chunk on."""
    from epikv_local.policies.said import SaidEpikvPolicy

    class Always(SaidEpikvPolicy):
        def wants_surprise(self, given, min_cells):
            return True

    def run(policy):
        seen = []
        observe = policy.observe

        def recording(obs):
            seen.append(obs.surprise)
            observe(obs)

        policy.observe = recording
        budget = BudgetConfig(kv_budget=64, n_recent=16, evict_chunk=8, protect_prompt=False)
        prompt = model.tokenize("Reasoning notes: the cat sat on the mat, 83921. " * sentences)
        with Session(model, policy, budget, SessionConfig(n_threads=2, n_batch=16), record=True) as s:
            generate(s, prompt, 80, SamplingConfig(), ignore_eog=True)
            return len(prompt), list(s.tokens), [ev.evicted.tolist() for ev in s.events], seen

    kw = dict(prompt=True, share=0.5, template_last=True, surprise_beyond=2.0)
    n, tokens, events, seen = run(make_policy("said_words_deep"))
    n_all, tokens_all, events_all, seen_all = run(Always(**kw))
    assert n == n_all and tokens == tokens_all and events == events_all and len(events) > 3
    assert all(s is not None for s in seen_all)
    if n < 48:
        assert all(s is None for s in seen)
    else:
        assert n > 150 and all(s is not None for s in seen)
        assert np.array_equal(np.concatenate(seen), np.concatenate(seen_all), equal_nan=True)
