"""Teacher-forced passes: a trace fed through a budgeted session in fixed chunks, every row's log-probs read.

:func:`run_passes` runs a list of passes of one policy configuration (:class:`PassJob`: tokens, budget, what to
evaluate). With ``n_parallel = 1`` each pass has a context of its own, one after another. With ``n_parallel = N``
up to N passes run at once as sequences of one :class:`~epikv_local.engine.pool.SequencePool`, each in a
thread of its own: every decode carries one chunk of each running pass (N x ``chunk`` rows), each sequence
evicts within its own budget and gets its own captured rows and logits. That is the product's parallel
decoding (``serve --parallel``), used by the harness: fidelity passes, the calibration grid and its signal
choice (:mod:`.fidelity`, :mod:`.calibrate`, :mod:`.signals`).

What it changes in the numbers: the evictions are the same (a deterministic policy) and a pooled run gives the
same bits on every repeat, but not always the bits of the passes alone. Without eviction they were identical on
SmolLM2 (tested); on a Q4_K model the CPU backend's matrix kernels treat a row by its place in the batch (mean
|Δ log p| 0.00026 on Qwen2.5-Coder-0.5B). With eviction a sequence's cells sit in another physical order, and
llama.cpp's CPU flash attention rounds by that order (docs/parallel.md, "Batch invariance"). The size of both
on a ΔNLL is measured in docs/calibration.md ("Parallel passes").
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..engine.budget import BudgetConfig, context_cells
from ..engine.handles import Model
from ..engine.pool import SequencePool
from ..engine.session import Session, SessionConfig
from ..errors import ConfigError
from ..policies import Policy, make_policy
from .stats import log_softmax

#: a pooled pass's round waits at most this long (seconds) for the other passes' next chunk. Each pass's own work
#: between chunks (reading and comparing chunk x n_vocab log-probs, several passes sharing 2 cores) can take a
#: good part of a second, and a round that left one out would make the rounds' composition, and so the last
#: bits of the results, depend on timing. A pass that ends, fails or is cancelled is not waited for.
PASS_GATHER_S = 10.0
#: llama.cpp rounds a context's cells up to a multiple of this (llama-context.cpp, GGML_PAD(n_ctx, 256)): what a
#: pass alone would allocate, so that a pooled pass reports the same kv_bytes as the pass alone
N_CTX_PAD = 256


@dataclass
class PassResult:
    """One teacher-forced pass. logp: (n_eval, V) float32 of positions ``eval_start ..`` or None if streamed.
    seconds: the pass's wall time; decode_seconds: the llama_decode time of the rounds that carried it (shared
    with the other passes of those rounds); kv_bytes: the KV cache a context of this pass alone allocates."""

    policy: str
    kv_budget: int
    flash_attn: bool
    eval_start: int
    n_eval: int
    seconds: float
    decode_seconds: float
    n_evicted: int
    max_live: int
    logp: np.ndarray | None = None
    kv_bytes: int = 0
    positions: np.ndarray | None = None


@dataclass
class PassJob:
    """One pass: ``tokens[:-1]`` fed in chunks under ``budget``; positions ``t >= eval_start`` (default
    ``budget.kv_budget``) evaluated. on_chunk: receives each evaluated chunk's ``(positions (k,) int64,
    logp (k, V) float32)`` and nothing is kept; without it the log-probs come back in ``PassResult.logp``.
    With ``n_parallel > 1`` on_chunk is called from the pass's own thread (one object per job)."""

    tokens: list[int]
    budget: BudgetConfig
    eval_start: int | None = None
    on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None

    @property
    def start(self) -> int:
        return self.budget.kv_budget if self.eval_start is None else self.eval_start

    @property
    def n_eval(self) -> int:
        return max(0, len(self.tokens) - 1 - self.start)


def _check(jobs: list[PassJob], chunk: int) -> None:
    if chunk < 1:
        raise ConfigError(f"chunk must be >= 1, got {chunk}")
    if any(len(job.tokens) < 2 for job in jobs):
        raise ConfigError("a trace needs at least 2 tokens")


def _fresh(policy: "str | Policy") -> Policy:
    """A new, unbound policy instance (a name or spec made; an instance copied, never shared between passes)."""
    return copy.deepcopy(policy) if isinstance(policy, Policy) else make_policy(policy)


def _feed(session: Session, job: PassJob, chunk: int, generating: contextlib.ExitStack) -> np.ndarray | None:
    """Run ``job`` through ``session`` (see :class:`PassJob`); its log-probs when it has no on_chunk.
    generating: holds the session's generation (entered by the caller, so that a pooled round waits for this
    pass's chunks: ``SequencePool._gather_wait``); closed here once the last chunk is decoded."""
    tokens, start, n_in = job.tokens, job.start, len(job.tokens) - 1
    n_vocab = session.model.info.n_vocab
    out = None if job.on_chunk is not None else np.empty((job.n_eval, n_vocab), dtype=np.float32)
    buf = np.empty((chunk, n_vocab), dtype=np.float32)
    with generating:
        # chunk by chunk through the session (it evicts between chunks to hold the budget); the last token is
        # not decoded (it has no target)
        for i in range(0, n_in, chunk):
            part = tokens[i:min(i + chunk, n_in)]
            k = len(part)
            want = i + k > start
            session.decode_chunk(part, logits_all=want, logits_last=True)
            if i + k == n_in:
                generating.close()  # the last decode: the others' rounds need not wait for this pass any more
            if not want:
                continue
            j0 = max(0, start - i)  # first evaluated row of this chunk
            for j in range(j0, k):
                buf[j - j0] = session.logits(j)
            logp = log_softmax(buf[: k - j0])
            positions = np.arange(i + j0, i + k, dtype=np.int64)
            if job.on_chunk is not None:
                job.on_chunk(positions, logp)
            else:
                out[i + j0 - start: i + k - start] = logp
    return out


def _generating(session: Session) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(session.generation())
    return stack


def _result(session: Session, job: PassJob, logp, seconds: float, flash_attn: bool, kv_bytes: int) -> PassResult:
    st = session.stats()
    return PassResult(policy=session.policy.name, kv_budget=job.budget.kv_budget, flash_attn=bool(flash_attn),
                      eval_start=job.start, n_eval=job.n_eval, seconds=seconds, decode_seconds=st.decode_seconds,
                      n_evicted=st.n_evicted, max_live=st.max_live, logp=logp, kv_bytes=kv_bytes,
                      positions=np.arange(job.start, job.start + job.n_eval, dtype=np.int64))


def run_passes(model: Model, policy: "str | Policy", jobs: list[PassJob], chunk: int, flash_attn: bool,
               n_threads: int | None = None, n_parallel: int = 1, type_k: str = "f16",
               type_v: str = "f16") -> list[PassResult]:
    """Run ``jobs`` (see module doc), each with a fresh instance of ``policy`` (a name, spec or instance);
    results in the order of ``jobs``.

    n_parallel: passes decoded together as sequences of one context (1: one context per pass, one after
    another). Policies that read the attention matrix see the whole decode, so they always run one at a time.
    type_k / type_v: KV cache element types (quantized caches compared with an f16 reference).
    """
    _check(jobs, chunk)
    if isinstance(n_parallel, bool) or not isinstance(n_parallel, int) or n_parallel < 1:
        raise ConfigError(f"n_parallel must be an integer >= 1, got {n_parallel!r}")
    if not jobs:
        return []
    proto = _fresh(policy)
    waves = -(-len(jobs) // n_parallel)
    k = -(-len(jobs) // waves)  # as many waves as n_parallel needs, evenly filled: 4 jobs at 3 run as 2 + 2
    if k == 1 or proto.needs_attention:
        return [_alone(model, proto if i == 0 else _fresh(policy), job, chunk, flash_attn, n_threads, type_k,
                       type_v) for i, job in enumerate(jobs)]
    return _pooled(model, proto, jobs, chunk, flash_attn, n_threads, k, type_k, type_v)


def _alone(model, policy: Policy, job: PassJob, chunk, flash_attn, n_threads, type_k, type_v) -> PassResult:
    cfg = SessionConfig(n_batch=chunk, n_threads=n_threads, flash_attn=flash_attn, verify_flash_attn=True,
                        type_k=type_k, type_v=type_v)
    t0 = time.perf_counter()
    with Session(model, policy, job.budget, cfg) as session:
        logp = _feed(session, job, chunk, _generating(session))
        return _result(session, job, logp, time.perf_counter() - t0, flash_attn, session.ctx.kv_bytes)


def _pooled(model, proto: Policy, jobs: list[PassJob], chunk, flash_attn, n_threads, k, type_k,
            type_v) -> list[PassResult]:
    """The jobs in waves of ``k`` (the last may be smaller): job i of a wave in sequence i, each fed from a thread
    of its own. Every pass of a wave is generating before any decodes and a round waits for every generating
    pass, so each round carries the same parts in the same order (by sequence id) from one run to the next: the
    results are reproducible."""
    cfg = SessionConfig(n_batch=chunk * k, n_threads=n_threads, flash_attn=flash_attn, verify_flash_attn=True,
                        type_k=type_k, type_v=type_v)
    widest = BudgetConfig(kv_budget=max(j.budget.kv_budget for j in jobs))
    results: list[PassResult] = []
    with SequencePool(model, proto, widest, cfg, n_seq=k, gather_s=PASS_GATHER_S) as pool:
        per_cell = pool.ctx.kv_bytes / pool.ctx.n_ctx
        for w in range(0, len(jobs), k):
            results += _wave(pool, jobs[w:w + k], chunk, flash_attn, per_cell)
    return results


def _wave(pool: SequencePool, wave: list[PassJob], chunk: int, flash_attn: bool, per_cell: float) -> list[PassResult]:
    out: list[PassResult | None] = [None] * len(wave)
    errors: list[BaseException] = []
    with contextlib.ExitStack() as stack:
        sessions = [stack.enter_context(pool.open(budget=job.budget, seq_id=i)) for i, job in enumerate(wave)]
        gens = [stack.enter_context(_generating(s)) for s in sessions]
        t0 = time.perf_counter()

        def work(i: int) -> None:
            try:
                logp = _feed(sessions[i], wave[i], chunk, gens[i])
                cells = -(-context_cells(wave[i].budget.kv_budget, chunk) // N_CTX_PAD) * N_CTX_PAD
                alone = round(per_cell * cells)
                out[i] = _result(sessions[i], wave[i], logp, time.perf_counter() - t0, flash_attn, alone)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                gens[i].close()  # not waited for any more
                errors.append(e)
                for s in sessions:  # the other passes stop at their next chunk
                    s.cancel()

        threads = [threading.Thread(target=work, args=(i,), name=f"epikv-pass-{i}", daemon=True)
                   for i in range(len(wave))]
        try:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
        except BaseException:  # Ctrl-C: stop every pass at its next chunk, wait for the threads, then re-raise
            for s in sessions:
                s.cancel()
            _join_through_interrupts([t for t in threads if t.ident is not None])
            raise
    if errors:
        raise errors[0]
    return out  # type: ignore[return-value]


def _join_through_interrupts(threads: list[threading.Thread]) -> None:
    """Wait for ``threads`` to end even through further Ctrl-Cs: the sessions they feed are closed after this,
    and a thread still reading logits then would read freed memory."""
    for t in threads:
        while t.is_alive():
            try:
                t.join(0.1)
            except KeyboardInterrupt:
                pass


def teacher_forced_pass(model: Model, tokens: list[int], policy_name: "str | Policy", budget_cfg: BudgetConfig,
                        chunk: int, flash_attn: bool, n_threads: int | None = None, eval_start: int | None = None,
                        on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                        type_k: str = "f16", type_v: str = "f16") -> PassResult:
    """One pass (:func:`run_passes` of one :class:`PassJob`): feed ``tokens[:-1]`` in chunks of ``chunk``
    through a budgeted session and read the log-probs of positions ``t >= eval_start`` (default
    ``budget_cfg.kv_budget``); chunks before it are decoded without all-row logits. ``policy_name``: a name,
    spec or instance (an instance is used as it is)."""
    job = PassJob(list(tokens), budget_cfg, eval_start, on_chunk)
    _check([job], chunk)
    policy = policy_name if isinstance(policy_name, Policy) else make_policy(policy_name)
    return _alone(model, policy, job, chunk, flash_attn, n_threads, type_k, type_v)


def reference_budget(tokens: list[int]) -> BudgetConfig:
    """The full-cache reference's budget: every token kept, nothing protected (nothing is ever evicted)."""
    return BudgetConfig(kv_budget=len(tokens), n_sink=0, n_recent=0, protect_prompt=False)


def reference_passes(model: Model, traces: list[list[int]], chunk: int, flash_attn: bool, eval_start: int,
                     n_threads: int | None = None, n_parallel: int = 1) -> list[PassResult]:
    """Full-cache references (policy ``none``, ``kv_budget = len(tokens)``, log-probs kept) of ``traces``."""
    jobs = [PassJob(list(t), reference_budget(t), eval_start) for t in traces]
    return run_passes(model, "none", jobs, chunk, flash_attn, n_threads=n_threads, n_parallel=n_parallel)


def reference_pass(model: Model, tokens: list[int], chunk: int, flash_attn: bool, eval_start: int,
                   n_threads: int | None = None) -> PassResult:
    """The full-cache reference of one trace (:func:`reference_passes`)."""
    return reference_passes(model, [tokens], chunk, flash_attn, eval_start, n_threads=n_threads)[0]
