"""Surprise: keep the spans the model did not expect (self-information, as Selective Context, Li et al., 2023).

Why: a fact dropped into long text (the passkey of ``bench_recall.py --task passkey``: "The secret code is
81163. Remember it." inside 1,000 tokens of reasoning notes) arrives long before the question that needs it,
so a bounded prefill must decide without the question. No residual-stream or key score measured here singles
it out (docs/benchmarks.md: EPIKV ranks a code's weakest digit below ~600 context tokens). The model's own
surprisal does: reasoning text is predictable, a random code and the sentence around it are not
(``scripts/passkey_ranks.py --policy surprise`` prints both), and a window mean lifts the whole sentence, the
code's half-expected first digit included. Designed on the dev passkey contexts (seeds 0-1): 7 of 10
recalled at 256 cells with the prompt counted, StreamingLLM 1, EPIKV 2, the full cache 8.

Score of a position p, with ``s(q)`` the surprisal of the token at q (nats, measured when it was decoded, kept
after q is evicted) and w = ``window``:

    mean(q)  = mean of the known s over positions q-w .. q+w
    score(p) = max of mean(q) over q = p-w .. p+w    (the best window covering p: a span is kept whole)

Signal read: ``Observation.surprise`` (the engine asks llama.cpp for every token's logits, so a prompt costs the
output layer once per token; a generated token's surprisal comes from the logits it was sampled from).
Attention-free: flash attention stays on. Positions with no known surprisal in reach score NaN (lowest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import ModelShape, Observation, Policy, PositionScores, Signals, check_int


@dataclass
class SurprisePolicy(Policy):
    name: ClassVar[str] = "surprise"

    window: int = 8

    def __post_init__(self):
        check_int("surprise", "window", self.window, 0, 256)
        self._nll = PositionScores()  # nats per position, NaN: unknown
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        return Signals(surprise=True)

    def reset(self) -> None:
        self._nll.reset()

    def observe(self, obs: Observation) -> None:
        if len(obs.positions) == 0:
            return
        s = np.full(len(obs.positions), np.nan) if obs.surprise is None else np.asarray(obs.surprise, np.float64)
        positions = np.asarray(obs.positions, np.int64)
        self._nll.set(positions, s)  # a re-decoded position is scored afresh
        # what lies beyond the newest token was a branch a rewind dropped: the windows must not read it
        self._nll.values[int(positions.max()) + 1:] = np.nan

    def score(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) == 0:
            return np.zeros(0)
        w = self.window
        q = positions[:, None] + np.arange(-2 * w, 2 * w + 1)           # (N, 4w+1) positions in reach
        v = np.full(q.shape, np.nan)
        ok = q >= 0
        v[ok] = self._nll.get(q[ok])
        known = ~np.isnan(v)
        z = np.zeros((len(q), 1))
        sums = np.concatenate([z, np.cumsum(np.where(known, v, 0.0), axis=1)], axis=1)
        counts = np.concatenate([z, np.cumsum(known, axis=1)], axis=1)
        n = 2 * w + 1                                                   # window j covers q[:, j:j+n]
        wsum, wcount = sums[:, n:] - sums[:, :-n], counts[:, n:] - counts[:, :-n]   # (N, 2w+1)
        mean = np.where(wcount > 0, wsum / np.maximum(wcount, 1), -np.inf)
        best = mean.max(axis=1)
        return np.where(np.isfinite(best), best, np.nan)
