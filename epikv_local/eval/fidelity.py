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

Long-range metrics (:mod:`.longrange`, docs/longrange.md), added beside the all-token ones without changing
them: ``key_*`` restricted to the trace's key positions (positions whose NLL under a fresh local window of
:data:`~.longrange.KEY_WINDOW` tokens exceeds the full-cache NLL by more than the threshold; one extra
:func:`local_window_nll` pass per trace), ``answer_*`` restricted to the positions predicting the gold answer
appended after the trace (:func:`answer_suffix`), each with its count (``n_key``, ``n_answer``). The all-token
metrics stay averaged over the trace's own positions ``kv_budget <= t < n_tokens - 1`` (as before, so old and new
results compare); the appended answer only adds positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..engine.budget import BudgetConfig
from ..engine.handles import Context, Model
from ..errors import ConfigError
from ..policies import Policy, PolicySpec, policy_spec
from . import longrange as lr
from .passes import PassJob, PassResult, reference_pass, run_passes, teacher_forced_pass  # noqa: F401 - re-exported
from .stats import bootstrap_ci, nll_rows

METRICS = ("nll", "nll_ref", "delta_nll", "top1_agreement", "kl")
#: per-position arrays kept by StreamingComparison (``top1_agreement`` and ``kl`` as in METRICS)
PER_POSITION = ("nll", "nll_ref", "delta_nll", "top1_agreement", "kl")


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
    limit: the all-token means (:meth:`means`) cover positions ``t < limit`` only (default: all); later positions
        (an appended answer) are still compared and kept per position.

    The per-position metrics are kept too ((R,) float64 each, NaN where not compared), for restricted means
    (:meth:`restricted`).
    """

    def __init__(self, ref_logp: np.ndarray, ref_start: int, tokens: list[int] | np.ndarray, limit: int | None = None):
        self.ref = ref_logp
        self.ref_start = ref_start
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.limit = limit
        self.sums = {k: 0.0 for k in METRICS}
        self.n = 0
        self.per_position = {k: np.full(len(ref_logp), np.nan) for k in PER_POSITION}

    def __call__(self, positions: np.ndarray, logp: np.ndarray) -> None:
        rows = positions - self.ref_start
        if len(rows) and (rows[0] < 0 or rows[-1] >= len(self.ref)):
            raise ConfigError(f"positions {positions[0]}..{positions[-1]} are outside the reference")
        m = position_metrics(self.ref[rows], logp, self.tokens[positions + 1])
        for k in PER_POSITION:
            self.per_position[k][rows] = m[k]
        keep = slice(None) if self.limit is None else positions < self.limit
        for k in METRICS:
            self.sums[k] += float(m[k][keep].sum())
        self.n += len(positions) if self.limit is None else int(np.count_nonzero(keep))

    def means(self) -> dict[str, float]:
        if self.n == 0:
            return {k: float("nan") for k in METRICS}
        return {k: self.sums[k] / self.n for k in METRICS}

    def arrays(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """Per-position metrics at absolute ``positions`` (M,) -> {metric: (M,) float64} (NaN: not compared)."""
        rows = np.asarray(positions, dtype=np.int64) - self.ref_start
        return {k: v[rows] for k, v in self.per_position.items()}

    def restricted(self, positions: np.ndarray, prefix: str) -> dict:
        """Means of the metrics over the compared positions among ``positions`` (absolute), keyed
        ``prefix + metric``, with their count ``n_`` + prefix without its underscore (NaN means when none)."""
        a = self.arrays(positions)
        seen = ~np.isnan(a["nll"])
        out = {f"n_{prefix.rstrip('_')}": int(seen.sum())}
        out.update(lr.masked_means(a, seen, prefix))
        return out


def local_window_nll(model: Model, tokens: list[int], window: int, eval_start: int, eval_end: int | None = None,
                     stride: int | None = None, flash_attn: bool = True, n_threads: int | None = None,
                     n_batch: int | None = None) -> np.ndarray:
    """NLL (nats, (eval_end - eval_start,) float64) of ``tokens[t + 1]`` given only a fresh local window, for
    ``eval_start <= t < eval_end`` (default: to the last predicting position ``len(tokens) - 2``).

    Blocks of ``stride`` positions (default ``window * longrange.WINDOW_STRIDE_FRACTION``) are decoded in an
    emptied context from ``max(0, s - window + 1)`` at positions 0, 1, ... (a truncated text, as LongPPL's short
    contexts): position ``t`` sees between ``window`` and ``window + stride - 1`` tokens (all of the prefix when
    ``t < window``). Cost: about ``(window + stride) / stride`` decoded tokens per evaluated position, logits only
    for the evaluated rows. Decodes use batches of up to ``n_batch`` tokens (default: one block, at most 512), so
    logits are not bit-identical to a chunk-16 pass (irrelevant next to the threshold).
    """
    n_in = len(tokens) - 1
    eval_end = n_in if eval_end is None else min(eval_end, n_in)
    stride = lr.window_stride(window) if stride is None else stride
    blocks = lr.window_blocks(eval_start, eval_end, window, stride)
    out = np.empty(max(0, eval_end - eval_start), dtype=np.float64)
    if not blocks:
        return out
    longest = max(e - a for a, _, e in blocks)
    n_batch = min(longest, 512) if n_batch is None else n_batch
    toks = np.asarray(tokens, dtype=np.int64)
    with Context(model, n_ctx=longest, n_batch=n_batch, flash_attn=flash_attn, n_threads=n_threads) as ctx:
        n_vocab = model.info.n_vocab
        buf = np.empty((n_batch, n_vocab), dtype=np.float32)
        for a, s, e in blocks:
            ctx.clear()
            first = s - a  # first row read: chunks that reach it have every row's logits
            for pos in ctx.prefill_chunks(toks[a:e], chunk=int(n_batch), logits_from=first):
                i, j = int(pos[0]), int(pos[-1]) + 1
                if j <= first:
                    continue
                r0 = max(i, first)
                for r in range(r0, j):
                    buf[r - r0] = ctx.logits(r - i)
                out[a + r0 - eval_start:a + j - eval_start] = nll_rows(buf[:j - r0], toks[a + r0 + 1:a + j + 1])
    return out


@dataclass(frozen=True)
class AnswerSuffix:
    """Tokens appended after a trace (``longrange.ANSWER_HEAD + answer + ANSWER_TAIL``, each part tokenized on
    its own, no special tokens); ``n_head``/``n_answer``: tokens of the head and of the answer itself."""

    tokens: list[int]
    n_head: int
    n_answer: int
    text: str

    def positions(self, n_trace: int) -> np.ndarray:
        """Absolute positions predicting the answer's tokens after a trace of ``n_trace`` tokens."""
        return lr.answer_positions(n_trace, self.n_head, self.n_answer)


def answer_suffix(model: Model, answer) -> AnswerSuffix:
    head, body, tail = lr.answer_parts(answer)
    th, tb, tt = (model.tokenize(x, add_special=False, parse_special=False) for x in (head, body, tail))
    if not tb:
        raise ConfigError(f"the answer {answer!r} has no tokens")
    return AnswerSuffix(th + tb + tt, len(th), len(tb), head + body + tail)


@dataclass
class TraceSpans:
    """What a pass over ``trace + suffix`` is scored on besides all tokens. n_trace: tokens of the trace (the
    all-token metrics cover positions ``t < n_trace - 1``); key_positions / answer_positions: absolute positions
    (None: not computed); key_window / key_threshold: the key-token setting (recorded in rows)."""

    n_trace: int
    key_positions: np.ndarray | None = None
    answer_positions: np.ndarray | None = None
    key_window: int | None = None
    key_threshold: float | None = None
    window_seconds: float | None = None

    def fields(self, cmp: StreamingComparison, start: int) -> dict:
        out: dict = {}
        if self.key_positions is not None:
            kp = self.key_positions[self.key_positions >= start]
            n_eval = max(0, self.n_trace - 1 - start)
            out.update({"key_window": self.key_window, "key_threshold": self.key_threshold,
                        "key_fraction": len(kp) / n_eval if n_eval else None})
            out.update(cmp.restricted(kp, "key_"))
            if self.window_seconds is not None:
                out["key_window_seconds"] = round(self.window_seconds, 3)
        if self.answer_positions is not None:
            ap = self.answer_positions[self.answer_positions >= start]
            out.update(cmp.restricted(ap, "answer_"))
            out["answer_tokens"] = len(self.answer_positions)
        return lr.none_if_nan(out)


def key_positions_of(ref: PassResult, tokens: list[int], window_nll: np.ndarray, threshold: float,
                     n_trace: int) -> np.ndarray:
    """Absolute key positions among ``ref.eval_start <= t < n_trace - 1``: full-cache NLL (from ``ref``) vs the
    local-window NLL ``window_nll`` ((n_trace - 1 - ref.eval_start,), same positions)."""
    pos = np.arange(ref.eval_start, n_trace - 1, dtype=np.int64)
    if window_nll.shape != pos.shape:
        raise ConfigError(f"window NLL has {window_nll.shape[0]} positions, expected {len(pos)}")
    targets = np.asarray(tokens, dtype=np.int64)[pos + 1]
    nll_full = -ref.logp[pos - ref.eval_start, targets].astype(np.float64)
    return pos[lr.key_token_mask(nll_full, window_nll, threshold)]


@dataclass
class CompareJob:
    """One evicted pass to compare with its trace's full-cache reference ``ref`` (same chunk and flash-attention
    setting). spans: with an appended answer, ``tokens`` is trace + suffix and ``spans.n_trace`` the trace's
    length (the all-token metrics and ``n_tokens`` stay the trace's); adds the key-token and answer-span
    fields. eval_start: default ``budget.kv_budget``."""

    tokens: list[int]
    ref: PassResult
    budget: BudgetConfig
    spans: TraceSpans | None = None
    eval_start: int | None = None


def compare_passes(model: Model, policy_name: "str | PolicySpec | Policy", jobs: list[CompareJob], chunk: int,
                   n_threads: int | None = None, type_k: str = "f16", type_v: str = "f16",
                   keep_positions: bool = False, n_parallel: int = 1) -> list[dict]:
    """Run the evicted passes of ``jobs`` (one policy configuration, each pass a fresh instance), each streamed
    against its reference; one per-trace row per job, in order.

    n_parallel: passes decoded together as sequences of one context (:func:`.passes.run_passes`); the jobs must
    then share one flash-attention setting. keep_positions: add ``_per_position`` ({"positions", metric: (M,)}
    over the trace's evaluated positions; not JSON: callers pop it).
    """
    if not jobs:
        return []
    fa = {j.ref.flash_attn for j in jobs}
    if len(fa) > 1:
        raise ConfigError("the passes compared together need references of one flash-attention setting")
    pass_jobs, cmps = [], []
    for j in jobs:
        start = j.budget.kv_budget if j.eval_start is None else j.eval_start
        if start < j.ref.eval_start:
            raise ConfigError(f"reference starts at {j.ref.eval_start}, after the evaluated start {start}")
        n_trace = len(j.tokens) if j.spans is None else j.spans.n_trace
        cmp = StreamingComparison(j.ref.logp, j.ref.eval_start, j.tokens, limit=n_trace - 1)
        cmps.append(cmp)
        pass_jobs.append(PassJob(list(j.tokens), j.budget, start, on_chunk=cmp))
    results = run_passes(model, policy_name, pass_jobs, chunk, fa.pop(), n_threads=n_threads,
                         n_parallel=n_parallel, type_k=type_k, type_v=type_v)
    name = policy_name.name if isinstance(policy_name, Policy) else policy_spec(policy_name).name
    return [_row(name, j, pj.start, cmp, res, type_k, type_v, keep_positions)
            for j, pj, cmp, res in zip(jobs, pass_jobs, cmps, results)]


def _row(name: str, job: CompareJob, start: int, cmp: StreamingComparison, res: PassResult, type_k: str,
         type_v: str, keep_positions: bool) -> dict:
    n_trace = len(job.tokens) if job.spans is None else job.spans.n_trace
    row = {"policy": name, "kv_budget": job.budget.kv_budget, "flash_attn": job.ref.flash_attn,
           "n_tokens": n_trace, "eval_start": start, "n_eval": cmp.n, "type_k": type_k, "type_v": type_v,
           "kv_bytes": res.kv_bytes}
    row.update(cmp.means())
    row.update({"n_evicted": res.n_evicted, "max_live": res.max_live, "seconds": round(res.seconds, 3),
                "decode_seconds": round(res.decode_seconds, 3), "ref_seconds": round(job.ref.seconds, 3)})
    if job.spans is not None:
        row.update(job.spans.fields(cmp, start))
    if keep_positions:
        pos = np.arange(start, n_trace - 1, dtype=np.int64)
        row["_per_position"] = {"positions": pos, **cmp.arrays(pos)}
    return row


def compare_pass(model: Model, tokens: list[int], ref: PassResult, policy_name: "str | PolicySpec",
                 budget_cfg: BudgetConfig,
                 chunk: int, n_threads: int | None = None, eval_start: int | None = None, type_k: str = "f16",
                 type_v: str = "f16", spans: TraceSpans | None = None, keep_positions: bool = False) -> dict:
    """One evicted pass streamed against ``ref``: :func:`compare_passes` of one :class:`CompareJob`."""
    return compare_passes(model, policy_name, [CompareJob(tokens, ref, budget_cfg, spans, eval_start)], chunk,
                          n_threads=n_threads, type_k=type_k, type_v=type_v, keep_positions=keep_positions)[0]


def evaluate_trace(model: Model, tokens: list[int], policies: "list[str | PolicySpec]", budgets: list[int],
                   chunk: int = 16,
                   n_sink: int = 4, recent_fraction: float = 0.5, flash_attn: bool = True,
                   n_threads: int | None = None,
                   progress: Callable[[str], None] | None = None, answer=None,
                   key_window: int | None = lr.KEY_WINDOW, key_threshold: float = lr.KEY_THRESHOLD,
                   window_nll: np.ndarray | None = None, keep_positions: bool = False,
                   runs: "list[tuple[str | PolicySpec, int, float]] | None" = None,
                   n_parallel: int = 1) -> list[dict]:
    """All policy x budget rows of one trace (budgets >= len(tokens) - 1 evaluate nothing and are skipped).

    runs: an explicit plan of (policy, budget, recent share) instead of ``policies`` x ``budgets`` at
    ``recent_fraction`` (e.g. a calibration whose choice depends on the budget); the references are shared.

    Policies that read attention run with flash attention off against a flash-off reference; the others use
    ``flash_attn``. Only one reference is held at a time (grouped by flash-attention setting).

    answer: the gold answer (text); when given, :func:`answer_suffix` is appended after ``tokens`` and the rows
    get the ``answer_*`` fields. key_window (None or 0: no key tokens) / key_threshold: the key-token setting;
    the local-window pass runs once, with the first reference's flash-attention setting, and its mask (from
    that reference) serves every pass. window_nll: that pass's result when already computed
    ((len(tokens) - 1 - min(budgets),) positions ``min(budgets) ..``). keep_positions: see :func:`compare_passes`.
    n_parallel: one policy's budgets decoded together as sequences of one context (:func:`compare_passes`).
    """
    if runs is None:
        runs = [(name, b, recent_fraction) for name in policies for b in budgets]
    runs = [r for r in runs if r[1] < len(tokens) - 1]
    if not runs:
        return []
    budgets = sorted({b for _, b, _ in runs})
    groups: dict[bool, list[tuple]] = {}
    for run in runs:
        fa = flash_attn and not policy_spec(run[0]).cls.needs_attention
        groups.setdefault(fa, []).append(run)
    n_trace = len(tokens)
    suffix = answer_suffix(model, answer) if answer is not None else None
    full = list(tokens) + (suffix.tokens if suffix else [])
    spans = TraceSpans(n_trace, answer_positions=suffix.positions(n_trace) if suffix else None)
    rows = []
    for fa in sorted(groups, reverse=True):
        ref = reference_pass(model, full, chunk, fa, eval_start=min(budgets), n_threads=n_threads)
        if progress:
            progress(f"reference (flash_attn={fa}): {ref.seconds:.1f}s")
        if key_window and spans.key_positions is None:
            t0 = time.perf_counter()
            if window_nll is None:
                window_nll = local_window_nll(model, tokens, key_window, ref.eval_start, n_trace - 1,
                                              flash_attn=fa, n_threads=n_threads)
            spans.key_positions = key_positions_of(ref, full, window_nll, key_threshold, n_trace)
            spans.key_window, spans.key_threshold = key_window, key_threshold
            spans.window_seconds = time.perf_counter() - t0
            if progress:
                progress(f"local window {key_window}: {len(spans.key_positions)} key positions of "
                         f"{n_trace - 1 - ref.eval_start} ({spans.window_seconds:.1f}s)")
        # one policy setting's runs decode together (grouped by the whole spec: a plan may give one name other
        # classes or options per budget, as the calibrated choice does); rows keep the plan's order
        by_policy: list[tuple[PolicySpec, list[int]]] = []
        for i, run in enumerate(groups[fa]):
            spec = policy_spec(run[0])
            same = next((idx for sp, idx in by_policy if sp == spec), None)
            if same is None:
                by_policy.append((spec, [i]))
            else:
                same.append(i)
        got: dict[int, dict] = {}
        for _, idx in by_policy:
            plan = [groups[fa][i] for i in idx]
            cfgs = [BudgetConfig(kv_budget=b, n_sink=n_sink, recent_fraction=rf, protect_prompt=False)
                    for _, b, rf in plan]
            out = compare_passes(model, plan[0][0], [CompareJob(full, ref, bc, spans) for bc in cfgs], chunk,
                                 n_threads=n_threads, keep_positions=keep_positions, n_parallel=n_parallel)
            for i, (name, b, rf), bc, row in zip(idx, plan, cfgs, out):
                row.update({"chunk": chunk, "n_sink": n_sink, "n_recent": bc.recent_window, "recent_fraction": rf})
                got[i] = row
                if progress:
                    extra = "".join(f" {lab}={row[k]:+.4f}" for lab, k in (("key", "key_delta_nll"),
                                                                           ("ans", "answer_delta_nll"))
                                    if row.get(k) is not None)
                    progress(f"{policy_spec(name).name} @ {b}: dNLL={row['delta_nll']:+.4f} "
                             f"top1={row['top1_agreement']:.3f} KL={row['kl']:.4f}{extra} ({row['seconds']:.1f}s)")
        rows.extend(got[i] for i in range(len(groups[fa])))
        del ref
    return rows


def summarize(rows: list[dict], n_resamples: int = 1000, seed: int = 0, baseline: str | None = "streaming") -> list[dict]:
    """Per policy x budget: mean and bootstrap CI (over traces) of each metric, plus n_traces and timing.

    The long-range metrics (``key_*``, ``answer_*``), when the rows have them, get the same with their own
    ``n_traces`` (traces without key tokens / answer are left out), plus ``n_key_positions``,
    ``n_answer_positions`` and the mean ``key_fraction``. With ``baseline`` among the policies and rows carrying
    ``trace_id``, every other policy gets ``paired_vs_<baseline>``: per metric the paired per-trace difference
    (policy - baseline, same trace and budget) with a bootstrap CI over traces.
    """
    keys: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        keys.setdefault((r["policy"], r["kv_budget"]), []).append(r)
    paired = lr.paired_summary(rows, baseline, n_resamples=n_resamples, seed=seed) if baseline else {}
    out = []
    for (policy, budget), rs in keys.items():
        s = {"policy": policy, "kv_budget": budget, "flash_attn": rs[0]["flash_attn"], "n_traces": len(rs),
             "n_eval_positions": int(sum(r["n_eval"] for r in rs))}
        for k in METRICS:
            mean, lo, hi = bootstrap_ci([r[k] for r in rs], n_resamples=n_resamples, seed=seed)
            s[k] = {"mean": mean, "ci_low": lo, "ci_high": hi}
        s["seconds_per_pass"] = float(np.mean([r["seconds"] for r in rs]))
        if any("n_key" in r for r in rs):
            s["n_key_positions"] = int(sum(r.get("n_key") or 0 for r in rs))
            s["key_fraction"] = lr.summary_ci([r.get("key_fraction") for r in rs], n_resamples, seed)
            s["key_window"], s["key_threshold"] = rs[0].get("key_window"), rs[0].get("key_threshold")
        if any("n_answer" in r for r in rs):
            s["n_answer_positions"] = int(sum(r.get("n_answer") or 0 for r in rs))
        for k in lr.KEY_METRICS + lr.ANSWER_METRICS:
            if any(k in r for r in rs):
                s[k] = lr.summary_ci([r.get(k) for r in rs], n_resamples, seed)
        if (policy, budget) in paired:
            s[f"paired_vs_{baseline}"] = paired[(policy, budget)]
        out.append(s)
    return out
