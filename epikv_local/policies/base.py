"""The scorer contract shared by every eviction policy (kvpress style: one small dataclass per module).

A policy's dataclass fields are its configuration, checked in ``__post_init__``; its traits are class
attributes (``evicts``, ``needs_attention``, ``calibratable``). :meth:`Policy.bind` is called once per
session with the model's shape: it resets the policy and returns the :class:`Signals` it needs (layers
whose residual-stream change ``g`` to capture, key layers, attention layers). The engine captures exactly
those and hands them to ``observe`` once per decode, in order. ``score`` rates live positions (higher =
keep). A policy never chooses evictions itself: the engine passes its scores through the one selection step
(:func:`epikv_local.engine.selection.select_evictions`) with the protection mask.

Policies import numpy and this package's ``errors`` only, never the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """What a policy may know of the model (counts)."""

    n_layer: int
    n_embd: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    #: RoPE of the attention layers, for policies that undo it (TriAttention): "norm" (pairs 2i, 2i+1),
    #: "neox" (pairs i, i + rope_dims/2), "none", or "other" (a variant no policy here can invert)
    rope_type: str = "norm"
    rope_dims: int = 0           # rotated dimensions per head (0: the whole head)
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0

    @property
    def head_dim(self) -> int:
        """Dimensions of one attention head (n_embd / n_head; 0 when unknown)."""
        return self.n_embd // self.n_head if self.n_head else 0


@dataclass(frozen=True)
class Signals:
    """The signals a bound policy needs, as this model's layer indices.

    g_layers: layers whose residual-stream change g is captured (0 .. n_layer - 2: the last layer keeps only
        output rows in llama.cpp).
    key_layers: layers whose keys after RoPE are captured (0 .. n_layer - 1).
    query_layers: layers whose queries after RoPE are captured (0 .. n_layer - 1).
    attention_layers: layers whose attention weights are read back (only with ``needs_attention``).
    numbers: whether the engine marks the tokens whose text holds a decimal digit (``Observation.numeric``).
    surprise: whether the engine computes each token's surprisal under the model (``Observation.surprise``):
        it then asks llama.cpp for the logits of every decoded token, not only the last (prefill costs the
        output layer once per prompt token; a generated token's surprisal comes from the logits it was
        sampled from), for the decodes :meth:`Policy.wants_surprise` says need it.
    """

    g_layers: tuple[int, ...] = ()
    key_layers: tuple[int, ...] = ()
    attention_layers: tuple[int, ...] = ()
    query_layers: tuple[int, ...] = ()
    numbers: bool = False
    surprise: bool = False


@dataclass
class Observation:
    """What one decode of T new tokens produced. Shapes: T new tokens, C KV cells.

    positions: (T,) int64 positions of the new tokens.
    g: (T, len(g_layers)) float64 residual-stream change (NaN for a sequence's first token), or None.
    keys: (T, len(key_layers), d_k) float32 keys after RoPE (d_k = n_head_kv * head_dim), or None.
    queries: (T, len(query_layers), d_q) float32 queries after RoPE (d_q = n_head * head_dim), or None.
    cell_pos: (C,) int32 position held by each KV cell after the decode (-1: none), or None.
    attn_received: (C,) float32 attention the cells received from the T new queries (mean over captured
        layers and heads, so each query contributes 1), or None.
    attn_last: (C,) float32 attention from the newest query, same normalisation, or None.
    given: (T,) bool, True for tokens the caller gave (a prompt, a later chat turn: the user's or a tool's
        words) and False for tokens the model sampled or text fed without being a prompt (a teacher-forced
        trace); None when no session built the observation.
    template: (T,) bool, True for given tokens that a chat template wrote around the caller's messages (role
        markers, a default system prompt, the generation prompt) and False for the rest; None when the text
        was not rendered from messages (a raw prompt, the model's own tokens).
    numeric: (T,) bool, True for tokens whose text holds a decimal digit 0-9; None unless the policy's
        signals ask for ``numbers``.
    surprise: (T,) float64 surprisal of each new token in nats, -log p(token | the cache before it) under the
        model's logits (NaN where those logits are unknown: a sequence's first token, the first token after a
        rewind that dropped tokens or after a restored session file); None unless the policy's signals ask for ``surprise``.
    prompt_left: tokens of the same prompt still to be decoded after these (0: the prompt's last decode, or not a
        prompt): a policy evicting while a long prompt streams in learns its length before it has seen it all.
    protected: (T,) bool, True for tokens of the starting prompt that the budget protects (never evicted, so a
        policy's order of them changes nothing); None when no session built the observation.
    """

    positions: np.ndarray
    g: np.ndarray | None = None
    keys: np.ndarray | None = None
    queries: np.ndarray | None = None
    cell_pos: np.ndarray | None = None
    attn_received: np.ndarray | None = None
    attn_last: np.ndarray | None = None
    given: np.ndarray | None = None
    template: np.ndarray | None = None
    numeric: np.ndarray | None = None
    surprise: np.ndarray | None = None
    prompt_left: int = 0
    protected: np.ndarray | None = None


@dataclass
class Policy:
    """Base scorer. Subclasses are dataclasses: fields = settings; override ``score`` (and ``observe``,
    ``signals`` when they read captured signals)."""

    name: ClassVar[str] = "base"
    #: False: the engine never evicts (plain llama.cpp behaviour)
    evicts: ClassVar[bool] = True
    #: True: reads the attention matrix (kq_soft_max), so flash attention must be off
    needs_attention: ClassVar[bool] = False
    #: True: settings can come from a model's calibration file (``epikv-local calibrate``)
    calibratable: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.reset()

    # -- binding ----------------------------------------------------------------------------------------
    def bind(self, shape: ModelShape) -> Signals:
        """Attach to a model of this shape (once per session): reset and return the signals needed."""
        sig = self.signals(shape)
        for il in sig.g_layers:
            if not 0 <= il < shape.n_layer - 1:
                raise ConfigError(f"policy {self.name!r}: layer {il} is beyond what a {shape.n_layer}-layer model "
                                  f"can capture (0..{shape.n_layer - 2})")
        for il in sig.key_layers + sig.attention_layers + sig.query_layers:
            if not 0 <= il < shape.n_layer:
                raise ConfigError(f"policy {self.name!r}: layer {il} is beyond this {shape.n_layer}-layer model")
        self.bound = sig
        self.reset()
        return sig

    def signals(self, shape: ModelShape) -> Signals:
        """The signals needed on a model of this shape (default: none; attention layers: all)."""
        if self.needs_attention:
            return Signals(attention_layers=tuple(range(shape.n_layer)))
        return Signals()

    # -- scoring ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything (new sequence)."""

    def observe(self, obs: Observation) -> None:
        """New tokens were decoded; ``obs`` carries the signals this policy asked for."""

    def score(self, positions: np.ndarray) -> np.ndarray:
        """Scores (N,) float64 of the live ``positions`` (N,) int64; higher = keep."""
        raise NotImplementedError

    def wants_surprise(self, given: int, min_cells: int) -> bool:
        """Asked before each decode when the bound signals read ``surprise``: whether the next decode's tokens need
        their surprisal (False: ``Observation.surprise`` is None and llama.cpp computes no extra logits rows).
        given: the caller's tokens in that decode and the rest of its prompt (0 for a sampled token); min_cells:
        the fewest live cells an eviction round of this sequence scores (its budget less one prompt chunk).
        Default: always, as the signals said."""
        return True


class PositionScores:
    """A growable float64 array indexed by position (NaN = never scored), for per-token scores."""

    def __init__(self, size: int = 1024):
        self.values = np.full(size, np.nan)

    def reset(self) -> None:
        self.values[:] = np.nan

    def ensure(self, top: int) -> None:
        if top > len(self.values):
            grown = np.full(max(top, 2 * len(self.values)), np.nan)
            grown[: len(self.values)] = self.values
            self.values = grown

    def set(self, positions: np.ndarray, values: np.ndarray) -> None:
        self.ensure(int(positions.max()) + 1)
        self.values[positions] = values

    def add(self, positions: np.ndarray, values: np.ndarray) -> None:
        self.ensure(int(positions.max()) + 1)
        cur = self.values[positions]
        self.values[positions] = np.where(np.isnan(cur), 0.0, cur) + values

    def get(self, positions: np.ndarray) -> np.ndarray:
        self.ensure(int(positions.max()) + 1 if len(positions) else 0)
        return np.array(self.values[positions], dtype=np.float64)


def rank01(scores: np.ndarray) -> np.ndarray:
    """(N,) ranks of ``scores`` scaled to [0, 1] (NaN lowest; ties broken by order); N = 1 gives 1."""
    s = np.where(np.isnan(scores), -np.inf, scores)
    r = np.empty(len(s))
    r[np.argsort(s, kind="stable")] = np.arange(len(s))
    return r / max(len(s) - 1, 1) if len(s) > 1 else np.ones(len(s))


def lift_tier(rank: np.ndarray, members: np.ndarray, within: np.ndarray, share: float) -> np.ndarray:
    """Lift a tier above the rest of ``rank`` (N,) in [0, 1]: of the ``members`` (indices, M), those ranked highest
    by ``within`` (M,) in [0, 1], at most ``round(share * N)`` of them, score ``2 + within``; ``rank`` is changed
    in place and returned."""
    keep = int(round(share * len(rank)))
    if len(members) > keep:
        top = np.argsort(within, kind="stable")[len(members) - keep:]
        members, within = members[top], within[top]
    rank[members] = 2.0 + within  # strictly above every rank of the rest (0..1)
    return rank


def check_float(owner: str, name: str, value, lo: float, hi: float = float("inf"), hi_open: bool = False,
                what: str = "a number") -> None:
    """ConfigError unless ``value`` is a finite real (not a bool) in [lo, hi] ([lo, hi) with ``hi_open``)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not np.isfinite(value) or value < lo or value > hi or (hi_open and value == hi):
        rng = f">= {lo:g}" if hi == float("inf") else f"in [{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ConfigError(f"{owner}: {name} must be {what} {rng}, got {value!r}")


def check_bool(owner: str, name: str, value) -> None:
    """ConfigError unless ``value`` is a bool (a 1 or a "yes" is refused, not read as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{owner}: {name} must be true or false, got {value!r}")


def check_int(owner: str, name: str, value, lo: int, hi: int | None = None) -> None:
    """ConfigError unless ``value`` is an int in [lo, hi] (hi None: unbounded)."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConfigError(f"{owner}: {name} must be an integer {rng}, got {value!r}")
