"""The policies a benchmark runs: registered names checked, and a calibration's policies as named specs.

``--calibration FILE|auto`` (:func:`load_calibration_arg`) adds two runs besides the registered policies:
``epikv_calibrated`` (:func:`calibrated_spec`: EPIKV with the calibration's layers and window, at its recent
share) and ``calibrated`` (:func:`selected_spec`: the policy the calibration's step 3 selected for a budget,
at that choice's recent share). Both are unregistered :class:`~epikv_local.policies.PolicySpec` objects; the
harness's passes take a spec wherever they take a registered name. Used by ``scripts/bench_fidelity.py`` and
``scripts/bench_collapse.py``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, DataError

#: the run label of EPIKV with a calibration's settings
CALIBRATED = "epikv_calibrated"
#: the run label of a calibration's step-3 choice (also the registered from-calibration policy's name)
SELECTED = "calibrated"


def check_policies(policies: list[str], allow_none: bool = True) -> None:
    """ConfigError for a name that is not registered, for ``none`` unless ``allow_none`` (the full-cache
    reference cannot run under a budget), and for a policy that comes from a calibration (those run through
    ``--calibration``)."""
    from ..policies import REGISTRY

    for p in policies:
        if p not in REGISTRY:
            raise ConfigError(f"unknown policy {p!r}; choose from {', '.join(sorted(REGISTRY))}")
        if p == "none" and not allow_none:
            raise ConfigError("policy 'none' is the full-cache reference; it cannot run under a budget")
        if REGISTRY[p].from_calibration:
            raise ConfigError(f"policy {p!r} comes from a calibration: use --calibration FILE|auto")


def load_calibration_arg(arg: str, model_path: Path):
    """``--calibration FILE|auto``: that file, or the model's own calibration (DataError when there is none)."""
    from ..api.calibration import load_file, load_for_model

    if arg == "auto":
        cal = load_for_model(model_path)
        if cal is None:
            raise DataError("--calibration auto: this model has no calibration (run epikv-local calibrate)")
        return cal
    if not Path(arg).is_file():
        raise DataError(f"calibration file not found: {arg}")
    return load_file(arg)


def calibrated_spec(cal):
    """``epikv_calibrated``: EPIKV with ``cal``'s layers and window, as an unregistered named configuration.
    Its recent share is not a policy setting: the caller runs it at ``cal.recent_fraction``."""
    from ..policies import EpikvPolicy, PolicySpec

    return PolicySpec(CALIBRATED, EpikvPolicy, cal.policy_options(), "EPIKV with this model's calibration")


def selected_spec(cal, kv_budget: int | None = None):
    """``calibrated`` at ``kv_budget``: the policy and settings that ``cal``'s step 3 selected among the signals
    for that budget (``cal.selected_for``; run with its own recent share, ``cal.selected_for(b)["recent_fraction"]``),
    or None for a calibration without step 3."""
    from ..policies import PolicySpec, policy_spec

    sel = cal.selected_for(kv_budget)
    if sel is None:
        return None
    base = policy_spec(sel["policy"])
    return PolicySpec(SELECTED, base.cls, {**base.preset, **sel["options"]},
                      f"{base.name} as selected by this model's calibration")


def selected_by_budget(cal, budgets: list[int]) -> dict[str, dict] | None:
    """Step 3's choice for each budget as a result document records it ({"128": choice, ...}), or None for a
    calibration without per-budget choices."""
    return {str(b): cal.selected_for(b) for b in budgets} if cal.selected_by_budget else None


def llama_policy_args(policy: str, kv_budget: int | None, cal=None) -> dict:
    """``Llama``'s policy arguments for a benchmark run named ``policy``: ``{"kv_policy": policy}`` for a
    registered name (a calibratable one then takes the model's cached calibration, as a user gets it), or for
    ``epikv_calibrated`` / ``calibrated`` the calibration ``cal``'s choice given explicitly (``kv_policy``,
    ``kv_policy_settings``, ``recent_fraction``), ``calibrated`` at ``kv_budget``'s step-3 choice."""
    if policy == CALIBRATED:
        return {"kv_policy": "epikv", "kv_policy_settings": cal.policy_options(),
                "recent_fraction": cal.recent_fraction}
    if policy == SELECTED and cal is not None:
        sel = cal.selected_for(kv_budget)
        return {"kv_policy": sel["policy"], "kv_policy_settings": dict(sel["options"]),
                "recent_fraction": sel["recent_fraction"]}
    return {"kv_policy": policy}
