"""Teacher-forced fidelity of KV eviction: how far an evicted cache's next-token distribution drifts from the full one.

A trace (problem + reasoning text) is fed to the model in fixed chunks with every row's logits kept
(:func:`teacher_forced_pass`), once with a full cache (policy ``none``, ``kv_budget = len(tokens)``: the
reference) and once per policy x budget. At every position ``t >= kv_budget`` (the cache has had to evict
from then on; the prediction at ``t`` is for token ``t + 1``) the evicted pass is compared with the reference:

* ``nll``: -log p_evicted(token[t+1]); ``nll_ref`` the same under the full cache;
* ``delta_nll`` = nll - nll_ref;
* ``top1_agreement``: argmax of the evicted distribution == argmax of the full one;
* ``kl``: KL(full || evicted) over the vocabulary, nats (clipped at 0 against float rounding).

Per trace these are position means; across traces a mean with a seeded percentile bootstrap 95% CI
(resampling traces). Log-probs are float32 (log-softmax computed in float64 from the float32 logits, then
stored as float32, so identical logits give bit-identical log-probs and exactly zero differences). Memory: only
the reference of the current trace is kept ([n_eval, n_vocab] float32); evicted passes are compared chunk by
chunk as they decode (:class:`StreamingComparison`).

Attention-reading policies (``needs_attention``) need flash attention off; they are compared with a reference
computed with flash attention off as well (:func:`evaluate_trace` groups passes by that setting).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engine.budget import BudgetConfig
from ..engine.handles import Model
from ..engine.session import Session, SessionConfig
from ..errors import ConfigError
from ..policies import Policy, PolicySpec, make_policy, policy_spec
from .stats import bootstrap_ci, log_softmax

METRICS = ("nll", "nll_ref", "delta_nll", "top1_agreement", "kl")


# -- log-probs and metrics ----------------------------------------------------------------------------------------
def position_metrics(ref_logp: np.ndarray, ev_logp: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per-position metrics of evicted vs full log-probs, both (N, V); targets (N,) the true next tokens.

    Returns float64 arrays (N,) keyed by :data:`METRICS` (``top1_agreement`` as 0.0/1.0).
    """
    ref = np.asarray(ref_logp, dtype=np.float64)
    ev = np.asarray(ev_logp, dtype=np.float64)
    if ref.shape != ev.shape or ref.ndim != 2:
        raise ValueError(f"log-prob arrays must be equal (N, V) shapes, got {ref.shape} and {ev.shape}")
    targets = np.asarray(targets, dtype=np.int64)
    if targets.shape != (ref.shape[0],):
        raise ValueError(f"targets must be ({ref.shape[0]},), got {targets.shape}")
    rows = np.arange(len(targets))
    nll_ref = -ref[rows, targets]
    nll = -ev[rows, targets]
    agree = (ref.argmax(axis=1) == ev.argmax(axis=1)).astype(np.float64)
    kl = np.maximum((np.exp(ref) * (ref - ev)).sum(axis=1), 0.0)
    return {"nll": nll, "nll_ref": nll_ref, "delta_nll": nll - nll_ref, "top1_agreement": agree, "kl": kl}


class StreamingComparison:
    """Accumulates per-position metric sums of one evicted pass against a stored reference, chunk by chunk.

    ref_logp: (R, V) float32 reference log-probs of positions ``ref_start .. ref_start + R - 1``.
    tokens: the trace (targets are ``tokens[t + 1]``).
    """

    def __init__(self, ref_logp: np.ndarray, ref_start: int, tokens: list[int] | np.ndarray):
        self.ref = ref_logp
        self.ref_start = ref_start
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.sums = {k: 0.0 for k in METRICS}
        self.n = 0

    def __call__(self, positions: np.ndarray, logp: np.ndarray) -> None:
        rows = positions - self.ref_start
        if len(rows) and (rows[0] < 0 or rows[-1] >= len(self.ref)):
            raise ConfigError(f"positions {positions[0]}..{positions[-1]} are outside the reference")
        m = position_metrics(self.ref[rows], logp, self.tokens[positions + 1])
        for k in METRICS:
            self.sums[k] += float(m[k].sum())
        self.n += len(positions)

    def means(self) -> dict[str, float]:
        if self.n == 0:
            return {k: float("nan") for k in METRICS}
        return {k: self.sums[k] / self.n for k in METRICS}


# -- passes ---------------------------------------------------------------------------------------------------------
@dataclass
class PassResult:
    """One teacher-forced pass. logp: (n_eval, V) float32 of positions ``eval_start ..`` or None if streamed."""

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
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def teacher_forced_pass(model: Model, tokens: list[int], policy_name: str | Policy, budget_cfg: BudgetConfig, chunk: int,
                        flash_attn: bool, n_threads: int | None = None, eval_start: int | None = None,
                        on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                        type_k: str = "f16", type_v: str = "f16") -> PassResult:
    """Feed ``tokens[:-1]`` in chunks of ``chunk`` through a budgeted session and read the log-probs.

    type_k / type_v: KV cache element types of this pass (quantized caches compared with an f16 reference).

    Positions ``t >= eval_start`` (default ``budget_cfg.kv_budget``) are evaluated; the last token is never
    decoded (it has no target). Chunks before ``eval_start`` are decoded without all-row logits. With
    ``on_chunk`` each evaluated chunk's ``(positions, logp (k, V) float32)`` is handed over and nothing is
    kept; without it the log-probs are returned in ``PassResult.logp`` ((n_eval, V) float32).
    """
    if len(tokens) < 2:
        raise ConfigError("a trace needs at least 2 tokens")
    if chunk < 1:
        raise ConfigError(f"chunk must be >= 1, got {chunk}")
    start = budget_cfg.kv_budget if eval_start is None else eval_start
    n_in = len(tokens) - 1
    n_eval = max(0, n_in - start)
    policy = policy_name if isinstance(policy_name, Policy) else make_policy(policy_name)
    policy_name = policy.name
    cfg = SessionConfig(n_batch=chunk, n_threads=n_threads, flash_attn=flash_attn, verify_flash_attn=True,
                        type_k=type_k, type_v=type_v)
    n_vocab = model.info.n_vocab
    out = None if on_chunk is not None else np.empty((n_eval, n_vocab), dtype=np.float32)
    t0 = time.perf_counter()
    with Session(model, policy, budget_cfg, cfg) as session:
        buf = np.empty((chunk, n_vocab), dtype=np.float32)
        for i in range(0, n_in, chunk):
            part = tokens[i:min(i + chunk, n_in)]
            k = len(part)
            want = i + k > start
            session.decode_chunk(part, logits_all=want, logits_last=True)
            if not want:
                continue
            j0 = max(0, start - i)  # first evaluated row of this chunk
            for j in range(j0, k):
                buf[j - j0] = session.logits(j)
            logp = log_softmax(buf[: k - j0])
            positions = np.arange(i + j0, i + k, dtype=np.int64)
            if on_chunk is not None:
                on_chunk(positions, logp)
            else:
                out[i + j0 - start: i + k - start] = logp
        st = session.stats()
        res = PassResult(policy=policy_name, kv_budget=budget_cfg.kv_budget, flash_attn=bool(flash_attn),
                         eval_start=start, n_eval=n_eval, seconds=time.perf_counter() - t0,
                         decode_seconds=st.decode_seconds, n_evicted=st.n_evicted,
                         max_live=st.max_live, logp=out, kv_bytes=st.kv_bytes,
                         positions=np.arange(start, start + n_eval, dtype=np.int64))
    return res


def reference_pass(model: Model, tokens: list[int], chunk: int, flash_attn: bool, eval_start: int,
                   n_threads: int | None = None) -> PassResult:
    """The full-cache reference: policy ``none`` with ``kv_budget = len(tokens)``, log-probs kept."""
    budget = BudgetConfig(kv_budget=len(tokens), n_sink=0, n_recent=0, protect_prompt=False)
    return teacher_forced_pass(model, tokens, "none", budget, chunk, flash_attn, n_threads=n_threads,
                               eval_start=eval_start)


def compare_pass(model: Model, tokens: list[int], ref: PassResult, policy_name: "str | PolicySpec",
                 budget_cfg: BudgetConfig,
                 chunk: int, n_threads: int | None = None, eval_start: int | None = None, type_k: str = "f16",
                 type_v: str = "f16") -> dict:
    """Run one evicted pass streamed against ``ref`` (same chunk and flash-attention setting); per-trace row."""
    start = budget_cfg.kv_budget if eval_start is None else eval_start
    if start < ref.eval_start:
        raise ConfigError(f"reference starts at {ref.eval_start}, after the evaluated start {start}")
    cmp = StreamingComparison(ref.logp, ref.eval_start, tokens)
    res = teacher_forced_pass(model, tokens, policy_name, budget_cfg, chunk, ref.flash_attn, n_threads=n_threads,
                              eval_start=start, on_chunk=cmp, type_k=type_k, type_v=type_v)
    row = {"policy": policy_spec(policy_name).name, "kv_budget": budget_cfg.kv_budget, "flash_attn": ref.flash_attn,
           "n_tokens": len(tokens), "eval_start": start, "n_eval": cmp.n, "type_k": type_k, "type_v": type_v,
           "kv_bytes": res.kv_bytes}
    row.update(cmp.means())
    row.update({"n_evicted": res.n_evicted, "max_live": res.max_live, "seconds": round(res.seconds, 3),
                "decode_seconds": round(res.decode_seconds, 3), "ref_seconds": round(ref.seconds, 3)})
    return row


def evaluate_trace(model: Model, tokens: list[int], policies: "list[str | PolicySpec]", budgets: list[int],
                   chunk: int = 16,
                   n_sink: int = 4, recent_fraction: float = 0.5, flash_attn: bool = True,
                   n_threads: int | None = None,
                   progress: Callable[[str], None] | None = None) -> list[dict]:
    """All policy x budget rows of one trace (budgets >= len(tokens) - 1 evaluate nothing and are skipped).

    Policies that read attention run with flash attention off against a flash-off reference; the others use
    ``flash_attn``. Only one reference is held at a time (grouped by flash-attention setting).
    """
    budgets = [b for b in budgets if b < len(tokens) - 1]
    if not budgets or not policies:
        return []
    groups: dict[bool, list[str]] = {}
    for name in policies:
        fa = flash_attn and not policy_spec(name).cls.needs_attention
        groups.setdefault(fa, []).append(name)
    rows = []
    for fa in sorted(groups, reverse=True):
        ref = reference_pass(model, tokens, chunk, fa, eval_start=min(budgets), n_threads=n_threads)
        if progress:
            progress(f"reference (flash_attn={fa}): {ref.seconds:.1f}s")
        for name in groups[fa]:
            for b in budgets:
                budget = BudgetConfig(kv_budget=b, n_sink=n_sink, recent_fraction=recent_fraction,
                                      protect_prompt=False)
                row = compare_pass(model, tokens, ref, name, budget, chunk, n_threads=n_threads)
                row.update({"chunk": chunk, "n_sink": n_sink, "n_recent": budget.recent,
                            "recent_fraction": recent_fraction})
                rows.append(row)
                if progress:
                    progress(f"{policy_spec(name).name} @ {b}: dNLL={row['delta_nll']:+.4f} top1={row['top1_agreement']:.3f} "
                             f"KL={row['kl']:.4f} ({row['seconds']:.1f}s)")
        del ref
    return rows


def summarize(rows: list[dict], n_resamples: int = 1000, seed: int = 0) -> list[dict]:
    """Per policy x budget: mean and bootstrap CI (over traces) of each metric, plus n_traces and timing."""
    keys: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        keys.setdefault((r["policy"], r["kv_budget"]), []).append(r)
    out = []
    for (policy, budget), rs in keys.items():
        s = {"policy": policy, "kv_budget": budget, "flash_attn": rs[0]["flash_attn"], "n_traces": len(rs),
             "n_eval_positions": int(sum(r["n_eval"] for r in rs))}
        for k in METRICS:
            mean, lo, hi = bootstrap_ci([r[k] for r in rs], n_resamples=n_resamples, seed=seed)
            s[k] = {"mean": mean, "ci_low": lo, "ci_high": hi}
        s["seconds_per_pass"] = float(np.mean([r["seconds"] for r in rs]))
        out.append(s)
    return out
