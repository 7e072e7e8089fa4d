"""TriAttention-style scoring (our reading of TriAttention, 2025): keys rated by the attention that future
queries are expected to pay them, predicted from pre-RoPE query statistics, without the attention matrix.

Before RoPE, a head's queries concentrate around a fixed centre. Write each rotated pair ``f`` of a head as a
complex number (:mod:`.rope`), ``q_f`` for a query and ``k_f`` for a key at position ``p``. After RoPE the
logit of a query at position ``t`` is ``Re sum_f q_f conj(k_f) exp(i w_f (t - p))``: with ``q_f`` replaced by
its centre ``c_f`` this is a trigonometric series in the distance ``t - p``. The score of a key, per KV head
(the query heads of its group summed: the series is linear in ``c``), is

    trig(p) = Re sum_f c_f conj(k_f) exp(i w_f (t_now - p)) * mean_{d in offsets} exp(i w_f d)
    norm(p) = sum_f r_f |k_f|,   r_f = E|q_f| - |c_f| >= 0   (the part of the queries the centre misses)

i.e. the expected logit over future queries ``offsets`` tokens ahead, plus a norm term for the
unconcentrated part. Each (layer, KV head) score is z-normalised over the live keys and the mean over them is
the policy's score (higher = keep). It depends on ``t_now``, so it is recomputed at every ``score`` call.

Signals read: keys after RoPE of ``n_key_layers`` evenly spaced layers (undone with the known positions),
and the query statistics: offline from ``query_stats`` (an ``.npz`` written by
:meth:`QueryStats.save`, e.g. by ``epikv-local calibrate`` on the dev traces), or, when None, a running
estimate from this session's own queries (captured for the same layers: extra capture for this policy only).
Attention-free, so flash attention stays on. Needs plain RoPE (NORM or NEOX).

Differences from the paper, deliberately: per-(layer, head) z-normalisation and a plain mean instead of the
paper's aggregation; a fixed geometric set of future offsets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import ConfigError, DataError
from ._keys import KeyLayers, PositionRows, obs_keys
from .base import ModelShape, Observation, Policy, Signals
from .rope import check_invertible, frequencies, to_complex

DEFAULT_OFFSETS = tuple(2 ** i for i in range(11))  # 1 .. 1024 tokens ahead


class QueryStats:
    """Running pre-RoPE query statistics of some layers: per layer, query head and rotated pair, the complex
    mean and the mean modulus. Shapes: L layers, H query heads, F pairs."""

    def __init__(self, layers: tuple[int, ...], n_head: int, n_pairs: int):
        self.layers = tuple(int(x) for x in layers)
        self.sum = np.zeros((len(self.layers), n_head, n_pairs), dtype=np.complex128)
        self.sum_abs = np.zeros((len(self.layers), n_head, n_pairs))
        self.count = 0

    def update(self, q: np.ndarray) -> None:
        """q: (T, L, H, F) complex pre-RoPE queries of T tokens."""
        self.sum += q.sum(axis=0)
        self.sum_abs += np.abs(q).sum(axis=0)
        self.count += q.shape[0]

    def per_kv_head(self, n_head_kv: int) -> tuple[np.ndarray, np.ndarray]:
        """(centre (L, n_head_kv, F) complex, residual (L, n_head_kv, F) float): the query heads of each KV
        head's group summed (llama.cpp: query head h reads KV head h // (n_head / n_head_kv))."""
        if self.count == 0:
            raise DataError("query statistics are empty (no token was observed)")
        mean = self.sum / self.count
        resid = np.maximum(self.sum_abs / self.count - np.abs(mean), 0.0)
        L, H, F = mean.shape
        g = H // n_head_kv
        return mean.reshape(L, n_head_kv, g, F).sum(axis=2), resid.reshape(L, n_head_kv, g, F).sum(axis=2)

    def save(self, path: str | os.PathLike) -> None:
        """Write an .npz (the caller makes it atomic)."""
        np.savez(path, layers=np.array(self.layers), sum_re=self.sum.real, sum_im=self.sum.imag,
                 sum_abs=self.sum_abs, count=np.array(self.count))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "QueryStats":
        try:
            with np.load(path) as z:
                qs = cls(tuple(z["layers"].tolist()), *z["sum_abs"].shape[1:])
                qs.sum = z["sum_re"] + 1j * z["sum_im"]
                qs.sum_abs = np.array(z["sum_abs"])
                qs.count = int(z["count"])
        except (OSError, KeyError, ValueError) as e:
            raise DataError(f"cannot read query statistics {path}: {e}") from None
        return qs

    def select(self, layers: tuple[int, ...]) -> "QueryStats":
        """The statistics of ``layers`` only (DataError when a layer is missing)."""
        missing = [il for il in layers if il not in self.layers]
        if missing:
            raise DataError(f"query statistics have no layer {missing} (they hold {list(self.layers)})")
        idx = [self.layers.index(il) for il in layers]
        out = QueryStats(layers, *self.sum_abs.shape[1:])
        out.sum, out.sum_abs, out.count = self.sum[idx], self.sum_abs[idx], self.count
        return out


@dataclass
class TriAttentionPolicy(KeyLayers, Policy):
    name: ClassVar[str] = "triattention"
    calibratable: ClassVar[bool] = True
    n_key_layers: int | None = 4
    query_stats: str | None = None
    offsets: tuple[int, ...] = DEFAULT_OFFSETS

    def __post_init__(self):
        self.check_key_layers()
        try:
            self.offsets = tuple(int(d) for d in self.offsets)
        except (TypeError, ValueError):
            raise ConfigError(f"triattention: offsets must be integers >= 0, got {self.offsets!r}") from None
        if not self.offsets or min(self.offsets) < 0:
            raise ConfigError(f"triattention: offsets must be one or more integers >= 0, got {self.offsets!r}")
        if self.query_stats is not None and not isinstance(self.query_stats, (str, os.PathLike)):
            raise ConfigError(f"triattention: query_stats must be a file path or None, got {self.query_stats!r}")
        self._shape: ModelShape | None = None
        self._offline: QueryStats | None = None
        super().__post_init__()

    def signals(self, shape: ModelShape) -> Signals:
        check_invertible(shape, self.name)
        self._shape = shape
        key = super().signals(shape)
        self._omega = frequencies(shape)
        self._m = np.exp(1j * np.outer(self._omega, self.offsets)).mean(axis=1)   # (F,)
        if self.query_stats is not None:
            qs = QueryStats.load(self.query_stats).select(key.key_layers)
            if qs.sum.shape[1:] != (shape.n_head, len(self._omega)):
                raise DataError(f"query statistics {self.query_stats} are for another model shape "
                                f"({qs.sum.shape[1:]} heads x pairs, this model {shape.n_head} x {len(self._omega)})")
            self._offline = qs
            return key
        return Signals(key_layers=key.key_layers, query_layers=key.key_layers)

    def reset(self) -> None:
        self._store = PositionRows()   # (N, L, n_kv, F) complex64 pre-RoPE keys of the live positions
        self._online = None
        self._t_now = -1

    def observe(self, obs: Observation) -> None:
        if self._shape is None:
            raise RuntimeError("TriAttentionPolicy.observe before bind")
        pos = np.asarray(obs.positions, dtype=np.int64)
        if not len(pos):
            return
        sh = self._shape
        k = to_complex(obs_keys(obs, "TriAttentionPolicy"), pos, sh, sh.n_head_kv).astype(np.complex64)
        if self._offline is None:
            if obs.queries is None:
                raise RuntimeError("TriAttentionPolicy.observe without queries: the session must capture them")
            q = to_complex(obs.queries, pos, sh, sh.n_head)
            if self._online is None:
                self._online = QueryStats(self.bound.query_layers, sh.n_head, q.shape[-1])
            self._online.update(q)
        self._store.append(pos, k)
        self._t_now = max(self._t_now, int(pos.max()))

    def score(self, positions: np.ndarray) -> np.ndarray:
        return self._store.scores(positions, self._expected_attention)

    def _expected_attention(self) -> np.ndarray:
        """(N,) mean over key layers and KV heads of the z-normalised trig + norm score of the live keys."""
        stats = self._offline or self._online
        centre, resid = stats.per_kv_head(self._shape.n_head_kv)                       # (L, H, F) each
        phase = np.exp(1j * np.outer(self._t_now - self._store.pos, self._omega)) * self._m   # (N, F)
        k = self._store.rows.astype(np.complex128)
        trig = np.einsum("nlhf,lhf,nf->nlh", np.conj(k), centre, phase).real
        s = trig + np.einsum("nlhf,lhf->nlh", np.abs(k), resid)
        sd = s.std(axis=0)
        z = (s - s.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
        return z.mean(axis=(1, 2))
