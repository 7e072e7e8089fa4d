"""Free-generation collapse under KV eviction: does a tight budget make sampled reasoning degenerate?

Teacher forcing (:mod:`.fidelity`) cannot see a policy's errors compounding; here the model generates from
MATH-500 prompts (its own chat template, seeded sampling) under each policy and budget, and under the full cache
(policy ``none``: the baseline), and the outputs are measured for degeneration:

* ``distinct_2`` / ``distinct_3``: unique token n-grams / all token n-grams of the output (1.0 = no repeated
  n-gram; lower = more repetitive). Distinct-n falls with length, so a policy whose outputs stop earlier looks
  more varied: ``distinct_2_prefix`` / ``distinct_3_prefix`` are the same over the first :data:`PREFIX` units
  only (NaN for shorter outputs), comparable across runs;
* ``longest_repeat_share``: the longest run of tokens that occurs at least twice in the output (occurrences may
  overlap), as a share of the output's length (a text stuck in a loop of period p over its last L tokens has a
  share of at least (L - p) / n);
* ``loop`` (0/1) and ``loop_share``: the output ends in a repetition loop, i.e. its tail is periodic with some
  period ``p <= max_period`` tokens over at least ``min_repeats`` periods and ``min_span`` tokens
  (:func:`tail_loop`); ``loop_share`` is that periodic tail's share of the output (0 without a loop);
* ``empty`` (0/1): no non-blank text; ``no_boxed`` (0/1): no ``\\boxed{`` in the text; ``hit_max_tokens``
  (0/1): stopped by the token limit, not by the model (a truncated answer).

Per (policy, budget) each is averaged over prompts with a percentile bootstrap 95% CI (resampling prompts), and
paired with the full cache on the same prompt and seed (policy - none, paired bootstrap CI). The metric
functions take any sequence of hashable units (token ids here; words in the tests). Units: shares in [0, 1],
flags 0/1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Hashable, Iterable, Sequence

import numpy as np

from .longrange import paired_bootstrap_ci, summary_ci

#: appended to each MATH-500 problem (the DeepSeek-R1 evaluation prompt)
PROMPT_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
COLLAPSE_METRICS = ("distinct_2", "distinct_3", "distinct_2_prefix", "distinct_3_prefix", "longest_repeat_share",
                    "loop", "loop_share", "empty", "no_boxed", "hit_max_tokens")
#: units of the length-matched distinct-n
PREFIX = 64
#: loop detection: a periodic tail of period <= MAX_PERIOD tokens, >= MIN_REPEATS periods and >= MIN_SPAN tokens
MAX_PERIOD = 64
MIN_REPEATS = 3
MIN_SPAN = 24
BASELINE = "none"


# -- metrics on one output ----------------------------------------------------------------------------------------
def _codes(units: Sequence[Hashable]) -> np.ndarray:
    """Units -> (n,) int64 codes (equal units, equal codes)."""
    table: dict = {}
    return np.array([table.setdefault(u, len(table)) for u in units], dtype=np.int64)


def distinct_n(units: Sequence[Hashable], n: int) -> float:
    """Unique n-grams / all n-grams of ``units`` (nan when shorter than n)."""
    grams = [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def _longest_true_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    d = np.diff(padded)
    return int((np.flatnonzero(d == -1) - np.flatnonzero(d == 1)).max())


def longest_repeat(units: Sequence[Hashable]) -> int:
    """Length of the longest contiguous run of units that occurs at least twice (overlaps allowed): the longest
    run of equal units between the sequence and itself shifted by d, over all shifts d >= 1. O(n^2) vectorised
    per shift (n = a few thousand at most)."""
    a = _codes(units)
    best = 0
    for d in range(1, len(a)):
        if len(a) - d <= best:
            break
        best = max(best, _longest_true_run(a[d:] == a[:-d]))
    return best


def tail_loop(units: Sequence[Hashable], max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
              min_span: int = MIN_SPAN) -> tuple[int, int]:
    """(period, span) of the longest periodic tail: ``span`` is the length of the longest suffix with
    ``units[i] == units[i - period]`` throughout (plus the first period), for the period that maximises it
    (ties: the shortest). A loop needs ``span >= min_repeats * period`` and ``span >= min_span``; (0, 0) when
    there is none."""
    a = _codes(units)
    n = len(a)
    best = (0, 0)
    for p in range(1, min(max_period, n // max(1, min_repeats)) + 1):
        eq = a[p:] == a[:-p]
        bad = np.flatnonzero(~eq)
        run = len(eq) - (int(bad[-1]) + 1 if len(bad) else 0)  # trailing run of equalities
        span = run + p if run else 0
        if span >= min_repeats * p and span >= min_span and span > best[1]:
            best = (p, span)
    return best


def collapse_metrics(units: Sequence[Hashable], text: str, stop_reason: str, prefix: int = PREFIX) -> dict:
    """The degeneration metrics of one output (see the module docstring): units are its tokens (or words)."""
    n = len(units)
    period, span = tail_loop(units)
    head = units[:prefix] if n >= prefix else []
    return {"n_units": n, "distinct_2": distinct_n(units, 2), "distinct_3": distinct_n(units, 3),
            "distinct_2_prefix": distinct_n(head, 2), "distinct_3_prefix": distinct_n(head, 3),
            "longest_repeat_share": longest_repeat(units) / n if n else float("nan"),
            "loop": float(span > 0), "loop_period": period, "loop_share": span / n if n else 0.0,
            "empty": float(not text.strip()), "no_boxed": float("\\boxed{" not in text),
            "hit_max_tokens": float(stop_reason == "max_tokens")}


# -- aggregation --------------------------------------------------------------------------------------------------
def summarize_collapse(rows: list[dict], metrics: Iterable[str] = COLLAPSE_METRICS, baseline: str = BASELINE,
                       n_resamples: int = 1000, seed: int = 0) -> list[dict]:
    """Per (policy, kv_budget): mean and bootstrap CI over prompts of each metric, and for policies other than
    ``baseline`` the paired difference to the baseline's output on the same prompt (``paired_vs_<baseline>``).
    Rows need ``prompt_id``, ``policy``, ``kv_budget`` (None for the full cache) and the metrics."""
    metrics = tuple(metrics)
    base = {r["prompt_id"]: r for r in rows if r["policy"] == baseline}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["kv_budget"]), []).append(r)
    out = []
    for (policy, budget), rs in groups.items():
        s = {"policy": policy, "kv_budget": budget, "n_prompts": len(rs),
             "mean_generated_tokens": float(np.mean([r["n_generated"] for r in rs])),
             "mean_seconds": float(np.mean([r["seconds"] for r in rs]))}
        for m in metrics:
            s[m] = summary_ci([r.get(m) for r in rs], n_resamples, seed)
        if policy != baseline and base:
            pairs = [(r, base[r["prompt_id"]]) for r in rs if r["prompt_id"] in base]
            s[f"paired_vs_{baseline}"] = {}
            for m in metrics:
                mean, lo, hi, n = paired_bootstrap_ci([r.get(m) for r, _ in pairs], [b.get(m) for _, b in pairs],
                                                      n_resamples, seed)
                s[f"paired_vs_{baseline}"][m] = {"mean": mean, "ci_low": lo, "ci_high": hi, "n_prompts": n}
        out.append(s)
    return out


# -- prompts and generation ---------------------------------------------------------------------------------------
def math_prompt(problem: str) -> str:
    return problem.strip() + PROMPT_SUFFIX


def load_problems(path: str | Path, n: int, skip: int = 0) -> list[dict]:
    """``n`` records of a MATH-500 / AIME JSONL file with a ``problem``, after the first ``skip`` (``id`` from
    ``unique_id``, ``id`` or the line number; ``answer`` when present)."""
    from ..errors import DataError
    from .io import read_jsonl

    out = []
    for i, (lineno, rec) in enumerate(read_jsonl(Path(path), "problem file")):
        if i < skip:
            continue
        if len(out) >= n:
            break
        if not str(rec.get("problem", "")).strip():
            raise DataError(f"{path}:{lineno}: record without a 'problem'")
        pid = rec.get("unique_id", rec.get("id", f"{Path(path).stem}:{lineno}"))
        out.append({"id": str(pid), "problem": rec["problem"], "answer": rec.get("answer")})
    return out


def generate_one(model, prompt_tokens: list[int], policy, kv_budget: int | None, max_tokens: int, seed: int,
                 temperature: float = 0.6, top_p: float = 0.95, n_sink: int = 4, recent_fraction: float = 0.5,
                 chunk: int = 16, n_threads: int | None = None) -> dict:
    """One sampled generation under ``policy`` at ``kv_budget`` (policy ``none``: the full cache, budget = prompt
    + max_tokens; a registered name or a PolicySpec, e.g. a calibration's choice), prompt not protected (a MATH prompt does not fit the tight budgets). Stops at the model's end
    of generation or ``max_tokens``. Returns the text, tokens, stop reason and the session's figures."""
    from ..api.generation import generate
    from ..engine.sampling import SamplingConfig
    from ..engine.budget import BudgetConfig
    from ..engine.session import Session, SessionConfig
    from ..policies import make_policy, policy_spec

    spec = policy_spec(policy)
    full = not spec.cls.evicts
    budget = len(prompt_tokens) + max_tokens + 1 if full else kv_budget
    bcfg = BudgetConfig(kv_budget=budget, n_sink=n_sink, recent_fraction=recent_fraction, protect_prompt=False)
    cfg = SessionConfig(n_batch=chunk, n_threads=n_threads, flash_attn=not spec.cls.needs_attention)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    t0 = time.perf_counter()
    with Session(model, make_policy(policy), bcfg, cfg) as session:
        res = generate(session, prompt_tokens, max_tokens, sampling)
        st = session.stats()
    return {"text": res.text, "tokens": res.tokens, "stop_reason": res.stats.stop_reason,
            "n_generated": len(res.tokens), "n_evicted": st.n_evicted, "max_live": st.max_live,
            "seconds": round(time.perf_counter() - t0, 3),
            "decode_tokens_per_s": round(res.stats.decode_tokens_per_s, 2)}
