"""Capture: turn what a policy declares (its ``Signals``) into the native capture of one context.

A :class:`CapturePlan` is built from the bound policy's signals plus the session's settings (capture route,
flash-attention check). It says which native pieces are needed:

* the residual-stream change ``g`` of the policy's layers, by one of two routes:

  - ``"layer_out"`` (default, fast): the patched ``llama_set_layer_capture`` marks ``l_out-<il>`` as graph
    outputs and llama.cpp copies them with its other outputs; no callback, no extra scheduler split;
  - ``"callback"``: the C eval callback of ``native/epikv_capture.c`` asks for ``l_out-<il>`` (one scheduler
    split per captured layer) and computes g natively;

* the keys after RoPE of the key layers (patched API, ``Kcur-<il>``);
* the attention matrix read back through the eval callback (``kq_soft_max-<il>``, flash attention off);
* a probe of the first decode's graph (every node's name and op), to verify that flash attention ran.

The eval-callback pieces share one C handle (:class:`CallbackHandle`), which must exist before the context
(it is the context's ``cb_eval`` user data) and be freed after it. :meth:`CapturePlan.open` creates it and
:meth:`CapturePlan.attach` wires the rest to the context, returning a :class:`Capture` that turns each decode
into an :class:`~epikv_local.policies.base.Observation`.

Units: g[t, j] = ||h_l(t) - h_l(t-1)|| for layer ``layers[j]`` (units of the hidden-state L2 norm), where the
previous token is the previous *decoded* token of the sequence even if its cell was evicted; the first
token's g is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, FlashAttnError, NativeError
from ..policies.base import Observation, Signals
from ..policies.scoring import diff_norms
from .handles import Closing
from .native import CAPTURE_K, CAPTURE_OUT, CAPTURE_Q, MODE_ATTN, MODE_CAPTURE, MODE_IDLE, MODE_PROBE, Native
from .protocol import KVContext

ROUTES = ("layer_out", "callback")


class CallbackHandle(Closing):
    """Owns an ``epikv_capture`` (C) handle; pass ``cb_eval``/``user_data`` to the Context. Close after it.

    layers: the layers whose ``l_out`` (MODE_CAPTURE) or ``kq_soft_max`` (MODE_ATTN) it reads; may be empty
    for a handle that only probes the graph. max_tokens: the most tokens one decode may carry.
    """

    def __init__(self, nat: Native, layers: tuple[int, ...], n_embd: int, max_tokens: int, mode: int = MODE_IDLE):
        self.nat = nat
        self.layers = tuple(layers)
        self.max_tokens = max_tokens
        arr = nat.ffi.new("int32_t[]", list(self.layers)) if self.layers else nat.ffi.NULL
        self._h = nat.cap.epikv_capture_new(arr, len(self.layers), n_embd, max_tokens)
        if self._h == nat.ffi.NULL:
            raise NativeError(f"epikv_capture_new failed (layers={self.layers}, n_embd={n_embd})")
        self._g = np.empty((max_tokens, max(1, len(self.layers))), dtype=np.float32)
        self._attn: tuple[np.ndarray, np.ndarray] | None = None
        self.set_mode(mode)

    @property
    def cb_eval(self) -> int:
        """Address of the C eval callback."""
        return self.nat.address(self.nat.cap.epikv_capture_cb_eval)

    @property
    def user_data(self) -> int:
        return self.nat.address(self.handle)

    @property
    def handle(self):
        if self._h is None:
            raise NativeError("capture handle is closed")
        return self._h

    def set_mode(self, mode: int) -> None:
        """Combination of MODE_CAPTURE / MODE_PROBE / MODE_ATTN (MODE_IDLE: answer every node "no")."""
        if self.nat.cap.epikv_capture_set_mode(self.handle, mode) != 0:
            raise NativeError(f"epikv_capture_set_mode({mode}) refused (unknown bits, or attention not enabled)")

    def take(self) -> np.ndarray:
        """g of the tokens captured since the last take: (T, n_layers) float64."""
        n = self.nat.cap.epikv_capture_take(self.handle, self.nat.ffi.from_buffer("float[]", self._g), self.max_tokens)
        if n == -1:
            raise NativeError(f"eval-callback capture saw unequal token counts per layer {self.layers}: "
                              "a layer has no l_out tensor in this architecture's graph")
        if n < 0:
            raise NativeError(f"epikv_capture_take failed ({n})")
        return self._g[:n, :len(self.layers)].astype(np.float64)

    def reset(self) -> None:
        self.nat.cap.epikv_capture_reset(self.handle)

    def enable_attention(self, max_cells: int) -> None:
        """Allocate the attention accumulators for up to ``max_cells`` KV cells (the context's n_ctx)."""
        if self.nat.cap.epikv_capture_enable_attention(self.handle, max_cells) != 0:
            raise NativeError(f"epikv_capture_enable_attention({max_cells}) failed")
        self._attn = (np.zeros(max_cells, dtype=np.float32), np.zeros(max_cells, dtype=np.float32))

    def take_attention(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(received, last, n_queries) since the last call: per KV cell (column), averaged over the captured
        layers and heads; ``received`` sums over the query tokens, ``last`` is the newest query's row."""
        if self._attn is None:
            raise NativeError("attention capture is not enabled")
        s, last = self._attn
        ffi = self.nat.ffi
        n = self.nat.cap.epikv_capture_take_attention(self.handle, ffi.from_buffer("float[]", s),
                                                      ffi.from_buffer("float[]", last), len(s))
        if n < 0:
            raise NativeError("attention capture is not enabled")
        return s.copy(), last.copy(), n

    def probe_nodes(self) -> list[tuple[str, str]]:
        """(name, op) of every node recorded while PROBE mode was on."""
        text = self.nat.ffi.string(self.nat.cap.epikv_capture_probe_text(self.handle)).decode("utf-8", "replace")
        return [tuple(line.split("\t", 1)) for line in text.splitlines() if "\t" in line]

    def close(self) -> None:
        if self._h is not None:
            self.nat.cap.epikv_capture_free(self._h)
            self._h = None



def flash_attn_active(nodes: list[tuple[str, str]]) -> bool:
    """True when a decode graph ran flash attention: a FLASH_ATTN_EXT node and no kq_soft_max node."""
    has_fa = any(op == "FLASH_ATTN_EXT" for _, op in nodes)
    has_softmax = any(name.startswith("kq_soft_max") for name, _ in nodes)
    return has_fa and not has_softmax


class LayerOutCapture:
    """Fast g route: reads the rows that the patched llama.cpp copied out for each captured layer."""

    route = "layer_out"

    def __init__(self, ctx: KVContext, layers: tuple[int, ...], arch: str = "this"):
        self.ctx = ctx
        self.layers = tuple(layers)
        self.arch = arch
        for il in self.layers:
            ctx.set_layer_capture(il, True, CAPTURE_OUT)
        self._prev: list[np.ndarray | None] = [None] * len(self.layers)

    def after_decode(self, n_tokens: int, rows: slice | None = None, prev: list | None = None) -> np.ndarray:
        """g of the n_tokens just decoded: (n_tokens, len(layers)) float64; with ``rows``, of those rows of the
        decode only (the tokens of one sequence in a batch of several), continuing from ``prev`` (that
        sequence's last row per layer, updated in place; None: this capture's own, the single-sequence case)."""
        prev = self._prev if prev is None else prev
        sl = slice(0, n_tokens) if rows is None else rows
        n = len(range(*sl.indices(n_tokens)))
        out = np.empty((n, len(self.layers)), dtype=np.float64)
        for j, il in enumerate(self.layers):
            got = self.ctx.layer_out(il, n_tokens)
            if got is None:
                raise NativeError(f"architecture {self.arch!r} has no l_out-{il} tensor in its graph: EPIKV capture "
                                  "is not supported for it")
            got = got[sl]
            out[:, j] = diff_norms(got, prev[j])
            prev[j] = got[-1].copy()
        return out

    def reset(self) -> None:
        self._prev = [None] * len(self.layers)


class CallbackCapture:
    """Plain g route: the C eval callback captures ``l_out-<il>`` and computes g natively."""

    route = "callback"

    def __init__(self, handle: CallbackHandle):
        self.handle = handle
        self.layers = handle.layers

    def after_decode(self, n_tokens: int) -> np.ndarray:
        g = self.handle.take()
        if g.shape[0] != n_tokens:
            raise NativeError(f"eval-callback capture returned {g.shape[0]} rows for {n_tokens} tokens "
                              f"(does this architecture name l_out-{self.layers[0]}?)")
        return g

    def reset(self) -> None:
        self.handle.reset()


class KeyCapture:
    """Keys after RoPE of the key layers (patched API, ``Kcur-<il>``), read after each decode."""

    kind, tensor = CAPTURE_K, "Kcur"

    def __init__(self, ctx: KVContext, key_layers: tuple[int, ...], arch: str = "this"):
        self.ctx = ctx
        self.key_layers = tuple(key_layers)
        self.arch = arch
        for il in self.key_layers:
            ctx.set_layer_capture(il, True, self.kind)

    def after_decode(self, n_tokens: int, rows: slice | None = None) -> np.ndarray:
        """(n_tokens, len(key_layers), row) float32, a copy (row = d_k for keys, d_q for queries); with
        ``rows``, of those rows of the decode only."""
        got = [self.ctx.layer_capture(il, n_tokens, self.kind) for il in self.key_layers]
        if any(r is None for r in got):
            raise NativeError(f"architecture {self.arch!r} names no {self.tensor} tensor: capture fails")
        return np.stack([r if rows is None else r[rows] for r in got], axis=1)


class QueryCapture(KeyCapture):
    """Queries after RoPE of the query layers (patched API, ``Qcur-<il>``), read after each decode."""

    kind, tensor = CAPTURE_Q, "Qcur"


@dataclass(frozen=True)
class CapturePlan:
    """What one session captures. Built by :meth:`build` from a bound policy's signals and the settings."""

    layers: tuple[int, ...] = ()
    key_layers: tuple[int, ...] = ()
    attention_layers: tuple[int, ...] = ()
    route: str = "layer_out"
    probe: bool = True
    query_layers: tuple[int, ...] = ()

    @classmethod
    def build(cls, signals: Signals, route: str = "layer_out", verify_flash_attn: bool = True) -> "CapturePlan":
        if route not in ROUTES:
            raise ConfigError(f"capture route must be one of {ROUTES}, got {route!r}")
        plan = cls(signals.g_layers, signals.key_layers, signals.attention_layers, route, verify_flash_attn,
                   signals.query_layers)
        if plan.uses_callback_g and plan.attention_layers and set(plan.attention_layers) != set(plan.layers):
            # one C handle serves both, and it reads one list of layers
            raise ConfigError("the callback capture route and attention readback need the same layers")
        return plan

    @property
    def uses_callback_g(self) -> bool:
        return bool(self.layers) and self.route == "callback"

    @property
    def run_mode(self) -> int:
        """The C handle's mode after the first decode (the probe is only on for the first one)."""
        return (MODE_CAPTURE if self.uses_callback_g else MODE_IDLE) | (MODE_ATTN if self.attention_layers else 0)

    @property
    def needs_callback(self) -> bool:
        return bool(self.run_mode) or self.probe

    def open(self, nat: Native, n_embd: int, n_batch: int) -> CallbackHandle | None:
        """The C handle this plan needs (None if none); its mode is set by :meth:`attach`."""
        if not self.needs_callback:
            return None
        layers = self.attention_layers or (self.layers if self.uses_callback_g else ())
        return CallbackHandle(nat, layers, n_embd, n_batch)

    def attach(self, ctx: KVContext, handle: CallbackHandle | None, arch: str = "this") -> "Capture":
        """Wire the plan to a context created with ``handle`` as its eval callback."""
        if self.attention_layers:
            handle.enable_attention(ctx.n_ctx)
        if handle is not None:
            handle.set_mode((MODE_PROBE if self.probe else 0) | self.run_mode)
        g = None
        if self.layers:
            g = CallbackCapture(handle) if self.uses_callback_g else LayerOutCapture(ctx, self.layers, arch)
        keys = KeyCapture(ctx, self.key_layers, arch) if self.key_layers else None
        queries = QueryCapture(ctx, self.query_layers, arch) if self.query_layers else None
        return Capture(self, ctx, handle, g, keys, queries)


class Capture:
    """A plan attached to a context: one :meth:`observe` per decode gives the policy its Observation."""

    def __init__(self, plan: CapturePlan, ctx: KVContext, handle: CallbackHandle | None, g, keys, queries=None):
        self.plan = plan
        self.ctx = ctx
        self.handle = handle
        self.g = g
        self.keys = keys
        self.queries = queries
        self.flash_attn: bool | None = None  # known after the first decode when probed
        self.graph_nodes: list[tuple[str, str]] = []

    @property
    def per_sequence(self) -> bool:
        """Whether one decode can carry several sequences' tokens: the layer_out route and the keys / queries
        keep their running state per sequence (:class:`SequenceCapture`); the callback route (its C handle keeps
        one previous row) and the attention readback (one matrix per decode) serve one sequence."""
        return not self.plan.uses_callback_g and not self.plan.attention_layers

    def observe(self, positions: np.ndarray, rows: slice | None = None, n_total: int | None = None,
                prev: list | None = None) -> Observation:
        """The Observation of the decode that just wrote ``positions`` (T,): rows ``rows`` of a decode of
        ``n_total`` tokens (None: all of them), continuing the sequence's previous residual rows ``prev``."""
        n_total = len(positions) if n_total is None else n_total
        if self.flash_attn is None and self.plan.probe:
            self._finish_probe()
        obs = Observation(positions=positions)
        if self.g is not None:
            obs.g = (self.g.after_decode(n_total, rows, prev) if isinstance(self.g, LayerOutCapture)
                     else self.g.after_decode(n_total))
        if self.keys is not None:
            obs.keys = self.keys.after_decode(n_total, rows)
        if self.queries is not None:
            obs.queries = self.queries.after_decode(n_total, rows)
        if self.plan.attention_layers:
            recv, last, _ = self.handle.take_attention()
            obs.cell_pos = self.ctx.cell_positions()
            n_cells = len(obs.cell_pos)
            obs.attn_received, obs.attn_last = recv[:n_cells], last[:n_cells]
        return obs

    def _finish_probe(self) -> None:
        self.graph_nodes = self.handle.probe_nodes()
        self.flash_attn = flash_attn_active(self.graph_nodes)
        self.handle.set_mode(self.plan.run_mode)

    def check_flash_attn(self, requested: bool) -> None:
        """FlashAttnError when flash attention was requested but the probed graph did not run it."""
        if requested and self.flash_attn is False:
            raise FlashAttnError("flash attention was requested but the decode graph has no FLASH_ATTN_EXT node "
                                 "(or still has kq_soft_max): this backend cannot honour it")

    def reset(self) -> None:
        if self.g is not None:
            self.g.reset()


class SequenceCapture:
    """One sequence's view of a context's :class:`Capture`: the running state (the previous residual row of
    each captured layer) is the sequence's own, so sequences sharing one decode never mix their g."""

    def __init__(self, shared: Capture):
        self.shared = shared
        self.plan = shared.plan
        self._prev = [None] * len(shared.g.layers) if isinstance(shared.g, LayerOutCapture) else None

    @property
    def flash_attn(self) -> bool | None:
        return self.shared.flash_attn

    @property
    def graph_nodes(self) -> list[tuple[str, str]]:
        return self.shared.graph_nodes

    def check_flash_attn(self, requested: bool) -> None:
        self.shared.check_flash_attn(requested)

    def observe(self, positions: np.ndarray, rows: slice | None = None, n_total: int | None = None) -> Observation:
        """This sequence's Observation of the last decode (its rows ``rows`` of ``n_total``; see Capture)."""
        return self.shared.observe(positions, rows, n_total, self._prev)

    def state(self) -> list[np.ndarray | None] | None:
        """The running state a saved sequence needs to continue (the previous residual rows of the layer_out
        route); None when the capture keeps none in Python (the callback route keeps it in C and restarts)."""
        return None if self._prev is None else [None if r is None else r.copy() for r in self._prev]

    def set_state(self, state: list[np.ndarray | None] | None) -> None:
        """Continue from :meth:`state` of a capture with the same plan."""
        if state is None or self._prev is None:
            return
        if len(state) != len(self._prev):
            raise ValueError(f"{len(state)} rows for {len(self._prev)} captured layers")
        self._prev[:] = [None if r is None else np.array(r, dtype=np.float32) for r in state]

    def reset(self) -> None:
        if self._prev is None:
            self.shared.reset()  # the callback route's C state (one sequence per context)
        else:
            self._prev[:] = [None] * len(self._prev)
