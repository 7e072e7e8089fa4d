"""Per-layer residual-stream change ``g`` for every decoded token, by one of two capture routes.

* ``"layer_out"`` (default, fast): the patched ``llama_set_layer_capture`` marks ``l_out-<il>`` as graph outputs
  and llama.cpp copies them with its other outputs; no callback, no extra scheduler split.
* ``"callback"``: the C eval callback of ``native/epikv_capture.c`` asks for ``l_out-<il>`` (one scheduler
  split per captured layer) and computes g natively.

Both return, after each decode of T tokens, ``g`` of shape (T, n_layers) float64 (units of the hidden-state
L2 norm), where g[t, j] = ||h_l(t) - h_l(t-1)|| for layer ``layers[j]``; the previous token is the previous
*decoded* token of the sequence, even if its KV cell was evicted. The first token's g is NaN.

The eval-callback handle (:class:`CallbackHandle`) also serves as the graph probe that lists the nodes of a
real decode, used to verify that flash attention is active (a FLASH_ATTN_EXT node, no ``kq_soft_max``).
"""

from __future__ import annotations

import numpy as np

from .native import Native, NativeError
from .scoring import diff_norms

ROUTES = ("layer_out", "callback")
MODE_IDLE, MODE_CAPTURE, MODE_PROBE, MODE_ATTN = 0, 1, 2, 4


class CallbackHandle:
    """Owns an ``epikv_capture`` (C) handle; pass ``cb_eval``/``user_data`` to the Context. Close after it."""

    def __init__(self, nat: Native, layers: tuple[int, ...], n_embd: int, max_tokens: int, mode: int):
        self.nat = nat
        self.layers = tuple(layers)
        self.max_tokens = max_tokens
        arr = nat.ffi.new("int32_t[]", list(self.layers))
        self._h = nat.cap.epikv_capture_new(arr, len(self.layers), n_embd, max_tokens)
        if self._h == nat.ffi.NULL:
            raise NativeError(f"epikv_capture_new failed (layers={self.layers}, n_embd={n_embd})")
        self._g = np.empty((max_tokens, len(self.layers)), dtype=np.float32)
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
        if self.nat.cap.epikv_capture_set_mode(self.handle, mode) != 0:
            raise ValueError(f"bad capture mode {mode}")

    def take(self) -> np.ndarray:
        """g of the tokens captured since the last take: (T, n_layers) float64."""
        n = self.nat.cap.epikv_capture_take(self.handle, self.nat.ffi.from_buffer("float[]", self._g), self.max_tokens)
        if n == -1:
            raise NativeError(f"eval-callback capture saw unequal token counts per layer {self.layers}: "
                              "a layer has no l_out tensor in this architecture's graph")
        if n < 0:
            raise NativeError(f"epikv_capture_take failed ({n})")
        return self._g[:n].astype(np.float64)

    def reset(self) -> None:
        self.nat.cap.epikv_capture_reset(self.handle)

    def enable_attention(self, max_cells: int) -> None:
        """Allocate the attention accumulators (MODE_ATTN reads ``kq_soft_max-<il>``, flash attention off)."""
        if self.nat.cap.epikv_capture_enable_attention(self.handle, max_cells) != 0:
            raise NativeError(f"epikv_capture_enable_attention({max_cells}) failed")
        self._attn = (np.zeros(max_cells, dtype=np.float32), np.zeros(max_cells, dtype=np.float32))

    def take_attention(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(received, last, n_queries) since the last call: per KV cell (column), averaged over the captured
        layers and heads; ``received`` sums over the query tokens, ``last`` is the newest query's row."""
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def flash_attn_active(nodes: list[tuple[str, str]]) -> bool:
    """True when a decode graph ran flash attention: a FLASH_ATTN_EXT node and no kq_soft_max node."""
    has_fa = any(op == "FLASH_ATTN_EXT" for _, op in nodes)
    has_softmax = any(name.startswith("kq_soft_max") for name, _ in nodes)
    return has_fa and not has_softmax


class LayerOutCapture:
    """Fast route: reads the rows that the patched llama.cpp copied out for each captured layer."""

    route = "layer_out"

    def __init__(self, ctx, layers: tuple[int, ...]):
        self.ctx = ctx
        self.layers = tuple(layers)
        for il in self.layers:
            ctx.set_layer_out(il, True)
        self._prev: list[np.ndarray | None] = [None] * len(self.layers)

    def after_decode(self, n_tokens: int) -> np.ndarray:
        out = np.empty((n_tokens, len(self.layers)), dtype=np.float64)
        for j, il in enumerate(self.layers):
            rows = self.ctx.layer_out(il, n_tokens)
            if rows is None:
                raise NativeError(f"architecture {self.ctx.model.info.arch!r} has no l_out-{il} tensor in its "
                                  "graph: EPIKV capture is not supported for it")
            out[:, j] = diff_norms(rows, self._prev[j])
            self._prev[j] = rows[-1].copy()
        return out

    def reset(self) -> None:
        self._prev = [None] * len(self.layers)

    def close(self) -> None:
        pass


class CallbackCapture:
    """Plain route: the C eval callback captures ``l_out-<il>`` and computes g natively."""

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

    def close(self) -> None:
        pass
