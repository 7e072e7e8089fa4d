"""A session: one sequence inside its own KV budget, its policy, its capture state and its eviction engine.

A session is one sequence of a :class:`~epikv_local.engine.pool.SequencePool` (one context, N sequences
decoded together). ``Session(model, policy, budget)`` creates a pool of one and owns it (context and capture
handle, released by ``close()``); ``pool.open()`` leases a further sequence of a shared pool (``close()`` gives
it back). The ``Model`` stays owned by the caller (and refuses to close while a context is open). It is the
only place that decodes for generation: :meth:`Session.feed` decodes tokens in chunks, evicting first, and
hands each decode's :class:`Observation` to the policy. Callers use its methods (``begin_prompt``, ``feed``,
``logits``, ``sample``, ``stats``, ``reset``, ``fork``), not its parts.

One session serves one generation at a time: a second thread entering while a call runs, or a second
generation started while one is in progress (:meth:`Session.generation`), gets a ConfigError instead of
corrupting the sequence.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CancelledError, ConfigError, NativeError
from ..policies.base import Policy
from .budget import BudgetConfig, EngineStats, EvictionEngine
from .capture import ROUTES, SequenceCapture
from .handles import Closing, Model, kv_type
from .sampling import Sampler, SamplingConfig


@dataclass(frozen=True)
class SessionConfig:
    """Context settings. n_batch: tokens per decode call (= ubatch); the context holds kv_budget + n_batch.

    n_threads: llama.cpp threads (None: see ``handles.resolve_threads``).
    capture_route: "layer_out" (patched API, default) or "callback" (C eval callback).
    verify_flash_attn: probe the first decode's graph and fail if flash attention is not what ran.
    type_k / type_v: KV cache element types (``handles.KV_TYPES``).
    n_ctx: KV cells to allocate; None (default) = kv_budget + n_batch (``budget.context_cells``). A baseline
        without eviction that should share an evicting run's context size sets it with kv_budget = n_ctx.
    """

    n_batch: int = 64
    n_threads: int | None = None
    flash_attn: bool = True
    capture_route: str = "layer_out"
    verify_flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    n_ctx: int | None = None

    def __post_init__(self):
        if self.capture_route not in ROUTES:
            raise ConfigError(f"capture_route must be one of {ROUTES}, got {self.capture_route!r}")
        if isinstance(self.n_batch, bool) or not isinstance(self.n_batch, int) or not 1 <= self.n_batch <= 65536:
            raise ConfigError(f"n_batch must be an integer in 1..65536, got {self.n_batch!r}")
        for what in ("type_k", "type_v"):  # a name, or llama-cpp-python's GGML_TYPE_* value, stored as the name
            object.__setattr__(self, what, kv_type(getattr(self, what), what))


def check_policy_fits(policy: Policy, cfg: SessionConfig) -> None:
    """ConfigError when ``policy`` cannot run under ``cfg``: an attention-based policy needs flash attention off
    (it reads the attention matrix, which flash attention never materialises), and llama.cpp quantizes the V
    cache only with flash attention on. Front doors call it before loading a model; Session calls it too."""
    if policy.needs_attention and cfg.flash_attn:
        raise ConfigError(f"policy {policy.name!r} reads the attention matrix, which flash attention never "
                          "materialises: run it with flash attention off (--no-flash-attn)")
    if policy.needs_attention and cfg.type_v not in ("f16", "f32", "bf16"):
        raise ConfigError(f"policy {policy.name!r} needs flash attention off, and llama.cpp quantizes the V cache "
                          f"({cfg.type_v}) only with flash attention on: use an attention-free policy or "
                          "an f16 V cache")


@dataclass
class SessionStats:
    """A snapshot of a session. Units: cells, tokens, bytes, seconds."""

    policy: str
    kv_budget: int
    n_ctx: int
    n_live: int
    n_past: int
    n_evicted: int
    n_rounds: int
    max_live: int
    kv_bytes: int
    flash_attn: bool
    capture_route: str | None
    layers: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    evict_seconds: float = 0.0


class Session(Closing):
    """One sequence: its budget, policy, capture state and eviction engine, in a pool of one or a shared one.

    pool: None creates (and owns) a pool of one sequence; else the shared pool this session leases a sequence
    of (use ``pool.open()``). seq_id: the sequence to lease (None: the lowest free one); ``self.seq_id`` is
    its id in the context.
    """

    def __init__(self, model: Model, policy: Policy, budget: BudgetConfig, cfg: SessionConfig | None = None,
                 record: bool = False, *, pool=None, seq_id: int | None = None):
        from .pool import SequencePool

        self._owns_pool = pool is None
        if pool is None:
            pool = SequencePool(model, policy, budget, cfg)
        elif budget.kv_budget > pool.budget.kv_budget:
            raise ConfigError(f"kv_budget {budget.kv_budget} exceeds the pool's sequence budget "
                              f"{pool.budget.kv_budget}")
        self.pool = pool
        self.model = model
        self.policy = policy
        self.cfg = pool.cfg
        self._record = record
        self._lock = threading.Lock()  # held for the length of one session call (a decode, a sample, ...)
        self._owner: int | None = None  # the thread holding it
        self._generating = False
        self._samplers: set[Sampler] = set()
        self._cancel = threading.Event()  # set by cancel() or close() from any thread
        self._closed = False
        self._rows: list[int] = []  # batch indices of this sequence's output rows in decode number _rows_round
        self._rows_round = -1
        self._kept: list[np.ndarray] | None = None  # those rows, copied when another sequence's decode came
        # (n, logits) of the last prompt fed: the next-token logits after tokens[:n], so that a call with the
        # same prompt again (a branch answering choice i of n, a regeneration) samples from the very same row
        # instead of decoding the last prompt token again (a one-token decode rounds differently from a chunk)
        self._prompt_end: tuple[int, np.ndarray] | None = None
        # (n_vocab,) logits after the last token decoded, when the policy reads surprisal: the first new token
        # of the next decode is scored against them (never written in place: a fork shares it)
        self._surprise_prev: np.ndarray | None = None
        try:
            if not self._owns_pool and policy.bind(model.info.shape) != pool.signals:
                raise ConfigError(f"policy {policy.name!r} captures other signals than this pool's")
            self.seq_id = pool._lease(self, seq_id)
        except BaseException:
            if self._owns_pool:
                pool.close()
            raise
        self.ctx = pool.ctx
        self.capture = SequenceCapture(pool.capture)
        self._new_engine(budget)
        self.n_past = 0  # next position
        self.tokens: list[int] = []  # the token decoded at each position 0 .. n_past - 1 (evicted ones too)
        self.decode_seconds = 0.0

    def _new_engine(self, budget: BudgetConfig) -> None:
        self.engine = EvictionEngine(self.ctx, self.policy, budget, record=self._record, seq_id=self.seq_id)

    # -- ownership ----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed or self.pool.closed

    def close(self) -> None:
        """Release the sequence (its cells), and the context and capture when this session owns its pool. From
        another thread while a generation runs: that generation stops at its next step (NativeError "session
        is closed"); the step in flight finishes first, so native memory is never freed under it."""
        if getattr(self, "_closed", True) or not hasattr(self, "ctx"):
            return
        if getattr(self, "_owner", None) == threading.get_ident():
            raise NativeError("cannot close the session from inside one of its own calls")
        self._cancel.set()  # a generation running in another thread stops at its next step
        self.pool.wake()  # and a round's leader gathering its next part need not wait for it
        with self._lock:  # waits for the session call in flight (one decode or sample) to finish
            if self._closed:
                return
            self._closed = True
            if self._owns_pool:
                self.pool.close()
            else:
                self.pool._release(self)
            for sampler in list(self._samplers):  # chains still open: they sampled from that context
                sampler.close()


    @contextlib.contextmanager
    def _use(self):
        if self.closed:
            raise NativeError("session is closed")
        if not self._lock.acquire(blocking=False):
            raise ConfigError("this session is in use by another thread: one session serves one generation at a "
                              "time (use one session per thread)")
        self._owner = threading.get_ident()
        try:
            if self.closed:  # closed while this thread waited for nothing: the lock was free just now
                raise NativeError("session is closed")
            yield
        finally:
            self._owner = None
            self._lock.release()

    @contextlib.contextmanager
    def generation(self):
        """Mark a generation in progress for its whole length (the generation loop holds it across yields, whichever
        thread resumes it); a second one is refused with a ConfigError."""
        if self.closed:
            raise NativeError("session is closed")
        with self._lock:
            if self._generating:
                raise ConfigError("this session is already generating (another thread or an unfinished stream): "
                                  "finish or close that generation first, or use another session")
            self._generating = True
            self._cancel.clear()  # a cancel() aimed at an earlier generation does not stop this one
        try:
            yield self
        finally:
            self._generating = False
            self.pool.wake()  # a round's leader waiting for this generation's next part need not wait any more

    @property
    def generating(self) -> bool:
        """Whether a generation is in progress (:meth:`generation`)."""
        return self._generating

    def cancel(self) -> None:
        """Stop the generation in progress (from any thread): it raises CancelledError before its next decode
        of at most ``n_batch`` tokens or its next sample, so a long prefill stops within one ubatch. No effect
        when none runs (the next generation clears it)."""
        self._cancel.set()
        self.pool.wake()

    def _check_cancelled(self) -> None:
        if self._cancel.is_set():
            if self.closed:
                raise NativeError("session is closed")
            raise CancelledError("the generation was cancelled")

    # -- what callers read ---------------------------------------------------------------------------------
    @property
    def budget(self) -> BudgetConfig:
        return self.engine.cfg

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers whose g is captured for the policy."""
        return self.capture.plan.layers

    @property
    def flash_attn(self) -> bool | None:
        """Whether flash attention ran (verified on the first decode); None before it or when not probed."""
        return self.capture.flash_attn

    @property
    def graph_nodes(self) -> list[tuple[str, str]]:
        """(name, op) of the first decode's graph nodes (when probed)."""
        return self.capture.graph_nodes

    @property
    def recording(self) -> bool:
        """Whether eviction rounds are recorded (created with record=True): :attr:`events`."""
        return self.engine.record

    @property
    def events(self) -> list:
        """The eviction log: the rounds (``budget.EvictionEvent``: live positions, scores, protection, evicted,
        reason) since the last reset, when created with record=True."""
        return self.engine.stats.events

    @property
    def recent_window(self) -> int:
        """The recent window in effect (cells; a protected prompt can shrink the configured one)."""
        return self.engine.recent_window

    def protection_reasons(self, positions: np.ndarray) -> list[tuple[str, ...]]:
        """Why each live position is protected now ("sink", "prompt", "recent", "newest"; empty: evictable)."""
        return self.engine.protection_reasons(positions)

    def live_positions(self) -> np.ndarray:
        """(N,) int64 positions of sequence 0 held in the cache, ascending."""
        return self.engine.live_positions()

    def logits(self, i: int = -1) -> np.ndarray:
        """(n_vocab,) float32 logits of this sequence's output row i of its last decode (-1: the last; a view
        in a pool of one, a copy otherwise: copy to keep)."""
        if self.closed:
            raise NativeError("session is closed")
        with self.pool.quiet():
            if self._rows_round == self.pool.round:
                row = self.ctx.logits(self._output_row(i))
                return row if self.pool.n_seq == 1 else row.copy()
            if self._kept is not None:
                return self._kept[self._output_index(i)]
            raise NativeError(f"no logits for output {i}: this sequence's last decode kept none")

    def _output_index(self, i: int) -> int:
        n = len(self._rows) if self._kept is None else len(self._kept)
        if not -n <= i < n:
            raise NativeError(f"no logits for output {i} (the last decode of this sequence has {n} output rows)")
        return i

    def _output_row(self, i: int) -> int:
        return self._rows[self._output_index(i)]

    def _keep_rows(self, round_: int) -> None:
        """Another sequence's decode is about to overwrite the context's logits: copy this sequence's rows if
        they are the live ones (called by the round's leader)."""
        if self._rows_round == round_ and self._rows:
            self._kept = [self.ctx.logits(i).copy() for i in self._rows]
            self._rows_round = -1

    def stats(self) -> SessionStats:
        st: EngineStats = self.engine.stats
        return SessionStats(
            policy=self.policy.name, kv_budget=self.budget.kv_budget, n_ctx=self.ctx.n_ctx, n_live=self.engine.n_live,
            n_past=self.n_past, n_evicted=st.n_evicted, n_rounds=st.n_rounds, max_live=st.max_live,
            kv_bytes=self.ctx.kv_bytes, flash_attn=bool(self.flash_attn) and self.cfg.flash_attn,
            capture_route=self.cfg.capture_route if self.layers else None, layers=list(self.layers),
            decode_seconds=self.decode_seconds, evict_seconds=st.evict_seconds)

    # -- decoding -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new sequence: clear the cache and the policy's, capture's and engine's state."""
        with self._use(), self.pool.quiet():
            self.ctx.seq_rm_range(-1, -1, self.seq_id)
            self._forget_rows()
            self.policy.reset()
            self.capture.reset()
            self._new_engine(self.budget)
            self.n_past = 0
            self.tokens = []
            self._prompt_end = None
            self._surprise_prev = None

    def save_state(self, path) -> None:
        """Save the sequence (KV cells with their holes, bookkeeping, policy state) to a file; see ``state``."""
        from . import state

        with self._use(), self.pool.quiet():
            state.save(self, path)

    def load_state(self, path) -> None:
        """Continue a sequence saved by :meth:`save_state` (same model file and cache types); DataError when the
        file is not one, truncated, corrupted or from another model."""
        from . import state

        with self.pool.quiet():
            state.load(self, path)  # reads and checks the whole file before touching this session
            self._forget_rows()
            self._prompt_end = None
            self._surprise_prev = None  # the logits after the restored sequence's last token are not in the file

    def rewind_to_prefix(self, tokens: list[int]) -> int:
        """Keep the longest common prefix of the sequence and ``tokens`` (cache, evictions and all), drop the
        rest, and return where feeding ``tokens`` must resume: ``tokens[start:]`` goes next. At least the last
        token is left to feed (its logits are needed), unless ``tokens`` is the last prompt fed and its logits
        are kept (see ``feed``): then the sequence is cut back to the prompt, the next sample reads those
        logits, and ``len(tokens)`` is returned (nothing to feed).

        The resume point can lie before the common prefix when the tokens just before it were evicted
        (llama.cpp continues a sequence only after its last stored position); those are decoded again. The
        policy keeps its running statistics of the dropped tokens (an approximation: kept tokens' scores are
        unchanged, re-decoded tokens are scored afresh).
        """
        with self._use(), self.pool.quiet():
            before = self.n_past
            end = self._prompt_end
            if end is not None and end[0] == len(tokens) <= len(self.tokens) and self.tokens[:end[0]] == tokens:
                if end[0] < self.n_past:
                    self.n_past = self.engine.truncate(end[0])
                    del self.tokens[self.n_past:]
                if self.n_past == end[0]:  # the prompt's last cell is still held: continue right after it
                    self._rows, self._rows_round, self._kept = [], -1, [end[1].copy()]
                    self._surprise_prev = end[1]
                    return self.n_past
            n = 0
            limit = min(len(tokens) - 1, len(self.tokens))
            while n < limit and self.tokens[n] == tokens[n]:
                n += 1
            if n < self.n_past:
                self.n_past = self.engine.truncate(n)
                del self.tokens[self.n_past:]
            if self.n_past != before:
                self._surprise_prev = None  # the logits after the new last token are not kept
            if self._prompt_end is not None and self._prompt_end[0] > self.n_past:
                self._prompt_end = None
            return self.n_past

    def check_prompt(self, n_prompt: int) -> None:
        """BudgetError if a prompt of ``n_prompt`` tokens could not be fed now (nothing is changed)."""
        self.engine.check_prompt(n_prompt)

    @contextlib.contextmanager
    def sampling(self, cfg: SamplingConfig):
        """A sampler chain for ``cfg`` owned by this session: freed when the block ends, or with the session if
        it closes first (the chain samples from this session's context)."""
        if self.closed:
            raise NativeError("session is closed")
        sampler = Sampler(self.model, cfg)
        self._samplers.add(sampler)
        try:
            yield sampler
        finally:
            self._samplers.discard(sampler)
            sampler.close()

    def sample(self, sampler: Sampler) -> int:
        """Sample the next token from the last decode's logits with ``sampler`` (see :meth:`sampling`)."""
        self._check_cancelled()
        with self._use(), self.pool.quiet():
            if self._rows_round == self.pool.round:
                with self.ctx.using() as handle:
                    return sampler.sample(handle, self._output_row(-1))
            if self._kept is not None:
                return sampler.sample_row(self._kept[self._output_index(-1)])
            raise NativeError("no logits to sample from: this sequence's last decode kept none")

    def begin_prompt(self, n_prompt: int) -> None:
        """The next ``n_prompt`` tokens fed are a prompt: check that it fits the budget (BudgetError) and
        protect it when the budget says so. Only the prompt that starts a sequence is protected: a later turn's
        prompt continues the conversation and is covered by the recent window like any new token."""
        if self.n_past == 0:
            self.engine.begin_prompt(0, n_prompt)

    def feed(self, tokens: list[int], logits: str = "last", is_prompt: bool = False,
             template: Sequence[bool] | None = None) -> None:
        """Decode tokens at the next positions, in chunks, evicting before each chunk.

        logits: "last" (logits of the final token only) or "all" (every token of each chunk; only the last
        chunk's rows stay readable through :meth:`logits`). template: one flag per token of a prompt, True
        where a chat template wrote it (``Observation.template``); None: not rendered from messages.
        """
        if logits not in ("last", "all"):
            raise ConfigError(f"logits must be 'last' or 'all', got {logits!r}")
        if not tokens:
            return
        if template is not None and len(template) != len(tokens):
            raise ConfigError(f"template marks {len(template)} tokens of a prompt of {len(tokens)}")
        if is_prompt:
            self.begin_prompt(len(tokens))
        chunk = self.engine.prefill_chunk(self.cfg.n_batch) if len(tokens) > 1 else 1
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            self.decode_chunk(part, logits_all=(logits == "all"), logits_last=(i + chunk >= len(tokens)),
                              given=is_prompt, template=None if template is None else template[i:i + chunk],
                              prompt_left=len(tokens) - i - len(part) if is_prompt else 0)
        if is_prompt:
            self._prompt_end = (self.n_past, self.logits(-1).copy())

    def decode_chunk(self, part: list[int], logits_all: bool = False, logits_last: bool = True,
                     given: bool = False, template: Sequence[bool] | None = None, prompt_left: int = 0) -> None:
        """Evict if needed, decode ``part`` (<= n_batch tokens) at the next positions, score the new tokens. In a
        shared pool the decode may carry other sequences' tokens too (``SequencePool.decode``). given: the
        tokens are text the caller gave (a prompt), not the model's own (``Observation.given``); template: per
        token, whether a chat template wrote it (``Observation.template``); prompt_left: tokens of the same prompt
        decoded after ``part`` (``Observation.prompt_left``)."""
        if self._generating:
            self._check_cancelled()
        if not 1 <= len(part) <= self.cfg.n_batch:
            raise ConfigError(f"decode takes 1..{self.cfg.n_batch} tokens, got {len(part)}")
        with self._use():
            self.pool.decode(self, part, logits_all, logits_last, given, template, prompt_left)

    def _after_decode(self, pos: np.ndarray, part: list[int], rows: slice, n_total: int, out_rows: list[int],
                      round_: int, seconds: float, given: bool = False,
                      template: np.ndarray | None = None, prompt_left: int = 0, surprise: bool = False) -> None:
        """The pool decoded ``part`` at ``pos`` as rows ``rows`` of a decode of ``n_total`` tokens (number
        ``round_``, taking ``seconds``): book the cells, route the captured rows to the policy. out_rows: the
        output rows the caller asked for (readable through :meth:`logits`); with ``surprise`` (the policy reads
        surprisal and wanted these tokens') every row of ``rows`` has logits too, read here before the next decode
        and not kept."""
        self.decode_seconds += seconds
        self.engine.on_decoded(pos)
        self.n_past += len(part)
        self.tokens.extend(part)
        self._rows, self._rows_round, self._kept = out_rows, round_, None
        obs = self.capture.observe(pos, rows, n_total)
        obs.given = np.full(len(part), given)
        obs.protected = self.engine.in_protected_prompt(pos) if given else np.zeros(len(part), dtype=bool)
        obs.template = template
        obs.prompt_left = prompt_left
        if self.pool.digits is not None:
            obs.numeric = self.pool.digits[np.asarray(part, dtype=np.int64)]
        if surprise:
            obs.surprise = self._surprisal(part, range(rows.start, rows.stop))
        else:  # not read (or not wanted: unknown, NaN to the policy), and so is the next token's
            self._surprise_prev = None
        self.capture.check_flash_attn(self.cfg.flash_attn)
        self.policy.observe(obs)

    def _surprisal(self, part: list[int], rows: range) -> np.ndarray:
        """(T,) nats: -log softmax(logits before token i)[token i] for the T tokens just decoded, from the output
        row of the token before each (the pool asks for every row when the policy reads surprisal) and, for the
        first, the logits kept from the decode before (NaN when there are none)."""
        out = np.full(len(part), np.nan)
        prev = self._surprise_prev
        for i, token in enumerate(part):
            if prev is not None:
                top = float(prev.max())
                out[i] = top + np.log(np.exp(prev - top, dtype=np.float64).sum()) - float(prev[token])
            prev = self.ctx.logits(rows[i])  # a view of llama.cpp's output buffer
        self._surprise_prev = prev.copy()
        return out

    def _forget_rows(self) -> None:
        self._rows, self._rows_round, self._kept = [], -1, None

    def fork(self, record: bool = False) -> "Session":
        """A new sequence of the same pool that continues this one: it shares this sequence's cells (llama.cpp's
        ``seq_cp``, no copy), starts from its bookkeeping, policy and capture state and its last logits, and
        from then on evicts within its own budget (an eviction of either removes only its own hold on a shared
        cell). ConfigError when the pool has no free sequence. Used for ``n`` > 1 answers to one prompt. It may
        run while this sequence generates in another thread: between rounds its state does not change."""
        if self.closed:
            raise NativeError("session is closed")
        with self.pool.quiet():
            child = self.pool.open(record=record, budget=self.budget)
            try:
                vars(child.policy).update(copy.deepcopy(vars(self.policy)))  # a fresh policy: take this one's state
                self.ctx.seq_copy(self.seq_id, child.seq_id, -1, -1)
                child.engine.copy_from(self.engine)
                child.n_past, child.tokens = self.n_past, list(self.tokens)
                child.capture.set_state(self.capture.state())
                child._prompt_end = self._prompt_end  # its array is never written (rewind hands out a copy)
                child._surprise_prev = self._surprise_prev  # never written in place either
                if self._rows_round == self.pool.round and self._rows:
                    child._kept = [self.ctx.logits(i).copy() for i in self._rows]
                elif self._kept is not None:
                    child._kept = [r.copy() for r in self._kept]
            except BaseException:
                child.close()
                raise
            return child
