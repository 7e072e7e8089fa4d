"""Facts: numbers and the words beside them outrank the rest of the text; a base scorer orders the rest.

Why: with the prompt counted against the budget (the papers' setting), the question of a word problem is the
oldest text and goes first; on the GSM8K token-view pages StreamingLLM lost "$1 less than a magazine" and
wrote that the pen costs the same, and EPIKV kept scattered pieces of the question by chance
(docs/benchmarks.md). What a problem's answer needs is mostly its quantities and what they count. The engine
marks each decoded token whose text holds a decimal digit (``Observation.numeric``); this policy scores

    other token:                                    rank01(base(p))                 in [0, 1]
    a numeric token or within ``context`` of one:   2 + rank01(order within them)   in [2, 3]

so the selection step evicts the rest (lowest base score first) before any number or its neighbours.
``order="oldest"`` keeps the oldest numbers longest (a question's quantities come before the model's
arithmetic); ``"base"`` orders them by the base score. ``share`` bounds the tier: at most ``round(share * N)``
of the N live positions keep it, so text full of numbers (a table, a trace of arithmetic) cannot crowd out
everything else. Tokens within ``context`` positions of a numeric token join the tier ("20 sheep", "$1
less"), counted by position, so the marks follow the text wherever a decode boundary falls.

``base``: ``epikv`` (the residual-stream score; ``layers`` and ``window`` as :class:`EpikvPolicy`) or
``streaming``. Signals read: the base's plus the engine's digit marks (a lookup per token, no model signal),
so flash attention stays on. A heuristic about the text, not about the model: it helps where the facts are
written in digits, and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from ..errors import ConfigError
from .base import (ModelShape, Observation, Policy, PositionScores, Signals, check_float, check_int, lift_tier,
                   rank01)
from .epikv import EpikvPolicy
from .streaming import StreamingLLM

BASES = ("epikv", "streaming")
ORDERS = ("oldest", "base")


@dataclass
class FactsPolicy(Policy):
    name: ClassVar[str] = "facts"

    base: str = "epikv"
    share: float = 0.5
    context: int = 1
    order: str = "oldest"
    layers: tuple[int, ...] | None = None
    window: int = 128

    def __post_init__(self):
        if self.base not in BASES:
            raise ConfigError(f"facts: base must be one of {', '.join(BASES)}, got {self.base!r}")
        check_float("facts", "share", self.share, 0.0, 1.0)
        check_int("facts", "context", self.context, 0, 8)
        if self.order not in ORDERS:
            raise ConfigError(f"facts: order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        self._base: Policy = (EpikvPolicy(layers=self.layers, window=self.window) if self.base == "epikv"
                              else StreamingLLM())
        self._numeric = PositionScores()  # 1.0: the token's text holds a digit, 0.0: not, NaN: never decoded
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        return replace(self._base.bind(shape), numbers=True)

    def reset(self) -> None:
        self._base.reset()
        self._numeric.reset()

    def observe(self, obs: Observation) -> None:
        self._base.observe(obs)
        numeric = np.zeros(len(obs.positions), dtype=bool) if obs.numeric is None else np.asarray(obs.numeric, bool)
        self._numeric.set(obs.positions, numeric.astype(np.float64))  # a re-decoded position is marked afresh

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        rank = rank01(self._base.score(positions))
        near = np.zeros(len(positions), dtype=bool)
        for offset in range(-self.context, self.context + 1):
            q = positions + offset
            ok = q >= 0
            near[ok] |= self._numeric.get(q[ok]) == 1.0
        tier = np.flatnonzero(near)
        within = rank01(-positions[tier].astype(np.float64)) if self.order == "oldest" else rank[tier]
        return lift_tier(rank, tier, within, self.share)
