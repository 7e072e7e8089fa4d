"""Said: keep what the user said. The words a caller gave (every chat turn, tool results) outrank the model's
own tokens; a base scorer orders the model's own.

Why: only the prompt that starts a sequence is protected; a later chat turn is covered by the recent window
like any new token. At ``kv_budget=256`` StreamingLLM and EPIKV lost a fact the user gave in turn 2-4 in every
one of 12 conversations, while the full cache recalled all 12 (``scripts/bench_recall.py --task multiturn``,
docs/benchmarks.md). The engine marks each decoded token as given (fed as a prompt) or generated
(``Observation.given``); this policy scores

    model's own token:  rank01(base(p))                    in [0, 1]
    given token:        2 + rank01(order within the given)  in [2, 3]

where "given" means given after the model's first token: the prompt that starts a sequence is left to the
budget (protected by default; with ``protect_prompt=False``, the papers' setting, it is scored by the base
like any token, so on one prompt ``said_epikv`` is ``epikv`` either way). The selection step thus evicts the
model's own tokens (lowest base score first) before any later turn's words, and
given tokens only among themselves once the model's are gone: ``given_order="oldest"`` keeps the oldest
given words longest (as a protected prompt is kept: what a conversation was set up with), ``"base"`` orders
them by the base score too (on the dev conversations it lost facts that "oldest" kept), ``"surprise"`` by the
model's surprisal of them (:class:`SurprisePolicy`'s window score) whatever the base. ``share`` bounds the
given tier: at most ``round(share * N)`` of the N live positions keep it, so a long pasted document cannot
crowd out all of the model's own text outside the recent window. Tokens decoded without a mark (teacher-forced
text) count as the model's own: the policy is then its base. On one prompt every given token is left to the
base, so ``said_epikv`` evicts exactly as ``epikv`` (tested, prompt protected and counted).

``prompt=True`` puts the starting prompt in the given tier too, where the budget does not protect it
(``Observation.protected``): a protected cell is never a candidate, so a tier slot spent on it would be lost to
a later turn's words (a long protected first prompt took most of ``said_words_deep``'s half-cache tier before
this); with the prompt counted against the budget (the papers' setting) the question of a word problem is then
kept before the model's reasoning, up to ``share`` of the cells, the oldest words first (the system text and the question come before the instruction that ends a
prompt). Registered as ``said_prompt`` (``share=0.5``): the `facts` policy kept a GSM8K question's digits and
lost the words that say what they count; this keeps the words too.

``base``: ``streaming`` (oldest first), ``epikv`` (the residual-stream score; ``layers`` and ``window`` as
:class:`EpikvPolicy`), ``keydiff`` or ``facts`` (:class:`FactsPolicy`: numbers and their neighbours, then EPIKV;
registered as ``said_facts`` with ``prompt=True`` and a recent share of 0.25) or ``surprise``
(:class:`SurprisePolicy`: the model's own surprisal, a window mean; registered as ``said_surprise`` with
``prompt=True`` and ``given_order="base"``: the prompt's tier holds its most surprising words, up to ``share``).
``said_prompt_surprise`` is ``said_prompt`` with ``given_order="surprise"``: the caller's words ordered by
the model's surprisal, its own tokens by EPIKV. ``"oldest_or_surprise"`` ranks a given word by the higher of
its two ranks (oldest first, most surprising first), so the tier holds the oldest words and the most surprising
ones in about equal numbers (both ranks are taken over all the given words, the template's included): registered
with the template last as ``said_words_either``.

``template_last`` ranks the given tokens that a chat template wrote around the messages (``Observation.template``:
role markers, a default system prompt the template adds, the generation prompt) below the caller's own words in
the tier, each group in the tier's order. Why: a Qwen2.5 GSM8K prompt is ~24 template tokens (the default system
prompt) + the question + the instruction + 5 more; with the prompt counted at 192 cells only ~80 of them fit
beside the recent window, so ``said_prompt`` (oldest first) kept the boilerplate and lost the question's end: it
got 6 of the full cache's 21 right answers on the test prompts of 110 tokens or more, StreamingLLM 7. Registered
as ``said_words`` (``said_prompt`` with it). Text not rendered from messages (a raw prompt) carries no marks,
and then it is ``said_prompt``.
``surprise_beyond=b`` (0: off) picks between the two orders by length, turn by turn (a turn: the caller's words
between two of the model's tokens). While a turn's words (evicted ones included; the template's and a protected
prompt's not; for the turn being decoded, the rest of its prompt too: ``Observation.prompt_left``, so a long
prompt's length is known from its first chunk, before "oldest first" has evicted a fact early in it) number at
most b tiers, its words keep the tier's ``given_order`` (``said_words_deep``: oldest first). Beyond, the overflow's
worth of the tier's slots (the whole tier at most) go to that turn's most surprising words, ranked among
themselves by surprise, below the words of the turns that fit. Why: the tier
orders disagree by length. A GSM8K question (~130 words, a 96-cell tier at 192 cells) nearly fits, and oldest
first keeps it whole from its start, where a surprise order drops words inside it (``said_words_surprise``: 13 of
60 dev problems, ``said_words`` 17). A 1,000-token text with a fact inside cannot be kept from its start, and
surprise finds the fact (passkey dev: ``said_words_surprise`` 9 of 10, ``said_words`` 2). Registered as
``said_words_deep`` (b = 2, in the wide gap between the two dev sets' ratios, ~1.4 and ~8). Why per turn: counted
over the whole chat, three turns of ~150 pasted words each put every slot on surprise at 256 cells, and the
facts of the short turns before them (decoded without surprisal, which is computed only once a text could
overflow) lost their place: 0 of 3 dev conversations against ``said_words``' 2 (``bench_recall.py
--paste-tokens 128``). What the caller typed (a fact, a question) is not ranked against a pasted text's
surprise; several short turns are kept oldest first, however long together. A rewind forgets the words of the
branch it drops. A template token never takes a slot, but its surprise, spread by the window mean,
can lift the caller's words beside it (the ends of a message).
Signals read: the base's (none for streaming; every token's logits for surprise), so flash attention stays on. Designed on the recall benchmark's dev conversations (seeds below
1000) only; ``said_facts`` on the first 60 GSM8K dev problems.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from ..errors import ConfigError
from .base import (ModelShape, Observation, Policy, PositionScores, Signals, check_bool, check_float, lift_tier,
                   rank01)
from .epikv import EpikvPolicy
from .facts import FactsPolicy
from .keydiff import KeyDiffPolicy
from .streaming import StreamingLLM
from .surprise import SurprisePolicy

BASES = ("streaming", "epikv", "keydiff", "facts", "surprise")
ORDERS = ("oldest", "base", "surprise", "oldest_or_surprise")


@dataclass
class SaidPolicy(Policy):
    name: ClassVar[str] = "said"

    base: str = "streaming"
    share: float = 1.0
    given_order: str = "oldest"
    prompt: bool = False
    template_last: bool = False
    surprise_beyond: float = 0.0
    layers: tuple[int, ...] | None = None
    window: int = 128

    def __post_init__(self):
        if self.base not in BASES:
            raise ConfigError(f"said: base must be one of {', '.join(BASES)}, got {self.base!r}")
        check_float("said", "share", self.share, 0.0, 1.0)
        if self.given_order not in ORDERS:
            raise ConfigError(f"said: given_order must be one of {', '.join(ORDERS)}, got {self.given_order!r}")
        check_bool("said", "prompt", self.prompt)
        check_bool("said", "template_last", self.template_last)
        if self.surprise_beyond != 0.0:  # 0: off
            check_float("said", "surprise_beyond", self.surprise_beyond, 1.0, 1e6, what="0 (off) or a number")
        self._base: Policy = {"streaming": lambda: StreamingLLM(),
                              "epikv": lambda: EpikvPolicy(layers=self.layers, window=self.window),
                              "keydiff": lambda: KeyDiffPolicy(),
                              "facts": lambda: FactsPolicy(layers=self.layers, window=self.window),
                              "surprise": lambda: SurprisePolicy()}[self.base]()
        # the given tier's own order: the model's surprisal while the base orders the model's own tokens
        wants_surprise = self.given_order in ("surprise", "oldest_or_surprise") or self.surprise_beyond > 0
        self._order: Policy | None = SurprisePolicy() if wants_surprise and self.base != "surprise" else None
        self._given = PositionScores()  # 1.0: given in a later turn, 0.0: otherwise, NaN: never decoded
        self._answered = False  # the model has produced a token: what is given from now on is a later turn
        self._coming = 0  # tokens of the tier's prompt being decoded still to come (Observation.prompt_left; its
        # template's tokens included: the count errs towards "long")
        self._turns = np.zeros(0, dtype=np.int64)  # per turn (a stretch of the tier's tokens between two of the
        # model's), the caller's words in it (evicted ones included); an int64 array, as a session file holds it
        self._turn_of = PositionScores()  # the turn of each tier position (NaN: not in the tier)
        self._end = 0  # one past the newest position observed
        if self.template_last:  # 1.0: a chat template wrote it (Observation.template), 0.0: otherwise
            self._template = PositionScores()
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        sig = self._base.bind(shape)
        if self._order is not None:
            sig = replace(sig, surprise=self._order.bind(shape).surprise)
        return sig

    def reset(self) -> None:
        self._base.reset()
        if self._order is not None:
            self._order.reset()
        self._given.reset()
        if self.template_last:
            self._template.reset()
        self._answered = False
        self._turns = np.zeros(0, dtype=np.int64)
        self._turn_of.reset()
        self._coming = self._end = 0

    def observe(self, obs: Observation) -> None:
        self._base.observe(obs)
        if self._order is not None:
            self._order.observe(obs)
        given = np.zeros(len(obs.positions), dtype=bool) if obs.given is None else np.asarray(obs.given, dtype=bool)
        # the prompt that starts a sequence stays the base's unless ``prompt``: protected by the budget, or counted
        # against it (the papers' setting), where the tier would overrule the base on every token. A protected
        # token never joins the tier: it is never a candidate, so a slot given to it is one lost to a later turn
        protected = (np.zeros(len(given), dtype=bool) if obs.protected is None
                     else np.asarray(obs.protected, dtype=bool))
        in_tier = given & ~protected & (self._answered or self.prompt)
        template = None if obs.template is None or not self.template_last else np.asarray(obs.template, dtype=bool)
        if self.surprise_beyond:  # only the slots read the count: no work per token for the other said policies
            self._count(obs, in_tier, template)
        self._given.set(obs.positions, in_tier.astype(np.float64))
        self._answered = self._answered or not given.all()
        if self.template_last:
            self._template.set(obs.positions, np.zeros(len(obs.positions)) if template is None else template)

    def _count(self, obs: Observation, in_tier: np.ndarray, template: np.ndarray | None) -> None:
        """Book ``obs``'s caller's words (tier marks, not the template's) in their turns, and the prompt still to
        come. ``obs.positions`` ascend (one decode)."""
        positions = np.asarray(obs.positions, dtype=np.int64)
        if int(positions[0]) < self._end:  # a rewind: what lay at or after it is gone (a branch's words no longer count)
            self._recount(int(positions[0]))
            self._end = int(positions[0])
        if not in_tier.any():  # the model's own token (the common case): no turn to book, its turn stays NaN
            self._end, self._coming = int(positions[-1]) + 1, 0
            return
        continues = self._in_turn()  # read before this chunk moves the newest position
        self._end = int(positions[-1]) + 1
        starts = in_tier & ~np.concatenate(([continues], in_tier[:-1]))  # a tier token after the model's
        turn = len(self._turns) - 1 + np.cumsum(starts)
        self._turns = np.concatenate([self._turns, np.zeros(int(np.count_nonzero(starts)), dtype=np.int64)])
        words = in_tier if template is None else in_tier & ~template
        np.add.at(self._turns, turn[words], 1)
        self._turn_of.set(positions, np.where(in_tier, turn, np.nan))
        self._coming = int(obs.prompt_left)

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        rank = rank01(self._base.score(positions))
        given = np.flatnonzero(self._given.get(positions) == 1.0)
        older = -positions[given].astype(np.float64)  # higher = older
        if self.given_order == "oldest":
            within = rank01(older)
        else:
            within = (rank01(self._order.score(positions[given])) if self._order is not None  # surprise, another base
                      else rank[given])  # "base", or surprise over the surprise base
            if self.given_order == "oldest_or_surprise":  # kept while among the oldest or the most surprising:
                # a question that nearly fits stays whole from its start, a fact deep in a long text by surprise
                within = rank01(np.maximum(rank01(older), rank01(within)))  # both ranks over the given words
        template = (self._template.get(positions[given]) == 1.0 if self.template_last
                    else np.zeros(len(given), dtype=bool))
        slots, long = self._surprise_slots(positions[given], len(positions)) if self.surprise_beyond else (0, None)
        if slots > 0:  # a turn's words far overflow the tier: a text that long cannot be kept whole from its
            # start, so the overflow's worth of slots (up to the whole tier) go to its most surprising words (a fact
            # deep inside it); a question that nearly fits stays oldest first, whole from its start
            surprise = self._order.score(positions[given]) if self._order is not None else self._base.score(
                positions[given])
            surprise = np.where(template | np.isnan(surprise) | ~long, -np.inf, surprise)  # never a template token
            top = np.argsort(-surprise, kind="stable")[:int(slots)]
            top = top[np.isfinite(surprise[top])]
            within = rank01(within)
            within[top] = 2.0 + rank01(surprise[top])  # among themselves by surprise too: when eviction must cut
            # into the tier (its slots in the protected recent window), the fact outlasts older, duller words
            within[~long & ~template] += 4.0  # the words of the turns that fit above all: what the caller typed
            # (a fact, a question) is not ranked against a pasted text's surprise
        if self.template_last:  # the template's own text (role markers, a default system prompt) below the
            # caller's words, each group in its own order
            within = rank01(within - 10.0 * template)
        elif slots > 0:
            within = rank01(within)  # lift_tier takes ranks in [0, 1]
        return lift_tier(rank, given, within, self.share)  # the share's worth ranked highest within the given

    def wants_surprise(self, given: int, min_cells: int) -> bool:
        """With ``surprise_beyond`` as the only reader of surprisal (the given order and the base need none), only
        once the slots could open: a turn's words (for the turn being decoded, those so far plus those coming,
        their template's tokens counted too: the count errs towards "long") beyond ``surprise_beyond`` tiers of the
        fewest cells a round scores. Why: a prompt's surprisal costs the output layer once per token (prefill at
        0.71x plain's speed on the 0.5B model), and a turn that fits is kept oldest first, its surprisal never
        read: a long chat of short turns never pays it."""
        if self._order is None or self.given_order not in ("oldest", "base") or not self.surprise_beyond:
            return True
        now = (int(self._turns[-1]) if self._in_turn() else 0) + given  # the turn being decoded
        return self._beyond(max(int(self._turns.max(initial=0)), now), min_cells) > 0

    def _surprise_slots(self, given_positions: np.ndarray, n: int) -> tuple[int, np.ndarray]:
        """How many of the tier's ``round(share * n)`` slots (n: the cells scored) go to the most surprising words
        of the long turns, and which of ``given_positions`` (the tier's, scored) are in a long turn. A turn is long
        when its words (evicted ones included; the template's and a protected prompt's not; for the turn being
        decoded, the rest of its prompt too: known from its first chunk, so a fact early in a long text is not
        evicted as "oldest first" before the text's length is seen) exceed ``surprise_beyond`` tiers; the slots are
        the long turns' overflow, the whole tier at most."""
        words = self._turns.astype(np.float64)
        if self._in_turn():
            words[-1] += self._coming
        over = np.maximum(self._beyond(words, n), 0.0)
        turn = self._turn_of.get(given_positions)
        long = np.zeros(len(given_positions), dtype=bool)
        ok = (turn >= 0) & (turn < len(over))  # NaN: not the tier's (and a session file's ids bounded)
        long[ok] = over[turn[ok].astype(np.int64)] > 0
        return int(min(over.sum(), round(self.share * n))), long

    def _beyond(self, words: int, n: int) -> float:
        """How far ``words`` exceed ``surprise_beyond`` tiers of ``round(share * n)`` cells (n: the cells scored)."""
        return words - self.surprise_beyond * round(self.share * n)

    def _recount(self, end: int) -> None:
        """Forget the turns' words at positions from ``end`` on (a rewind)."""
        self._turn_of.ensure(end)
        self._given.ensure(end)
        turn = self._turn_of.values[:end]
        words = self._given.values[:end] == 1.0
        if self.template_last:  # the two arrays grow apart when scored at different positions
            m = min(len(words), len(self._template.values))
            words[:m] &= self._template.values[:m] != 1.0
        known = (turn >= 0) & (turn < len(self._turns))  # NaN: not the tier's (and a session file's ids bounded)
        n_turns = int(turn[known].max()) + 1 if known.any() else 0
        self._turns = np.bincount(turn[known & words].astype(np.int64), minlength=n_turns).astype(np.int64)
        self._turn_of.values[end:] = np.nan  # the dropped branch's turns: a position decoded again as the model's
        # own keeps NaN without a write per token

    def _in_turn(self) -> bool:
        """Whether the newest position observed was the tier's (a prompt chunk that follows continues its turn);
        False without a turn booked (a session file's marks may disagree with its turn counts)."""
        last = self._end - 1
        return len(self._turns) > 0 and 0 <= last < len(self._given.values) and self._given.values[last] == 1.0


@dataclass
class SaidEpikvPolicy(SaidPolicy):
    """``said`` with EPIKV's score as its base. Calibratable: it takes a model's calibrated EPIKV layers and
    window (and recent share) as ``epikv`` does, so on one protected prompt it is the calibrated ``epikv``."""

    name: ClassVar[str] = "said_epikv"
    calibratable: ClassVar[bool] = True

    base: str = "epikv"
