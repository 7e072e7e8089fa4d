"""Calibration on answer accuracy (``calibrate --objective accuracy``): the ΔNLL grid's best EPIKV settings
re-ranked by how many dev problems the model still answers right under a KV budget.

Teacher-forced ΔNLL measures how far a policy moves the next-token distribution on a fixed trace; a user feels
whether the answer is still right. This step takes the default settings and the ``top_k`` best of step 2 (by
ΔNLL), answers ``n_problems`` GSM8K **dev** problems under each (greedy, one chat turn, the prompt counted
against ``kv_budget``: the setting where eviction reaches the question), grades them with
:mod:`.accuracy`, and chooses the settings with the most right answers; a tie keeps the lower ΔNLL, so step 2's
choice stands unless accuracy says otherwise. StreamingLLM is answered too, as the reference a reader compares
with (never a candidate here: step 3 chooses among policies).

Step 3b (:func:`choose_signal_by_accuracy`) does the same for step 3's choice among the policies: the budget cell
that runs at ``kv_budget`` re-ranked on the same problems, StreamingLLM a candidate there and kept on a tie.

Cost: (candidates + 1) x ``n_problems`` answers, about 10 s each for a 0.5B model on 2 cores at 400 tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..api.calibration import nearest_budget, selection_as_run
from ..engine.budget import BudgetConfig
from ..engine.sampling import SamplingConfig
from ..engine.session import Session, SessionConfig
from ..errors import ConfigError, DataError
from ..policies.base import Policy
from ..policies.epikv import EpikvPolicy
from ..policies.streaming import StreamingLLM
from .accuracy import INSTRUCTION, grade


@dataclass(frozen=True)
class AccuracyObjective:
    """What step 4 answers: ``n_problems`` of the ``split == "dev"`` rows of ``problems`` (a GSM8K JSONL with
    ``id``, ``question``, ``answer``, ``split``), at ``kv_budget`` cells with the prompt counted, at most
    ``max_tokens`` generated; the default settings and the ``top_k`` best of step 2 are the candidates."""

    problems: str
    n_problems: int = 16
    kv_budget: int = 192
    max_tokens: int = 400
    top_k: int = 2
    n_sink: int = 4

    def __post_init__(self):
        for name in ("n_problems", "kv_budget", "max_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"accuracy objective: {name} must be an integer >= 1, got {v!r}")


def dev_problems(path: str | Path, n: int) -> list[dict]:
    """The first ``n`` rows of ``path`` whose ``split`` is ``dev`` ({"id", "question", "answer"}); DataError
    when the file is missing, is not JSONL of such rows, or has no dev row (test rows are never used)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"accuracy problems {path} not found")
    out = []
    with path.open(encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise DataError(f"{path}:{k} is not JSON") from None
            if not (isinstance(row, dict) and all(isinstance(row.get(x), str) for x in ("id", "question", "answer"))
                    and "split" in row):
                raise DataError(f"{path}:{k} is not a problem with string id, question, answer and a split")
            if row["split"] == "dev":
                out.append(row)
                if len(out) == n:
                    break
    if not out:
        raise DataError(f"{path} has no dev problem (split == 'dev'): the accuracy objective tunes on dev only")
    return out


def answer_accuracy(model, problems: list[dict], policy: Policy, budget: BudgetConfig, max_tokens: int,
                    n_threads: int | None = None) -> dict:
    """Greedy answers of ``problems`` under ``policy`` and ``budget``, one fresh session each:
    {"correct": [bool per problem], "n_right", "mean_generated" (tokens), "seconds"}."""
    from ..api.chat import apply_chat_template, tokenize_prompt
    from ..api.generation import generate

    t0 = time.perf_counter()
    correct, n_gen = [], []
    for p in problems:
        tokens = tokenize_prompt(model, apply_chat_template(model, f"{p['question']}\n{INSTRUCTION}"))
        with Session(model, policy, budget, SessionConfig(n_threads=n_threads)) as session:
            session.check_prompt(len(tokens))
            result = generate(session, tokens, max_tokens, SamplingConfig(temperature=0.0, seed=0))
        g = grade(result.text, p["answer"], numeric=True, truncated=result.stats.stop_reason == "length")
        correct.append(bool(g.correct))
        n_gen.append(result.stats.n_generated_tokens)
    return {"correct": correct, "n_right": sum(correct), "mean_generated": sum(n_gen) / len(n_gen),
            "seconds": round(time.perf_counter() - t0, 1)}


def choose_by_accuracy(model, grid_rows: list[dict], default_row: dict, objective: AccuracyObjective,
                       n_threads: int | None = None, log: Callable[[str], None] = lambda m: None) -> tuple[dict, dict]:
    """Step 4: (the chosen step-2 row, the record of the step). ``grid_rows``: step 2's results ({layer_a,
    layer_b, window, recent_fraction, delta_nll, ...}); the candidates are ``default_row`` and the ``top_k``
    rows of lowest ΔNLL, tried in ΔNLL order; the most right answers wins, a tie keeps the lower ΔNLL."""
    problems = dev_problems(objective.problems, objective.n_problems)
    ranked = sorted(grid_rows, key=lambda r: r["delta_nll"])
    key = lambda r: (r["layer_a"], r["layer_b"], r["window"], r["recent_fraction"])  # noqa: E731
    cands = list({key(r): r for r in sorted(ranked[:objective.top_k] + [default_row],
                                            key=lambda r: r["delta_nll"])}.values())
    rows = []

    def budget(rf: float) -> BudgetConfig:
        return BudgetConfig(kv_budget=objective.kv_budget, n_sink=objective.n_sink, recent_fraction=rf,
                            protect_prompt=False)

    ref = answer_accuracy(model, problems, StreamingLLM(), budget(default_row["recent_fraction"]),
                          objective.max_tokens, n_threads)
    ref["recent_fraction"] = default_row["recent_fraction"]
    log(f"accuracy: streaming {ref['n_right']}/{len(problems)} at {objective.kv_budget} cells ({ref['seconds']:.0f}s)")
    for r in cands:
        layers = (r["layer_a"],) if r["layer_b"] is None else (r["layer_a"], r["layer_b"])
        acc = answer_accuracy(model, problems, EpikvPolicy(layers=layers, window=r["window"]),
                              budget(r["recent_fraction"]), objective.max_tokens, n_threads)
        rows.append({**{k: r[k] for k in ("layer_a", "layer_b", "window", "recent_fraction", "delta_nll")}, **acc})
        log(f"accuracy: layers {r['layer_a']},{r['layer_b']} window {r['window']} recent {r['recent_fraction']}: "
            f"{acc['n_right']}/{len(problems)} (ΔNLL {r['delta_nll']:+.4f}, {acc['seconds']:.0f}s)")
    best = max(rows, key=lambda x: (x["n_right"], -x["delta_nll"]))
    chosen = next(r for r in cands if key(r) == key(best))
    by_nll = min(grid_rows, key=lambda r: r["delta_nll"])
    record = {"problems": Path(objective.problems).name, "split": "dev", "problem_ids": [p["id"] for p in problems],
              "kv_budget": objective.kv_budget, "prompt": "counted", "max_tokens": objective.max_tokens,
              "top_k": objective.top_k, "streaming": ref, "candidates": rows,
              "chosen": {k: chosen[k] for k in ("layer_a", "layer_b", "window", "recent_fraction")},
              "changed_choice": key(chosen) != key(by_nll),
              "delta_nll_choice": {k: by_nll[k] for k in ("layer_a", "layer_b", "window", "recent_fraction")}}
    return chosen, record


def _ident(c: dict) -> tuple:
    """A step-3 candidate's identity: (policy, settings, recent share)."""
    return c["policy"], json.dumps(c["options"], sort_keys=True), float(c["recent_fraction"])


def candidate_policy(c: dict, stats_dir: Path) -> Policy:
    """The policy of a step-3 candidate or choice as stored (:func:`~epikv_local.api.calibration.selection_as_run`
    with ``stats_dir``); DataError when its query statistics file is not there."""
    from ..policies import make_policy

    sel = selection_as_run(c, Path(stats_dir))
    qs = sel["options"].get("query_stats")
    if qs is not None and not Path(qs).is_file():
        raise DataError(f"query statistics {qs} of step-3 candidate {c['policy']!r} not found")
    return make_policy(sel["policy"], **sel["options"])


def choose_signal_by_accuracy(model, selected: dict, objective: AccuracyObjective, stats_dir: Path,
                              n_threads: int | None = None, log: Callable[[str], None] = lambda m: None,
                              streaming: dict | None = None) -> tuple[dict, dict]:
    """Step 3 re-ranked on answers: (``selected`` with one per-budget choice replaced, the record of the step).

    ``selected``: step 3's result ({"chosen", "by_budget", "candidates", ...}, :func:`.signals.select_policy`);
    the per-budget cell that ``--policy calibrated`` runs at ``objective.kv_budget`` (nearest on a log scale, as
    :meth:`~epikv_local.api.calibration.CalibrationResult.selected_for`) is the one re-ranked, the others keep their
    ΔNLL choice. Candidates: that cell's choice, the ``top_k`` lowest objectives at that budget, and StreamingLLM.
    The most right answers wins; a tie prefers StreamingLLM (a scored policy must answer more than recency does:
    the same guard as step 3's), then the ΔNLL choice, then the lower objective. ``stats_dir``: where a
    ``query_stats`` option's file name is found. ``streaming``: StreamingLLM's answers of the same problems at
    the same budget (step 4's, with their ``recent_fraction``), reused when the recent share is StreamingLLM's
    here."""
    cells = selected.get("by_budget") or []
    if not cells:
        raise DataError("step 3 has no per-budget choice to re-rank on accuracy")
    kv = objective.kv_budget
    near = nearest_budget(kv, [e["kv_budget"] for e in cells])
    cell = next(e for e in cells if e["kv_budget"] == near)
    b = str(cell["kv_budget"])
    ranked = sorted(selected["candidates"], key=lambda c: c["per_budget"][b]["objective"])
    stream = next(c for c in selected["candidates"] if c["policy"] == "streaming")
    pool: list[dict] = []
    for c in [cell] + ranked[:objective.top_k] + [stream]:  # the first of equal identities (the cell's own)
        if all(_ident(c) != _ident(p) for p in pool):
            pool.append(c)
    problems = dev_problems(objective.problems, objective.n_problems)
    rows = []
    for c in pool:
        if (c["policy"] == "streaming" and streaming is not None
                and streaming.get("recent_fraction") == c["recent_fraction"]):
            acc = {**streaming, "reused": "step 4"}  # the same answers: not answered (nor timed) twice
        else:
            acc = answer_accuracy(model, problems, candidate_policy(c, stats_dir),
                                  BudgetConfig(kv_budget=kv, n_sink=objective.n_sink,
                                               recent_fraction=c["recent_fraction"], protect_prompt=False),
                                  objective.max_tokens, n_threads)
        rows.append({"policy": c["policy"], "options": c["options"], "recent_fraction": c["recent_fraction"],
                     "objective": c["per_budget"][b]["objective"] if c is not cell else cell["objective"], **acc})
        log(f"accuracy (signals, {b}-cell choice at {kv} cells): {c['policy']} {c['options']} recent "
            f"{c['recent_fraction']}: {acc['n_right']}/{len(problems)}")
    best = max(rows, key=lambda r: (r["n_right"], r["policy"] == "streaming", _ident(r) == _ident(cell),
                                    -r["objective"]))
    winner = next(c for c in pool if _ident(c) == _ident(best))
    new_cell = cell if winner is cell else {
        "kv_budget": cell["kv_budget"], "policy": winner["policy"], "options": winner["options"],
        "recent_fraction": winner["recent_fraction"],
        **{k: v for k, v in winner["per_budget"][b].items() if k != "per_trace"}}
    new_cell = {**new_cell, "chosen_by": "accuracy"}
    out = {**selected, "by_budget": [new_cell if e is cell else e for e in cells]}
    record = {"problems": Path(objective.problems).name, "split": "dev", "problem_ids": [p["id"] for p in problems],
              "kv_budget": kv, "cell": cell["kv_budget"], "prompt": "counted", "max_tokens": objective.max_tokens,
              "top_k": objective.top_k, "candidates": rows,
              "chosen": {k: winner[k] for k in ("policy", "options", "recent_fraction")},
              "delta_nll_choice": {k: cell[k] for k in ("policy", "options", "recent_fraction")},
              "changed_choice": _ident(winner) != _ident(cell)}
    return out, record
