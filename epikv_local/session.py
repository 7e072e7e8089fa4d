"""A generation session: one context sized by the KV budget, capture wired to a policy, and the engine.

``Session`` owns the native objects it creates (context, capture handle) and releases them on ``close()``;
the ``Model`` stays owned by the caller. It is the only place that decodes for generation:
:meth:`Session.feed` decodes tokens (chunked, evicting first) and hands the captured ``g`` to the policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .capture import (
    MODE_ATTN,
    MODE_CAPTURE,
    MODE_IDLE,
    MODE_PROBE,
    ROUTES,
    CallbackCapture,
    CallbackHandle,
    LayerOutCapture,
    flash_attn_active,
)
from .eviction import BudgetConfig, EvictionEngine
from .model import Context, Model
from .policies import Policy
from .policies.base import Observation


@dataclass(frozen=True)
class SessionConfig:
    """Context settings. n_batch: tokens per decode call (= ubatch); n_ctx = kv_budget + n_batch.

    capture_route: "layer_out" (patched API, default) or "callback" (C eval callback).
    verify_flash_attn: probe the first decode's graph and fail if flash attention is not what ran.
    """

    n_batch: int = 64
    n_threads: int | None = None
    flash_attn: bool = True
    capture_route: str = "layer_out"
    verify_flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"

    def __post_init__(self):
        if self.capture_route not in ROUTES:
            raise ValueError(f"capture_route must be one of {ROUTES}, got {self.capture_route!r}")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {self.n_batch}")


class FlashAttnError(RuntimeError):
    """Flash attention was requested but the decode graph did not run it."""


class Session:
    """Model + budget-sized context + capture + policy + eviction engine for sequence 0."""

    def __init__(self, model: Model, policy: Policy, budget: BudgetConfig, cfg: SessionConfig | None = None,
                 record: bool = False):
        self.model = model
        self.policy = policy
        self.budget = budget
        self.cfg = cfg or SessionConfig()
        info = model.info
        self.layers = policy.layers(info.n_layer)
        for il in self.layers:
            if not 0 <= il < info.n_layer - 1:
                raise ValueError(f"layer {il} is beyond what a {info.n_layer}-layer model can capture "
                                 f"(0..{info.n_layer - 2})")
        self.key_layers = policy.key_layers(info.n_layer)
        for il in self.key_layers:
            if not 0 <= il < info.n_layer:
                raise ValueError(f"key layer {il} is beyond this {info.n_layer}-layer model")
        if policy.needs_attention and self.cfg.flash_attn:
            raise ValueError(f"policy {policy.name!r} reads the attention matrix, which flash attention never "
                             "materialises: run it with flash attention off (--no-flash-attn)")
        self._handle: CallbackHandle | None = None
        self._run_mode = (MODE_CAPTURE if self.layers and self.cfg.capture_route == "callback" else 0) | (
            MODE_ATTN if policy.needs_attention else 0)
        if self.cfg.verify_flash_attn or self._run_mode:
            mode = (MODE_PROBE if self.cfg.verify_flash_attn else 0) | self._run_mode
            if policy.needs_attention:
                cb_layers = policy.attention_layers(info.n_layer)
                if self.layers and self.cfg.capture_route == "callback" and set(cb_layers) != set(self.layers):
                    raise ValueError("the callback capture route and attention readback need the same layers")
            else:
                cb_layers = self.layers or (0,)
            self._handle = CallbackHandle(model.nat, cb_layers, info.n_embd, self.cfg.n_batch, 0)
            if policy.needs_attention:
                self._handle.enable_attention(budget.kv_budget + self.cfg.n_batch + 256)
            self._handle.set_mode(mode)
        try:
            self.ctx = Context(model, n_ctx=budget.kv_budget + self.cfg.n_batch, n_batch=self.cfg.n_batch,
                               flash_attn=self.cfg.flash_attn, n_threads=self.cfg.n_threads,
                               cb_eval=self._handle.cb_eval if self._handle else None,
                               cb_eval_user_data=self._handle.user_data if self._handle else 0,
                               type_k=self.cfg.type_k, type_v=self.cfg.type_v)
        except BaseException:
            if self._handle:
                self._handle.close()
            raise
        self.capture = None
        if self.layers:
            self.capture = (LayerOutCapture(self.ctx, self.layers) if self.cfg.capture_route == "layer_out"
                            else CallbackCapture(self._handle))
        for il in self.key_layers:
            self.ctx.set_layer_capture(il, True, kind=1)
        self.engine = EvictionEngine(self.ctx, policy, budget, record=record)
        self.ctx.set_kv_full_callback(self.engine.on_kv_full)
        self.flash_attn: bool | None = None  # known after the first decode when verified
        self.graph_nodes: list[tuple[str, str]] = []
        self.n_past = 0  # next position
        self.decode_seconds = 0.0

    # -- ownership ----------------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "ctx", None) is not None:
            self.ctx.close()
            self.ctx = None
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- decoding -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new sequence: clear the cache and the policy's and capture's state."""
        self.ctx.clear()
        self.policy.reset()
        if self.capture:
            self.capture.reset()
        self.engine = EvictionEngine(self.ctx, self.policy, self.budget, record=self.engine.record)
        self.ctx.set_kv_full_callback(self.engine.on_kv_full)
        self.n_past = 0

    def prefill_chunk(self) -> int:
        """Tokens per decode during prefill: n_batch, but small enough to leave the protected cells room."""
        if not self.policy.evicts:
            return self.cfg.n_batch
        room = self.budget.kv_budget - self.budget.n_sink - self.engine.recent
        return max(1, min(self.cfg.n_batch, room))

    def feed(self, tokens: list[int], logits: str = "last", is_prompt: bool = False) -> None:
        """Decode tokens at the next positions, in chunks, evicting before each chunk.

        logits: "last" (logits of the final token only) or "all" (every token; read each chunk with
        ``on_chunk``-style callers via ``Context.logits(i)`` right after, see fidelity tools).
        """
        if is_prompt:
            self.engine.check_prompt(len(tokens))
            self.engine.prompt_end = self.n_past + len(tokens)
        chunk = self.prefill_chunk() if len(tokens) > 1 else 1
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            self.decode_chunk(part, logits_all=(logits == "all"), logits_last=(i + chunk >= len(tokens)))

    def decode_chunk(self, part: list[int], logits_all: bool = False, logits_last: bool = True) -> None:
        """Evict if needed, decode ``part`` (<= n_batch tokens) at the next positions, score the new tokens."""
        n = len(part)
        self.engine.make_room(n)
        pos = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        t0 = time.perf_counter()
        self.ctx.decode(part, pos, logits_last=logits_last, logits_all=logits_all)
        self.decode_seconds += time.perf_counter() - t0
        self.engine.on_decoded(pos)
        self.n_past += n
        if self.flash_attn is None and self._handle is not None and self.cfg.verify_flash_attn:
            self._check_flash_attn()
        self.policy.observe(self._observe(pos))

    def _observe(self, pos: np.ndarray) -> Observation:
        n = len(pos)
        obs = Observation(positions=pos)
        if self.capture:
            obs.g = self.capture.after_decode(n)
        if self.key_layers:
            rows = [self.ctx.layer_keys(il, n) for il in self.key_layers]
            if any(r is None for r in rows):
                raise RuntimeError(f"architecture {self.model.info.arch!r} names no Kcur tensor: key capture fails")
            obs.keys = np.stack(rows, axis=1).copy()
        if self.policy.needs_attention:
            obs.attn_received, obs.attn_last, _ = self._handle.take_attention()
            obs.cell_pos = self.ctx.cell_positions()
            n_cells = len(obs.cell_pos)
            obs.attn_received = obs.attn_received[:n_cells]
            obs.attn_last = obs.attn_last[:n_cells]
        return obs

    def _check_flash_attn(self) -> None:
        self.graph_nodes = self._handle.probe_nodes()
        self.flash_attn = flash_attn_active(self.graph_nodes)
        self._handle.set_mode(self._run_mode or MODE_IDLE)
        if self.cfg.flash_attn and not self.flash_attn:
            raise FlashAttnError("flash attention was requested but the decode graph has no FLASH_ATTN_EXT node "
                                 "(or still has kq_soft_max): this backend cannot honour it")

    def probe_next_decode(self) -> None:
        """Record the node list of the next decode (tests, diagnostics)."""
        if self._handle is None:
            raise RuntimeError("the session has no eval-callback handle (verify_flash_attn=False)")
        self._handle.set_mode(MODE_PROBE | self._run_mode)
        self.flash_attn = None
