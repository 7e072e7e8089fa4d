"""Sequences in one llama.cpp context: N streams, each inside its own KV budget, decoded together.

A :class:`SequencePool` owns one context with ``n_seq`` sequences (a unified KV cache of n_seq x the slot
budget + one ubatch cells) and the capture attached to it. Each sequence is a
:class:`~epikv_local.engine.session.Session` leased from the pool (:meth:`SequencePool.open`, released by
its ``close()``): its own policy instance, eviction engine (which removes only its own cells), capture state,
tokens and positions. A plain ``Session(model, policy, budget)`` is a pool of one: the same code.

Decoding is group commit (continuous batching without a scheduler thread). A session's decode posts its
tokens and waits; the caller that finds no decode in flight leads the round: it first waits up to
``gather_s`` for every other sequence in a generation to post its next token, then decodes in one
``llama_decode`` one token of each waiting generation and as much of the waiting prompts as fits the ubatch
(single tokens first, so a long prompt never stalls the others), each sequence's evictions done before the
decode (its ``make_room``) and its captured rows routed to it. A sequence's logits rows stay readable until
its own next decode: when another sequence's round would overwrite them, the pool copies them first.

Every change of the KV cells (decode, eviction, rewind, save, restore, release) happens either in the round's
leader or inside :meth:`SequencePool.quiet` (no round in flight), so llama.cpp's memory is never changed
from two threads at once.

Batch invariance: llama.cpp's CPU flash-attention kernel picks its code path by the ubatch's query rows and
the KV length (a split-KV path for one row over >= 512 cells, a tiled one for >= 64 rows, a per-row one
otherwise), so a token decoded alongside others can get logits that differ in the last bits from the same
token decoded alone; docs/parallel.md gives the measured bound.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..errors import CancelledError, ConfigError, NativeError
from ..policies.base import Policy
from .budget import BudgetConfig, context_cells
from .capture import CapturePlan
from .handles import Closing, Context, Model

#: how long a round's leader waits for the other generating sequences to post their next token (seconds)
GATHER_S = 0.005


class _DecodeThread:
    """Runs every ``llama_decode`` of a pool in one thread. llama.cpp's CPU backend (built with OpenMP) keeps
    a team of worker threads per calling thread, and decodes from different threads left several teams
    competing for the cores: measured on 2 cores, a pool of one generated 30-43 tokens/s from a second thread
    once the main thread had decoded, against 74-77 from the main thread alone (with this thread: 73-77 from
    either; docs/parallel.md). A server runs each request in a thread of its own, a chat UI its callbacks."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="epikv-decode", daemon=True)
        self._thread.start()

    def run(self, fn):
        """``fn()`` in the decode thread: its value, or its exception re-raised here. Waits for it to end even
        through a Ctrl-C (re-raised after), so that no round starts while a decode still runs."""
        box: dict = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        interrupted = False
        while True:
            try:
                if done.wait(0.1):
                    break
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, box, done = item
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                done.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


@dataclass
class _Request:
    """One decode call of a session, waiting for (or inside) rounds: tokens[done:] are still to decode."""

    session: object
    tokens: list[int]
    logits_all: bool
    logits_last: bool
    given: bool = False
    template: np.ndarray | None = None  # (len(tokens),) bool: written by a chat template (Observation.template)
    prompt_left: int = 0  # tokens of the same prompt after these (Observation.prompt_left)
    done: int = 0
    finished: bool = False
    error: BaseException | None = None

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class RoundStats:
    """Counts since the pool was created: rounds decoded, tokens decoded, rounds that carried several
    sequences, the most sequences in one round, seconds inside llama_decode."""

    n_rounds: int = 0
    n_tokens: int = 0
    n_shared: int = 0  # rounds that carried more than one sequence
    max_sequences: int = 0
    seconds: float = 0.0


class SequencePool(Closing):
    """One context of ``n_seq`` sequences, each with up to ``budget.kv_budget`` live cells (see module doc).

    policy: the prototype, bound here; each leased session gets a fresh copy (the first session created by
    ``Session(...)`` uses this instance itself). n_seq: sequences the context holds (llama.cpp's n_seq_max).
    gather_s: a round's leader waits at most this long (seconds) for the other generating sequences.
    """

    def __init__(self, model: Model, policy: Policy, budget: BudgetConfig, cfg=None, n_seq: int = 1,
                 gather_s: float = GATHER_S):
        from .session import SessionConfig, check_policy_fits

        if isinstance(n_seq, bool) or not isinstance(n_seq, int) or not 1 <= n_seq <= 256:
            raise ConfigError(f"the number of parallel sequences must be an integer in 1..256, got {n_seq!r}")
        self.model = model
        self.cfg = cfg or SessionConfig()
        self.budget = budget
        self.n_seq = n_seq
        self.gather_s = float(gather_s)
        info = model.info
        self.signals = policy.bind(info.shape)
        check_policy_fits(policy, self.cfg)
        #: (n_vocab,) bool, tokens whose text holds a digit, when the policy reads them (Observation.numeric)
        self.digits = model.digit_mask() if self.signals.numbers else None
        plan = CapturePlan.build(self.signals, self.cfg.capture_route, self.cfg.verify_flash_attn)
        n_ctx = self.cfg.n_ctx or context_cells(n_seq * budget.kv_budget, self.cfg.n_batch)
        if n_ctx < budget.kv_budget:
            raise ConfigError(f"n_ctx {n_ctx} is smaller than kv_budget {budget.kv_budget}")
        self._prototype = policy
        self._pristine = copy.deepcopy(policy)  # fresh, bound: what each further sequence starts from
        self._prototype_taken = False
        self._cond = threading.Condition()  # guards everything below; reentrant (an RLock)
        self._busy = False  # a round is decoding (its leader runs without holding _cond)
        self._closed = False
        self._pending: list[_Request] = []
        self._sessions: dict[int, object] = {}  # seq_id -> the session leasing it
        self._in_round: list = []  # the sessions of the round being decoded (the kv-full hook evicts among them)
        self.round = 0  # serial of the last decode
        self.rounds = RoundStats()
        with contextlib.ExitStack() as stack:
            handle = plan.open(model.nat, info.n_embd, self.cfg.n_batch)
            if handle is not None:
                stack.callback(handle.close)  # freed after the context, which calls into it
            self.ctx = stack.enter_context(Context(
                model, n_ctx=n_ctx, n_batch=self.cfg.n_batch, flash_attn=self.cfg.flash_attn,
                n_threads=self.cfg.n_threads, cb_eval=handle.cb_eval if handle else None,
                cb_eval_user_data=handle.user_data if handle else 0, type_k=self.cfg.type_k,
                type_v=self.cfg.type_v, n_seq_max=n_seq))
            self.capture = plan.attach(self.ctx, handle, info.arch)
            if n_seq > 1 and not self.capture.per_sequence:
                raise ConfigError(f"policy {policy.name!r} with capture route {self.cfg.capture_route!r} serves one "
                                  "sequence per context (the callback route and the attention readback see the "
                                  "whole decode): use n_parallel=1, or the layer_out route and an "
                                  "attention-free policy")
            self.ctx.set_kv_full_callback(self._on_kv_full)
            self._decoder = _DecodeThread()
            stack.callback(self._decoder.close)  # after the context is freed (stack order: reverse)
            self._stack = stack.pop_all()

    # -- leasing ------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def n_free(self) -> int:
        with self._cond:
            return self.n_seq - len(self._sessions)

    def open(self, record: bool = False, budget: BudgetConfig | None = None, seq_id: int | None = None):
        """A new session in a free sequence of this pool (ConfigError when all ``n_seq`` are leased, or
        ``seq_id`` is given and leased). budget: its own (kv_budget at most the pool's), default the pool's."""
        from .session import Session

        return Session(self.model, self._new_policy(), budget or self.budget, self.cfg, record=record, pool=self,
                       seq_id=seq_id)

    def _new_policy(self) -> Policy:
        return copy.deepcopy(self._pristine)

    def _lease(self, session, seq_id: int | None = None) -> int:
        with self._cond:
            if self._closed:
                raise NativeError("the sequence pool is closed")
            if session.policy is self._prototype:
                if self._prototype_taken:
                    raise ConfigError("this policy instance already serves a sequence of the pool")
                self._prototype_taken = True
            free = [i for i in range(self.n_seq) if i not in self._sessions]
            if seq_id is not None:
                if not 0 <= seq_id < self.n_seq:
                    raise ConfigError(f"sequence {seq_id} does not exist (0..{self.n_seq - 1})")
                if seq_id not in free:
                    raise ConfigError(f"sequence {seq_id} is in use")
                free = [seq_id]
            if not free:
                raise ConfigError(f"all {self.n_seq} sequences of this context are in use (n_parallel={self.n_seq})")
            self._sessions[free[0]] = session
            return free[0]

    def _release(self, session) -> None:
        """Free the session's sequence: its cells go, its id can be leased again."""
        with self.quiet():
            if self._sessions.get(session.seq_id) is session:
                if not self._closed:
                    self.ctx.seq_rm_range(-1, -1, session.seq_id)
                del self._sessions[session.seq_id]
                if session.policy is self._prototype:
                    self._prototype_taken = False

    def sessions(self) -> list:
        """The sessions leasing a sequence now, by sequence id."""
        with self._cond:
            return [self._sessions[i] for i in sorted(self._sessions)]

    def close(self) -> None:
        """Stop every session's generation at its next step, wait for the round in flight, free the context."""
        with self._cond:
            if self._closed:
                return
            for s in self._sessions.values():
                s._cancel.set()
            while self._busy:
                self._cond.wait()
            self._closed = True
            stack, self._stack = self._stack, None
            self._cond.notify_all()
        if stack is not None:
            stack.close()

    # -- rounds -------------------------------------------------------------------------------------------
    def wake(self) -> None:
        """A sequence stopped generating or was cancelled: a round's leader gathering the generating sequences'
        parts re-checks now instead of at the end of its wait (``gather_s``)."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def quiet(self):
        """Hold the pool with no round in flight (for reading logits, sampling or changing a sequence's cells
        outside a round). Reentrant."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            yield

    def used_cells(self) -> int:
        """KV cells holding at least one sequence (a cell shared after ``seq_copy`` counts once)."""
        with self.quiet():
            used = np.zeros(self.ctx.n_ctx, dtype=bool)
            for i in self._sessions:
                cells = self.ctx.cell_positions(i)
                used[: len(cells)] |= cells >= 0
            return int(used.sum())

    def decode(self, session, tokens: list[int], logits_all: bool = False, logits_last: bool = True,
               given: bool = False, template=None, prompt_left: int = 0) -> None:
        """Decode ``tokens`` at ``session``'s next positions, in rounds shared with the other sequences; returns
        when all are decoded (the session's state then reflects them) or raises the error of its part.
        prompt_left: tokens of the same prompt that the session decodes after these."""
        req = _Request(session, [int(t) for t in tokens], logits_all, logits_last, given,
                       None if template is None else np.asarray(template, dtype=bool), prompt_left)
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()
            until = time.perf_counter() + self.gather_s
            while not req.finished:
                if self._closed:
                    self._pending.remove(req)
                    raise NativeError("session is closed")
                if self._busy:
                    self._cond.wait()
                    continue
                wait = self._gather_wait(until)
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._lead()
                until = time.perf_counter() + self.gather_s
        if req.error is not None:
            raise req.error

    def _gather_wait(self, until: float) -> float:
        """Seconds to wait before leading: 0 once every generating sequence has posted (or time is up)."""
        posted = {id(r.session) for r in self._pending}
        for s in self._sessions.values():
            if s._generating and id(s) not in posted and not s._cancel.is_set():
                return until - time.perf_counter()
        return 0.0

    def _lead(self) -> None:
        """Run one round (called holding _cond, no round in flight; _cond is released during the decode)."""
        self._busy = True
        work = self._compose()
        self._cond.release()
        try:
            self._run(work)
        except BaseException as e:  # the decode itself failed: every part of the round has that error
            for req, _ in work:
                if not req.finished:
                    req.error, req.finished = e, True
        finally:
            self._cond.acquire()
            self._busy = False
            self._pending = [r for r in self._pending if not r.finished]
            self._cond.notify_all()

    def _compose(self) -> list[tuple[_Request, int]]:
        """This round's parts: (request, tokens to take), single tokens first, then prompt chunks in order of
        arrival, as long as the ubatch has room; decoded in the order of their sequence ids."""
        room = self.ctx.n_batch
        work: list[tuple[_Request, int]] = []
        for req in self._pending:
            s = req.session
            if s._cancel.is_set() and s._generating:
                req.error = NativeError("session is closed") if s.closed else CancelledError(
                    "the generation was cancelled")
                req.finished = True
        live = [r for r in self._pending if not r.finished]
        for req in sorted(live, key=lambda r: r.left != 1):  # stable: singles first, then arrival order
            if room == 0:
                break
            n = min(req.left, room)  # a part is at most one ubatch (Session.feed sizes prompt chunks)
            if req.logits_all and n < req.left:
                continue  # every row of the part in one decode: wait for a round with room
            work.append((req, n))
            room -= n
        # in the batch by sequence id, not by arrival: a row's last bits depend on where it sits in the ubatch
        # (the CPU kernels split and block by rows), so the same parts give the same results on every run
        work.sort(key=lambda part: part[0].session.seq_id)
        return work

    def _run(self, work: list[tuple[_Request, int]]) -> None:
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        outs: list[bool] = []  # rows llama.cpp computes
        asked: list[bool] = []  # rows the callers asked for (the others only feed Observation.surprise)
        parts = []
        for req, n in work:
            s = req.session
            try:
                s.engine.make_room(n)
                # a policy reading surprisal needs every token's logits (Observation.surprise, Session._surprisal),
                # when it says these tokens need it (the output layer once per prompt token is prefill's main cost)
                want = self.signals.surprise and s.policy.wants_surprise(
                    req.prompt_left + req.left if req.given else 0, s.engine.fewest_scored)
            except BaseException as e:  # noqa: BLE001 - this sequence's budget or policy, not the round's
                req.error, req.finished = e, True
                continue
            last = req.done + n == len(req.tokens)
            p = np.arange(s.n_past, s.n_past + n, dtype=np.int64)
            parts.append((req, n, len(tokens), p, want))
            tokens += req.tokens[req.done:req.done + n]
            pos += p.tolist()
            seqs += [s.seq_id] * n
            asked += [req.logits_all or (req.logits_last and last and i == n - 1) for i in range(n)]
            outs += [want or a for a in asked[-n:]]
        if not parts:
            return
        members = {id(req.session) for req, *_ in parts}
        for s in self._sessions.values():  # rows this decode overwrites that another sequence may still read
            if id(s) not in members:
                s._keep_rows(self.round)
        self._in_round = [req.session for req, *_ in parts]
        t0 = time.perf_counter()
        try:
            self._decoder.run(lambda: self.ctx.decode(tokens, pos, seq_id=seqs, outputs=outs))
        finally:
            self._in_round = []
        dt = time.perf_counter() - t0
        self.round += 1
        st = self.rounds
        st.n_rounds += 1
        st.n_tokens += len(tokens)
        st.seconds += dt
        st.n_shared += len(parts) > 1
        st.max_sequences = max(st.max_sequences, len(parts))
        for req, n, start, p, want in parts:
            rows = [start + i for i in range(n) if asked[start + i]]  # batch indices (llama_get_logits_ith)
            try:
                req.session._after_decode(p, req.tokens[req.done:req.done + n], slice(start, start + n), len(tokens),
                                          rows, self.round, dt, req.given,
                                          None if req.template is None else req.template[req.done:req.done + n],
                                          req.prompt_left + len(req.tokens) - req.done - n, want)
                req.done += n
                req.finished = req.done == len(req.tokens)
            except BaseException as e:  # noqa: BLE001 - its policy's error is its own
                req.error, req.finished = e, True

    def _on_kv_full(self, n_tokens: int) -> bool:
        """llama_decode's kv-full hook: evict from the round's sequence fullest against its own budget."""
        if not self._in_round:
            return False
        s = max(self._in_round, key=lambda x: x.engine.n_live / x.engine.cfg.kv_budget)
        return s.engine.on_kv_full(n_tokens)

    # -- what the front doors read ------------------------------------------------------------------------
    def slots(self) -> list[dict]:
        """Per sequence id: whether leased, live cells, budget, evictions, positions (llama-server's /slots)."""
        with self._cond:
            out = []
            for i in range(self.n_seq):
                s = self._sessions.get(i)
                if s is None:
                    out.append({"id": i, "state": "free", "n_live": 0, "kv_budget": self.budget.kv_budget,
                                "n_evicted": 0, "n_past": 0})
                    continue
                out.append({"id": i, "state": "generating" if s._generating else "idle", "n_live": s.engine.n_live,
                            "kv_budget": s.engine.cfg.kv_budget, "n_evicted": s.engine.stats.n_evicted,
                            "n_past": s.n_past})
            return out
