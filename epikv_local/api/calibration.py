"""The calibration store, read side, and the one place that turns a policy name into a configured policy.

``epikv-local calibrate`` (:mod:`epikv_local.eval.calibrate`) writes a model's chosen settings as JSON to
``<cache>/calibration/<sha256 of the model file>.json``; the default model's calibration ships in the package
(``epikv_local/calibrations/``). :func:`resolve_policy` is what the CLI and the API call: it applies a
model's calibration to a *calibratable* policy (a class trait, never a policy name) unless the user gave the
calibrated settings explicitly, and returns the recent share to use with it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.budget import DEFAULT_RECENT_FRACTION
from ..errors import ConfigError, DataError
from ..fileio import sha256_file, write_atomic
from ..policies import Policy, make_policy, policy_spec
from .models import cache_dir

CALIBRATION_VERSION = 1
#: calibrations shipped with the package (the default model's, measured on the dev traces; docs/calibration.md)
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "calibrations"
#: the policy settings a calibration chooses (a policy takes those it has)
CALIBRATED_OPTIONS = ("layers", "window", "query_stats")


def calibration_dir() -> Path:
    return cache_dir() / "calibration"


def model_sha256(path: str | os.PathLike) -> str:
    """sha256 of the whole model file, cached by (path, size, mtime) in ``<cache>/model_hashes.json``."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    store = cache_dir() / "model_hashes.json"
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = sha256_file(p)
    known[key] = digest
    try:  # a cache: failing to write it costs a re-hash next time, nothing else
        write_atomic(store, json.dumps(known, indent=1))
    except OSError:
        pass
    return digest


def calibration_path(model_path: str | os.PathLike) -> Path:
    return calibration_dir() / f"{model_sha256(model_path)}.json"


@dataclass(frozen=True)
class CalibrationResult:
    """Chosen EPIKV settings for one model file. Layers are this model's indices (0 .. n_layer - 2)."""

    model_sha256: str
    arch: str
    n_layer: int
    layer_a: int
    layer_b: int | None
    window: int
    recent_fraction: float
    delta_nll: float            # mean dev ΔNLL of the chosen settings (over traces x budgets)
    baseline_delta_nll: float   # same for the default settings
    path: str = ""
    extra: dict = field(default_factory=dict, compare=False)
    #: step 3: the policy chosen among the signals ({"policy", "options", "recent_fraction", "objective", ...};
    #: a "query_stats" option as an absolute path), or None for a calibration without it
    selected: dict | None = field(default=None, compare=False)
    #: absolute path of the model's pre-RoPE query statistics (.npz), or None
    query_stats: str | None = None
    #: step 3 per budget: ((kv_budget, selection like ``selected``), ...) sorted by budget; empty for a
    #: calibration made before per-budget choices (then ``selected`` serves every budget)
    selected_by_budget: tuple = field(default=(), compare=False)

    def selected_for(self, kv_budget: int | None = None) -> dict | None:
        """Step 3's choice for a KV budget (cells): the per-budget choice of the calibrated budget nearest on a
        log scale (ties: the larger one; below/above the calibrated range: the end's choice), or ``selected``
        when the budget is unknown or there are no per-budget choices. None without step 3."""
        if kv_budget is None or not self.selected_by_budget or kv_budget <= 0:
            return self.selected
        return dict(self.selected_by_budget)[nearest_budget(kv_budget, [b for b, _ in self.selected_by_budget])]

    @property
    def layers(self) -> tuple[int, ...]:
        return (self.layer_a,) if self.layer_b is None else (self.layer_a, self.layer_b)

    def policy_options(self, option_names: tuple[str, ...] = ("layers", "window")) -> dict:
        """The calibrated settings that a policy with these settings takes (``make_policy(name, **options)``):
        EPIKV's layers and window, and the query statistics."""
        known = {"layers": self.layers, "window": self.window}
        if self.query_stats:
            known["query_stats"] = self.query_stats
        return {k: v for k, v in known.items() if k in option_names}


def load_file(path: str | os.PathLike) -> CalibrationResult:
    """Read a calibration JSON; DataError when it is missing or malformed."""
    try:
        d = json.loads(Path(path).read_text())
        ch = d["chosen"]
        here = Path(path).resolve().parent
        qs = str(here / d["query_stats"]) if d.get("query_stats") else None
        step3 = d.get("selected")
        sel, by_budget = None, ()
        if step3 is not None:
            sel = selection_as_run(step3["chosen"], here)
            by_budget = tuple(sorted((int(e["kv_budget"]), selection_as_run(e, here)) for e in step3.get("by_budget", ())))
            if any(b <= 0 for b, _ in by_budget):
                raise ValueError("a per-budget choice has a budget <= 0")
        return CalibrationResult(
            model_sha256=d["model_sha256"], arch=d["arch"], n_layer=int(d["n_layer"]), layer_a=int(ch["layer_a"]),
            layer_b=None if ch["layer_b"] is None else int(ch["layer_b"]), window=int(ch["window"]),
            recent_fraction=float(ch["recent_fraction"]), delta_nll=float(d["chosen_delta_nll"]),
            baseline_delta_nll=float(d["baseline_delta_nll"]), path=str(path),
            extra={k: d.get(k) for k in ("created", "cost_seconds", "traces")}, selected=sel, query_stats=qs,
            selected_by_budget=by_budget)
    except OSError as e:
        raise DataError(f"cannot read calibration {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, ConfigError) as e:
        raise DataError(f"calibration {path} is malformed ({type(e).__name__}: {e})") from None


def nearest_budget(kv_budget: int, budgets: list[int]) -> int:
    """The calibrated budget (cells) whose choice runs at ``kv_budget`` > 0: the nearest on a log scale, a tie
    the larger one."""
    return min(budgets, key=lambda b: (abs(math.log(kv_budget / b)), -b))


def selection_as_run(entry: dict, here: Path) -> dict:
    """One step-3 choice as stored -> as run: the query statistics' path made absolute, layers a tuple."""
    sel = dict(entry)
    opts = dict(sel["options"])
    if opts.get("query_stats"):
        opts["query_stats"] = str(here / opts["query_stats"])
    if isinstance(opts.get("layers"), list):
        opts["layers"] = tuple(opts["layers"])
    sel["options"] = opts
    sel["recent_fraction"] = float(sel["recent_fraction"])
    policy_spec(sel["policy"])  # a name this version knows
    return sel


def load_for_model(model_path: str | os.PathLike) -> CalibrationResult | None:
    """The calibration of this model file (matched by content hash): the user's own (cache) first, then one
    shipped with the package; None when there is none."""
    p = calibration_path(model_path)
    if not p.is_file():
        p = PACKAGED_DIR / p.name
        if not p.is_file():
            return None
    return load_file(p)


@dataclass(frozen=True)
class ResolvedPolicy:
    """A configured policy plus what goes with it: the recent share and the calibration used (if any)."""

    policy: Policy
    recent_fraction: float
    calibration: CalibrationResult | None


def resolve_policy(name: str, model_path: str | os.PathLike | None, options: dict | None = None,
                   use_calibration: bool = True, kv_budget: int | None = None) -> ResolvedPolicy:
    """Configure policy ``name`` for a model file.

    options: settings given by the user (None values are ignored); a setting the policy lacks is a
    ConfigError. A calibratable policy whose calibrated settings were not given takes the model's calibration
    (and its recent share, unless the registered configuration has a share of its own) when one exists;
    otherwise the policy's documented defaults apply.
    kv_budget: the KV budget (cells) it will run at; ``calibrated`` then takes step 3's choice for that budget
    (:meth:`CalibrationResult.selected_for`), else the overall choice.
    """
    spec = policy_spec(name)
    opts = {k: v for k, v in (options or {}).items() if v is not None}
    if spec.from_calibration:
        cal = load_for_model(model_path) if model_path is not None else None
        if cal is None or cal.selected is None:
            raise ConfigError(f"policy {spec.name!r}: "
                              + ("no model file given" if model_path is None else
                                 f"{Path(model_path).name} has no calibration with a selected policy")
                              + "; run `epikv-local calibrate --model MODEL` first")
        sel = cal.selected_for(kv_budget)
        policy = make_policy(sel["policy"], **{**sel["options"], **opts})
        return ResolvedPolicy(policy, float(sel["recent_fraction"]), cal)
    cal = None
    if (use_calibration and model_path is not None and spec.cls.calibratable
            and not any(k in opts for k in CALIBRATED_OPTIONS)):
        cal = load_for_model(model_path)
    recent = DEFAULT_RECENT_FRACTION if spec.recent_fraction is None else spec.recent_fraction
    if cal is not None:
        given = cal.policy_options(spec.option_names)
        opts = {**given, **opts}
        # the recent share was chosen with EPIKV's settings, so it goes with them, unless this configuration
        # was designed with a share of its own
        if "layers" in given and spec.recent_fraction is None:
            recent = cal.recent_fraction
    policy = make_policy(name, **opts)
    return ResolvedPolicy(policy, recent, cal)
