"""Per-model calibration of EPIKV: layers A/B (or single band), rolling window and recent share.

Procedure (dev traces only; see docs/calibration.md, section "Calibration"):

1. counterfactual labels on the dev traces (:mod:`.labels`) and the layer anatomy
   (:mod:`.anatomy`, g of every layer, no keys or attention) rank the layers by the Spearman
   correlation of ``z_l`` with the label: the top-3 are band-A candidates, the bottom-3 band-B candidates;
2. a pruned grid, searched coordinate-wise, minimising the mean teacher-forced fidelity ΔNLL over the dev
   traces x budgets (128, 256): (a) layers: the default pair, the 3 x 3 A x B pairs and the 3 single-band A
   (window 128, recent share 0.5); (b) window {64, 128, 256} at the best layers; (c) recent share
   {0.25, 0.5, 0.75} at the best layers and window. ``full_grid=True`` searches the Cartesian product instead.
3. (``signals=True``) pre-RoPE query statistics of the dev traces for TriAttention, then the choice among the
   signals (:mod:`.signals`): streaming, EPIKV as chosen in 2, key-based rivals and EPIKV-mix, by the mean of
   all-token and key-token ΔNLL, overall and per budget (``Grid.signal_budgets`` on traces of
   ``Grid.signal_max_tokens``: 128-1024 on 1,536 tokens by default, step 2's in the fast profile); what
   ``--policy calibrated`` runs.
4. (``accuracy=AccuracyObjective(...)``, ``calibrate --objective accuracy``; run between 2 and 3) the default and
   the best settings of 2 re-ranked by right answers on GSM8K dev problems under a budget, the prompt counted
   (:mod:`.calibrate_accuracy`); the most right answers wins, a tie the lower ΔNLL. The JSON says which
   objective chose (``objective``: ``delta_nll`` or ``accuracy``) and whether accuracy changed the choice.
   With step 3, its choice for the budget cell that runs at the accuracy budget is re-ranked the same way
   (``accuracy_signals``; a tie keeps StreamingLLM). :func:`calibrate_on_accuracy` applies both to a finished
   ΔNLL calibration (``calibrate --objective accuracy --from FILE``) without rerunning steps 1-3.

The result is written as JSON to ``<cache>/calibration/<sha256 of the model file>.json`` (cache dir:
``$EPIKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/epikv-local`` or ``~/.cache/epikv-local``) and read back by
:func:`epikv_local.api.calibration.load_for_model`. Layers are stored as
this model's own indices (``ref_depth = n_layer``), so only those two layers are captured at run time.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..api.calibration import (
    CALIBRATION_VERSION,
    CalibrationResult,
    calibration_dir,
    load_file,
    model_sha256,
)
from ..engine.budget import DEFAULT_RECENT_FRACTION, BudgetConfig
from ..engine.handles import Model
from ..errors import ConfigError, DataError
from ..policies.epikv import EpikvPolicy
from ..policies.scoring import ScoringConfig
from .anatomy import capture_pass, layer_z, rank_layers
from .calibrate_accuracy import AccuracyObjective, choose_by_accuracy, choose_signal_by_accuracy
from .io import write_atomic
from .fidelity import StreamingComparison
from .passes import PassJob, reference_passes, run_passes
from .labels import LabelSettings, label_trace, labels_by_trace, read_labels, run_labels
from .progress import progress_bar
from .provenance import portable
from .signals import collect_query_stats, select_policy
from .stats import signal_stats
from .traces import load_traces

# -- fidelity of one configuration ------------------------------------------------------------------------------
def policy_delta_nlls(model, jobs: list[tuple[list[int], object, BudgetConfig]], cfg: ScoringConfig, chunk: int,
                      n_threads: int | None = None, n_parallel: int = 1) -> list[float]:
    """Mean ΔNLL (positions t >= kv_budget) of an EPIKV pass with ``cfg`` for each (tokens, reference, budget) of
    ``jobs``, in order; ``n_parallel`` passes decoded together (:func:`.passes.run_passes`)."""
    layers = (cfg.layer_a,) if cfg.layer_b is None else (cfg.layer_a, cfg.layer_b)
    cmps = [StreamingComparison(ref.logp, ref.eval_start, toks) for toks, ref, _ in jobs]
    run_passes(model, EpikvPolicy(layers=layers, window=cfg.window),
               [PassJob(toks, b, b.kv_budget, on_chunk=cmp) for (toks, _, b), cmp in zip(jobs, cmps)], chunk,
               jobs[0][1].flash_attn if jobs else True, n_threads=n_threads, n_parallel=n_parallel)
    return [cmp.means()["delta_nll"] for cmp in cmps]


def layer_ranking(model, traces: list[tuple[str, list[int]]], lab: dict[str, dict[int, dict]], window: int,
                  n_threads: int | None = None) -> tuple[list[dict], int]:
    """Per capturable layer, the statistics (Spearman, AUROC, ...) of its rolling z-score of g against the
    counterfactual labels ``lab`` ({trace id: {position: row}}) over ``traces``; and the labelled positions used."""
    zs, ys, grp = [], [], []
    for i, (tid, toks) in enumerate(traces):
        if tid not in lab:
            continue
        cap = capture_pass(model, toks, n_threads=n_threads, keys=False)
        pos = np.array(sorted(lab[tid]))
        z = layer_z(cap["g"], window)
        zs.append(z[pos])
        ys.append(np.array([lab[tid][p]["label"] for p in pos]))
        grp.append(np.array([lab[tid][p]["checkpoint"] for p in pos]) + 1_000_000 * i)
    if not zs:
        raise DataError("no labelled position in the traces")
    Z, Y, G = np.concatenate(zs), np.concatenate(ys), np.concatenate(grp)
    return [{"layer": j, **signal_stats(Z[:, j], Y, G)} for j in range(model.info.n_layer - 1)], len(Y)


@dataclass(frozen=True)
class Grid:
    budgets: tuple[int, ...] = (128, 256)
    windows: tuple[int, ...] = (64, 128, 256)
    recent: tuple[float, ...] = (0.25, 0.5, 0.75)
    n_pos: int = 3
    n_neg: int = 3
    n_traces: int = 3
    max_tokens: int = 768
    chunk: int = 16
    n_sink: int = 4
    label_traces: int = 3
    label_horizon: int = 32
    label_batch: int = 1
    fast_signals: bool = False   # step 3 with the reduced candidate list (signals.candidates(fast=True))
    #: step 3's budgets and trace length (None: step 2's): roomy budgets need longer traces to be evaluated
    signal_budgets: tuple[int, ...] | None = (128, 256, 512, 1024)
    signal_max_tokens: int | None = 1536
    label_stride: int = 16
    anatomy_window: int = ScoringConfig.window  # rolling z-score window of the layer ranking


#: ``calibrate --fast``: what a 0.5B model affords on 2 cores in about a quarter of an hour (docs/calibration.md):
#: cheaper labels (1 trace, horizon 8, 8 branches per decode; their layer ranking agrees with horizon 32's, see
#: the docs), 2 x 2 band candidates, the window fixed at 128, 2 traces of 512 tokens
FAST_GRID = Grid(budgets=(128, 256), windows=(128,), recent=(0.5, 0.75), n_pos=2, n_neg=2, n_traces=2,
                 max_tokens=512, chunk=16, label_traces=1, label_horizon=8, label_stride=16, label_batch=8,
                 fast_signals=True, signal_budgets=None, signal_max_tokens=None)
QUICK_GRID = Grid(budgets=(64,), windows=(64,), recent=(0.5,), n_pos=2, n_neg=1, n_traces=1, max_tokens=160,
                  chunk=16, label_traces=1, label_horizon=8, label_stride=8, fast_signals=True,
                  signal_budgets=None, signal_max_tokens=None)


def _key(cfg: ScoringConfig, rf: float) -> tuple:
    return (cfg.layer_a, cfg.layer_b, cfg.window, rf)


def calibrate(model_path: str | os.PathLike, traces_path: str | os.PathLike, grid: Grid = Grid(),
              full_grid: bool = False, n_threads: int | None = None, labels_path: str | os.PathLike | None = None,
              out: str | os.PathLike | None = None,
              log: Callable[[str], None] | None = None, signals: bool = True,
              accuracy: AccuracyObjective | None = None, n_parallel: int = 1) -> CalibrationResult:
    """Run the calibration on ``traces_path`` (dev traces!) and write the JSON. Returns the result.
    ``accuracy``: choose EPIKV's settings on answer accuracy of dev problems (step 4) instead of ΔNLL alone.
    ``n_parallel``: fidelity passes of steps 2 and 3 decoded together as sequences of one context (the traces x
    budgets of one setting; :func:`.passes.run_passes`)."""
    log = log or (lambda m: print(f"calibrate: {m}", file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    model_path = Path(model_path)
    sha = model_sha256(model_path)
    with Model(model_path) as model:
        n_layer = model.info.n_layer
        arch = model.info.arch
        # 1. labels + anatomy ranking
        t0 = time.perf_counter()
        s = LabelSettings(max_tokens=grid.max_tokens, horizon=grid.label_horizon, stride=grid.label_stride,
                          batch=grid.label_batch)
        if labels_path is not None and Path(labels_path).is_file():
            header, rows = read_labels(labels_path)
            lab = labels_by_trace(rows)
            lab_traces = load_traces(header["traces"], model, header["max_tokens"], n_traces=header["n_traces"],
                                     min_tokens=header["max_tokens"], interleave_sources=True)
            log(f"labels read from {labels_path}")
        else:
            lab_traces = load_traces(traces_path, model, s.max_tokens, n_traces=grid.label_traces,
                                     min_tokens=s.max_tokens, interleave_sources=True)
            if not lab_traces:
                raise DataError(f"no trace in {traces_path} has {s.max_tokens} tokens")
            if labels_path is not None:
                run_labels(model, model_path, traces_path, labels_path, s, n_traces=grid.label_traces,
                           n_threads=n_threads, log=log)
                lab = labels_by_trace(read_labels(labels_path)[1])
            else:
                rows = []
                for tid, toks in lab_traces:
                    rows += label_trace(model, tid, toks, s, n_threads=n_threads)[0]
                lab = labels_by_trace(rows)
        layer_stats, n_lab = layer_ranking(model, lab_traces, lab, grid.anatomy_window, n_threads)
        pos_l, neg_l = rank_layers(layer_stats, "spearman", max(grid.n_pos, grid.n_neg))
        pos_l, neg_l = pos_l[:grid.n_pos], neg_l[:grid.n_neg]
        t_labels = time.perf_counter() - t0
        log(f"anatomy on {n_lab} labelled positions ({t_labels:.0f}s): band-A candidates {pos_l}, "
            f"band-B candidates {neg_l}")

        # 2. fidelity grid
        traces = load_traces(traces_path, model, grid.max_tokens, n_traces=grid.n_traces,
                             min_tokens=grid.max_tokens, interleave_sources=True)
        if not traces:
            raise DataError(f"no trace in {traces_path} has {grid.max_tokens} tokens")
        budgets = [b for b in grid.budgets if b < grid.max_tokens - 1]
        t0 = time.perf_counter()
        refs = reference_passes(model, [toks for _, toks in traces], grid.chunk, True, eval_start=min(budgets),
                                n_threads=n_threads, n_parallel=n_parallel)
        results: dict[tuple, dict] = {}
        default = ScoringConfig()
        dl = default.layers_for_depth(n_layer)
        layer_cands = [(dl[0], dl[1])] + [(a, b) for a in pos_l for b in neg_l if a != b] + [(a, None) for a in pos_l]
        layer_cands = list(dict.fromkeys(layer_cands))
        n_cfg = (len(layer_cands) * len(grid.windows) * len(grid.recent) if full_grid
                 else 1 + len(layer_cands) + len(grid.windows) + len(grid.recent))  # an upper bound (repeats skip)
        bar = progress_bar(total=n_cfg * len(traces) * len(budgets), desc="calibrate grid", unit="pass")

        def evaluate(cfg: ScoringConfig, rf: float) -> float:
            k = _key(cfg, rf)
            if k in results:
                return results[k]["delta_nll"]
            keys = [(tid, b) for tid, _ in traces for b in budgets]
            jobs = [(toks, ref, BudgetConfig(kv_budget=b, n_sink=grid.n_sink, recent_fraction=rf, protect_prompt=False))
                    for (_, toks), ref in zip(traces, refs) for b in budgets]
            got = policy_delta_nlls(model, jobs, cfg, grid.chunk, n_threads, n_parallel)
            vals = {f"{tid}@{b}": v for (tid, b), v in zip(keys, got)}
            bar.update(len(jobs))
            per_budget = {b: float(np.mean([v for kk, v in vals.items() if kk.endswith(f"@{b}")]))
                          for b in budgets}
            m = float(np.mean(list(vals.values())))
            results[k] = {"layer_a": cfg.layer_a, "layer_b": cfg.layer_b, "window": cfg.window,
                          "recent_fraction": rf, "delta_nll": m, "per_budget": per_budget}
            log(f"layers {cfg.layer_a},{cfg.layer_b} window {cfg.window} recent {rf}: ΔNLL {m:+.4f} "
                f"({', '.join(f'{b}: {v:+.4f}' for b, v in per_budget.items())})")
            return m

        base_cfg = ScoringConfig(layer_a=dl[0], layer_b=dl[1], ref_depth=n_layer, window=default.window)
        baseline = evaluate(base_cfg, DEFAULT_RECENT_FRACTION)
        if full_grid:
            for (a, b), w, rf in itertools.product(layer_cands, grid.windows, grid.recent):
                evaluate(ScoringConfig(layer_a=a, layer_b=b, ref_depth=n_layer, window=w), rf)
        else:
            w0 = 128 if 128 in grid.windows else grid.windows[0]
            for a, b in layer_cands:
                evaluate(ScoringConfig(layer_a=a, layer_b=b, ref_depth=n_layer, window=w0), DEFAULT_RECENT_FRACTION)
            best = min(results.values(), key=lambda r: r["delta_nll"])
            for w in grid.windows:
                evaluate(ScoringConfig(layer_a=best["layer_a"], layer_b=best["layer_b"], ref_depth=n_layer,
                                       window=w), best["recent_fraction"])
            best = min(results.values(), key=lambda r: r["delta_nll"])
            for rf in grid.recent:
                evaluate(ScoringConfig(layer_a=best["layer_a"], layer_b=best["layer_b"], ref_depth=n_layer,
                                       window=best["window"]), rf)
        best = min(results.values(), key=lambda r: r["delta_nll"])
        bar.close()
        t_grid = time.perf_counter() - t0

        # 4. (optional) the best of 2 re-ranked on answer accuracy: before 3, which builds on the choice
        acc_record, t_acc = None, 0.0
        if accuracy is not None:
            t0 = time.perf_counter()
            best, acc_record = choose_by_accuracy(model, list(results.values()),
                                                  results[_key(base_cfg, DEFAULT_RECENT_FRACTION)], accuracy,
                                                  n_threads=n_threads, log=log)
            t_acc = time.perf_counter() - t0
            log(f"accuracy: chose layers {best['layer_a']},{best['layer_b']} window {best['window']} recent "
                f"{best['recent_fraction']}" + (" (ΔNLL chose otherwise)" if acc_record["changed_choice"] else
                                                 " (as ΔNLL did)"))

        # 3. query statistics and the choice among signals
        path = Path(out) if out else calibration_dir() / f"{sha}.json"
        selected, qs_name, t_signals, acc3_record = None, None, 0.0, None
        if signals:
            t0 = time.perf_counter()
            epikv_opts = {"layers": (best["layer_a"],) if best["layer_b"] is None else
                          (best["layer_a"], best["layer_b"]), "window": best["window"]}
            qs_path = None
            if model.info.shape.rope_type in ("norm", "neox"):
                qs = collect_query_stats(model, traces, n_threads=n_threads, log=log)
                qs_path = path.with_name(path.stem + ".qstats.npz")
                write_atomic(qs_path, lambda tmp: qs.save(tmp))
                qs_name = qs_path.name
            else:
                log(f"RoPE type {model.info.shape.rope_type!r}: no TriAttention candidates")
            s_traces, s_refs, s_budgets = traces, refs, budgets
            s_max = grid.signal_max_tokens or grid.max_tokens
            s_want = [b for b in (grid.signal_budgets or grid.budgets) if b < s_max - 1]
            if s_max != grid.max_tokens or s_want != budgets:
                longer = load_traces(traces_path, model, s_max, n_traces=grid.n_traces, min_tokens=s_max,
                                     interleave_sources=True)
                if len(longer) == grid.n_traces and s_want:
                    s_traces, s_budgets = longer, s_want
                    s_refs = reference_passes(model, [toks for _, toks in s_traces], grid.chunk, True,
                                              eval_start=min(s_budgets), n_threads=n_threads, n_parallel=n_parallel)
                else:  # short dev traces: step 2's traces and budgets, said so
                    log(f"signals: fewer than {grid.n_traces} traces of {s_max} tokens; budgets {budgets} on "
                        f"{grid.max_tokens} tokens instead")
            log(f"signals: {len(s_traces)} traces x {len(s_traces[0][1])} tokens, budgets {s_budgets}")
            selected = select_policy(model, s_traces, s_refs, s_budgets, grid.chunk, grid.n_sink, epikv_opts,
                                     best["recent_fraction"], str(qs_path) if qs_path else None,
                                     n_threads=n_threads, log=log, fast=grid.fast_signals, n_parallel=n_parallel)
            if selected["chosen"]["options"].get("query_stats"):  # stored relative to the calibration file
                selected["chosen"]["options"]["query_stats"] = qs_name
            for c in selected["candidates"] + selected["by_budget"]:
                if c["options"].get("query_stats"):
                    c["options"]["query_stats"] = qs_name
            t_signals = time.perf_counter() - t0
            if accuracy is not None:  # 3b: the cell that runs at the accuracy budget re-ranked on answers
                t0 = time.perf_counter()
                selected, acc3_record = choose_signal_by_accuracy(model, selected, accuracy, path.parent, n_threads,
                                                                  log, streaming=acc_record["streaming"])
                t_acc += time.perf_counter() - t0
            ch = selected["chosen"]
            log(f"signals: chose {ch['policy']} (recent {ch['recent_fraction']}): objective {ch['objective']:+.4f}; "
                f"streaming {next(c['objective'] for c in selected['candidates'] if c['policy'] == 'streaming'):+.4f}")
            for e in selected["by_budget"]:
                log(f"signals: at budget {e['kv_budget']}: {e['policy']} (recent {e['recent_fraction']}), "
                    f"objective {e['objective']:+.4f}")
    cost = time.perf_counter() - t_start
    doc = {
        "version": CALIBRATION_VERSION, "model_sha256": sha, "model_file": model_path.name, "arch": arch,
        "n_layer": n_layer, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "traces": portable(str(traces_path)), "trace_ids": [t for t, _ in traces],
        "chosen": {k: best[k] for k in ("layer_a", "layer_b", "window", "recent_fraction")},
        "objective": "accuracy" if accuracy is not None else "delta_nll", "accuracy": acc_record,
        "accuracy_signals": acc3_record,
        "chosen_delta_nll": best["delta_nll"], "baseline": results[_key(base_cfg, DEFAULT_RECENT_FRACTION)],
        "baseline_delta_nll": baseline,
        "anatomy": {"candidates_a": pos_l, "candidates_b": neg_l, "n_positions": int(n_lab),
                    "label_settings": asdict(s), "layers": layer_stats},
        "grid": {"search": "full" if full_grid else "coordinate", **asdict(grid)},
        "grid_results": list(results.values()),
        "query_stats": qs_name, "selected": selected,
        "cost_seconds": {"labels_and_anatomy": round(t_labels, 1), "grid": round(t_grid, 1),
                         "signals": round(t_signals, 1), "accuracy": round(t_acc, 1), "total": round(cost, 1),
                         "n_configs": len(results), "n_passes": len(results) * len(traces) * len(budgets),
                         "n_parallel": n_parallel},
    }
    write_atomic(path, json.dumps(doc, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n")
    log(f"chosen layers {best['layer_a']},{best['layer_b']} window {best['window']} recent {best['recent_fraction']}: "
        f"dev ΔNLL {best['delta_nll']:+.4f} vs default {baseline:+.4f}; {cost:.0f}s; wrote {path}")
    return load_file(path)


def _rebase_stats(obj, old_dir: Path, new_dir: Path):
    """``obj`` (a calibration document or part of it) with every ``query_stats`` file name, relative to
    ``old_dir``, made relative to ``new_dir``."""
    if isinstance(obj, dict):
        return {k: (os.path.relpath(old_dir / v, new_dir) if k == "query_stats" and isinstance(v, str)
                    else _rebase_stats(v, old_dir, new_dir)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebase_stats(v, old_dir, new_dir) for v in obj]
    return obj


def _check_reusable(doc: dict, src: Path, accuracy: AccuracyObjective) -> None:
    """DataError naming the problem unless ``doc`` holds what steps 4 and 3b read, checked before any answer:
    a ΔNLL calibration (not one already re-ranked on answers), step 2's rows and baseline as valid EPIKV settings
    of this depth with a ΔNLL, and, if step 3 ran, its per-budget cells and candidates as policies that can be
    built (their query statistics present), an objective at every cell's budget and a StreamingLLM candidate."""
    from ..policies.epikv import EpikvPolicy
    from .calibrate_accuracy import candidate_policy

    def bad(what: str) -> DataError:
        return DataError(f"calibration {src} cannot be re-ranked: {what}")

    if doc.get("objective") == "accuracy" or doc.get("accuracy_signals") is not None:
        raise bad("it was chosen on answers already; give the ΔNLL calibration it came from")
    rows = doc.get("grid_results")
    if not isinstance(rows, list) or not rows:
        raise bad("no step-2 grid results")
    n_layer = int(doc["n_layer"])  # load_file read it as an int
    for r in rows + [doc.get("baseline")]:
        try:
            layers = (r["layer_a"],) if r["layer_b"] is None else (r["layer_a"], r["layer_b"])
            if not all(isinstance(x, int) and 0 <= x < n_layer - 1 for x in layers) or isinstance(r["window"], bool):
                raise ValueError(f"layers {layers} outside 0..{n_layer - 2}")
            EpikvPolicy(layers=layers, window=r["window"])
            float(r["delta_nll"])
            BudgetConfig(kv_budget=accuracy.kv_budget, n_sink=accuracy.n_sink, recent_fraction=r["recent_fraction"],
                         protect_prompt=False)
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise bad(f"a step-2 setting ({type(e).__name__}: {e}): {r!r:.120}") from None
    sel = doc.get("selected")
    if sel is None:
        return
    cells, cands = (sel.get("by_budget"), sel.get("candidates")) if isinstance(sel, dict) else (None, None)
    if not (isinstance(cells, list) and cells and isinstance(cands, list) and cands):
        raise bad("step 3 has no per-budget choices or no candidates")
    budgets = []
    for e in cells:
        if not (isinstance(e, dict) and isinstance(e.get("kv_budget"), int) and e["kv_budget"] > 0
                and isinstance(e.get("objective"), (int, float))):
            raise bad(f"a per-budget choice is not {{kv_budget > 0, objective, ...}}: {e!r:.120}")
        budgets.append(str(e["kv_budget"]))
    for c in cells + cands:
        try:
            if not isinstance(c.get("options"), dict) or not isinstance(c.get("policy"), str):
                raise TypeError("policy is not a name or options not an object")
            candidate_policy(c, src.resolve().parent)
            BudgetConfig(kv_budget=accuracy.kv_budget, n_sink=accuracy.n_sink, recent_fraction=c["recent_fraction"],
                         protect_prompt=False)
            if c in cands and not all(isinstance(c["per_budget"][b]["objective"], (int, float)) for b in budgets):
                raise TypeError("an objective is not a number")
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
            raise bad(f"a step-3 candidate is malformed ({type(e).__name__}: {e})") from None
        except DataError as e:
            raise bad(str(e)) from None
    if not any(c["policy"] == "streaming" for c in cands):
        raise bad("step 3 has no StreamingLLM candidate")


def calibrate_on_accuracy(model_path: str | os.PathLike, calibration: str | os.PathLike,
                          accuracy: AccuracyObjective, out: str | os.PathLike | None = None,
                          n_threads: int | None = None, log: Callable[[str], None] | None = None
                          ) -> CalibrationResult:
    """Steps 4 and 3b on a finished calibration of this model (``calibrate --objective accuracy --from FILE``):
    its step-2 grid and step-3 candidates re-ranked on right answers of dev problems, steps 1-3 not rerun
    (minutes, not hours). Written like :func:`calibrate`'s JSON, with ``reused_from`` naming the file; when step 4
    changes EPIKV's settings, step 3's EPIKV-based candidates still hold the settings they were measured with
    (``signals_built_on``). DataError when the file is not a calibration of ``model_path``."""
    log = log or (lambda m: print(f"calibrate: {m}", file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    src = Path(calibration)
    load_file(src)  # a readable calibration, or DataError naming the problem
    doc = json.loads(src.read_text())
    model_path = Path(model_path)
    sha = model_sha256(model_path)
    if doc["model_sha256"] != sha:
        raise DataError(f"calibration {src} is of another model file ({doc.get('model_file')!s:.80}, sha256 "
                        f"{str(doc['model_sha256'])[:12]}...), not {model_path.name}")
    _check_reusable(doc, src, accuracy)
    path = Path(out) if out else calibration_dir() / f"{sha}.json"
    acc3_record, selected = None, doc.get("selected")
    with Model(model_path) as model:
        best, acc_record = choose_by_accuracy(model, doc["grid_results"], doc["baseline"], accuracy,
                                              n_threads=n_threads, log=log)
        if selected:
            selected, acc3_record = choose_signal_by_accuracy(model, selected, accuracy, src.resolve().parent,
                                                              n_threads, log, streaming=acc_record["streaming"])
    cost = time.perf_counter() - t_start
    chosen = {k: best[k] for k in ("layer_a", "layer_b", "window", "recent_fraction")}
    before = doc.get("cost_seconds") if isinstance(doc.get("cost_seconds"), dict) else {}
    total = before.get("total") if isinstance(before.get("total"), (int, float)) else 0.0
    new = {**doc, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "reused_from": portable(str(src)), "chosen": chosen, "objective": "accuracy", "accuracy": acc_record,
           "accuracy_signals": acc3_record, "chosen_delta_nll": best["delta_nll"], "selected": selected,
           "signals_built_on": doc["chosen"] if selected and chosen != doc["chosen"] else None,
           "cost_seconds": {**before, "accuracy": round(cost, 1), "total": round(total + cost, 1)}}
    new = _rebase_stats(new, src.resolve().parent, path.resolve().parent)
    write_atomic(path, json.dumps(new, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n")
    log(f"accuracy on {src.name}: EPIKV layers {chosen['layer_a']},{chosen['layer_b']} window {chosen['window']} "
        f"recent {chosen['recent_fraction']}" + ("" if acc3_record is None else
        f"; at {accuracy.kv_budget} cells {acc3_record['chosen']['policy']} (ΔNLL chose "
        f"{acc3_record['delta_nll_choice']['policy']})") + f"; {cost:.0f}s; wrote {path}")
    return load_file(path)
