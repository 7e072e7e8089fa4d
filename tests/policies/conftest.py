"""Shared by the policy tests that run a real model: a prompt counted against a small budget."""

from __future__ import annotations

import numpy as np
import pytest

from epikv_local.api.generation import generate
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.policies import make_policy


@pytest.fixture
def kept_of_counted_prompt(model):
    """kept(name, prompt, positions) -> the share (0..1) of ``positions`` still live after ``prompt`` is decoded
    counted against a 96-cell budget (32 recent, chunks of 8) and 200 greedy tokens follow under policy ``name``;
    asserts the run stayed within the budget and evicted."""
    budget = BudgetConfig(kv_budget=96, n_recent=32, evict_chunk=8, protect_prompt=False)

    def kept(name: str, prompt: list[int], positions) -> float:
        with Session(model, make_policy(name), budget, SessionConfig(n_threads=2)) as s:
            generate(s, prompt, 200, SamplingConfig(), ignore_eog=True)
            assert s.stats().max_live <= 96 and s.stats().n_evicted > 0
            return float(np.isin(positions, s.live_positions()).mean())

    return kept
