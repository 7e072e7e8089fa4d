"""One assembly of a session for every front door: policy (with the model's calibration), budget and context
settings resolved once, from the same keyword arguments everywhere.

``Llama``, ``epikv-local generate`` / ``serve`` / ``chat`` and the token view call :func:`resolve_session`
with the names of ``Llama``'s constructor (``kv_budget``, ``kv_policy``, ``kv_policy_settings``, ``n_sink``,
...); the CLI gets them from its options through :func:`epikv_local.api.options.session_kwargs`. The result, a
:class:`SessionSpec`, opens a :class:`~epikv_local.engine.session.Session` on a loaded model. Everything that
can be checked without the model (settings, calibration, policy vs flash attention) fails here, before a
model is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..engine.budget import DEFAULT_KV_BUDGET, BudgetConfig
from ..engine.handles import Model
from ..engine.pool import SequencePool
from ..engine.session import Session, SessionConfig, check_policy_fits
from ..policies import DEFAULT_POLICY
from ..policies.base import Policy
from .calibration import CalibrationResult, resolve_policy


@dataclass(frozen=True)
class SessionSpec:
    """What a session is made of: the configured policy, its budget, the context settings and the calibration
    the policy took its settings from (None: the policy's defaults or the user's settings)."""

    policy: Policy
    budget: BudgetConfig
    config: SessionConfig
    calibration: CalibrationResult | None

    def open(self, model: Model, record: bool = False) -> Session:
        """A new Session of ``model`` with this spec (the caller owns it: ``with`` or ``close()``)."""
        return Session(model, self.policy, self.budget, self.config, record=record)

    def open_pool(self, model: Model, n_seq: int) -> SequencePool:
        """A new pool of ``n_seq`` sequences of ``model`` with this spec, each with this budget (the caller owns
        it); ``pool.open()`` leases a session of it."""
        return SequencePool(model, self.policy, self.budget, self.config, n_seq=n_seq)


def resolve_session(model_path: str | os.PathLike | None, *, kv_budget: int = DEFAULT_KV_BUDGET,
                    kv_policy: str = DEFAULT_POLICY, kv_policy_settings: dict | None = None, n_sink: int = 4,
                    n_recent: int | None = None, recent_fraction: float | None = None, protect_prompt: bool = True,
                    evict_chunk: int = 16, n_batch: int = 64, n_threads: int | None = None, flash_attn: bool = True,
                    capture_route: str = "layer_out", verify_flash_attn: bool = True, type_k=None,
                    type_v=None, n_ctx: int | None = None) -> SessionSpec:
    """Resolve a policy name and settings for the model file ``model_path`` (its calibration applies to a
    calibratable policy whose calibrated settings were not given; None: no calibration), the budget and the
    context settings. ``recent_fraction`` None: the calibration's share, else the default. ``type_k`` /
    ``type_v``: a name ("q8_0") or llama-cpp-python's GGML_TYPE_* value; None: f16. The context settings
    (``n_batch`` ... ``n_ctx``) are :class:`SessionConfig`'s fields: ``**dataclasses.asdict(config)`` fits."""
    path = model_path if model_path is not None and Path(model_path).is_file() else None
    resolved = resolve_policy(kv_policy, path, kv_policy_settings, kv_budget=kv_budget)
    budget = BudgetConfig(kv_budget=kv_budget, n_sink=n_sink, n_recent=n_recent,
                          recent_fraction=resolved.recent_fraction if recent_fraction is None else recent_fraction,
                          protect_prompt=protect_prompt, evict_chunk=evict_chunk)
    config = SessionConfig(n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn, capture_route=capture_route,
                           verify_flash_attn=verify_flash_attn, type_k=type_k, type_v=type_v, n_ctx=n_ctx)
    check_policy_fits(resolved.policy, config)
    return SessionSpec(resolved.policy, budget, config, resolved.calibration)
