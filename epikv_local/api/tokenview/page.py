"""The token view's front doors: :func:`token_view` (one call: run one to three policies, write the page; exported
as ``epikv_local.token_view``) and :class:`PageBuilder` (the page of ``epikv-local generate --html`` and
``--html-compare``), with :func:`page_meta`, the header facts both put on the page.

Both refuse what they can (output path, policy names, a policy that cannot run with the session settings)
before anything is generated: a first run can take minutes, the refusal should not wait for it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from ...engine.handles import Model, check_gguf
from ...engine.sampling import SamplingConfig
from ...engine.session import Session, SessionConfig
from ...errors import ConfigError
from ..chat import chat_prompt, tokenize_prompt
from ..generation import GenerationResult
from ..models import default_model_path
from ..session_spec import resolve_session
from .records import TokenRun, collect_run, run_tokens
from .render import MAX_RUNS, check_output_path, write_html


class PageBuilder:
    """Collects the runs of one ``--html`` page: the command's own run, then an optional comparison run of the
    same prompt and settings under another policy. Everything that can be refused (the output path, the
    comparison policy) is checked in the constructor, before anything is generated."""

    def __init__(self, out: str | os.PathLike, compare: str | None = None,
                 model_path: str | os.PathLike | None = None, session_kwargs: dict | None = None):
        """session_kwargs: the command's ``resolve_session`` arguments; the comparison runs with the same ones
        but its own policy, with that policy's defaults or calibration."""
        self.out = check_output_path(out)
        self.compare = (resolve_session(model_path, **{**(session_kwargs or {}), "kv_policy": compare,
                                                       "kv_policy_settings": None, "recent_fraction": None})
                        if compare else None)
        self.compare_name = compare
        self.runs: list[TokenRun] = []

    def add(self, session: Session, prompt_tokens: Sequence[int], result: GenerationResult,
            calibration: str | None = None) -> TokenRun:
        """The command's own run (its session was created with ``record=True``)."""
        run = collect_run(session, prompt_tokens, result, calibration=calibration)
        self.runs.append(run)
        return run

    def run_compare(self, model: Model, prompt_tokens: Sequence[int], sampling: SamplingConfig,
                    max_tokens: int | None, stop: tuple[str, ...] = (), ignore_eog: bool = False,
                    template: Sequence[bool] | None = None) -> TokenRun | None:
        """Run the comparison policy with the same prompt (and its chat template marks), budget (its own recent
        share, as ``--policy`` would give it), sampling and seed; None without one."""
        if self.compare is None:
            return None
        spec, cal = self.compare, self.compare.calibration
        run = run_tokens(model, prompt_tokens, spec.policy, spec.budget, spec.config, sampling, max_tokens,
                         stop, ignore_eog, label=self.compare_name, calibration=cal.path if cal else None,
                         template=template)
        self.runs.append(run)
        return run

    def write(self, prompt: str | None = None, meta: dict | None = None) -> Path:
        return write_html(self.out, self.runs, prompt=prompt, meta=meta)


def token_view(model_path: str | os.PathLike | None, prompt: str, policies: Sequence[str] = ("epikv",),
               kv_budget: int = 128, max_tokens: int | None = 300, chat: bool = True, system: str | None = None,
               out: str | os.PathLike | None = "token_view.html", sampling: SamplingConfig = SamplingConfig(),
               n_sink: int = 4, n_recent: int | None = None, protect_prompt: bool = True, evict_chunk: int = 16,
               session_cfg: SessionConfig | None = None, n_gpu_layers: int = -1, stop: tuple[str, ...] = (),
               ignore_eog: bool = False) -> list[TokenRun]:
    """Run ``prompt`` under each of one to three ``policies`` (same budget, sampling and seed; greedy by default)
    and write the side-by-side token view to ``out`` (None: write nothing). Returns the runs.

    model_path None: the default model. Each policy takes the model's calibration the way the CLI does
    (:func:`~epikv_local.api.session_spec.resolve_session`), recent share included.
    """
    if isinstance(policies, str):
        policies = (policies,)
    policies = tuple(policies)
    if not 1 <= len(policies) <= MAX_RUNS:
        raise ConfigError(f"token_view compares 1 to {MAX_RUNS} policies, got {len(policies)}")
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError("the prompt must be a non-empty string")
    if out is not None:
        check_output_path(out)
    path = default_model_path() if model_path is None else check_gguf(model_path)
    config = dataclasses.asdict(session_cfg or SessionConfig())
    specs = [resolve_session(path, kv_budget=kv_budget, kv_policy=name, n_sink=n_sink, n_recent=n_recent,
                             protect_prompt=protect_prompt, evict_chunk=evict_chunk, **config) for name in policies]
    runs = []
    with Model(path, n_gpu_layers=n_gpu_layers) as model:
        tokens, template = chat_prompt(model, prompt, system) if chat else (tokenize_prompt(model, prompt), None)
        for name, spec in zip(policies, specs):
            cal = spec.calibration
            runs.append(run_tokens(model, tokens, spec.policy, spec.budget, spec.config, sampling, max_tokens, stop,
                                   ignore_eog, label=name, calibration=cal.path if cal else None, template=template))
    if out is not None:
        write_html(out, runs, prompt=prompt, meta=page_meta(path, sampling, chat))
    return runs


def page_meta(model_path: str | os.PathLike, sampling: SamplingConfig, chat: bool) -> dict:
    """The header facts of a page: model file, sampling, chat template."""
    samp = "greedy" if sampling.temperature <= 0 else f"temp {sampling.temperature} top_p {sampling.top_p}"
    return {"model": Path(model_path).name, "sampling": f"{samp}, seed {sampling.seed}",
            "chat template": "yes" if chat else "no"}
