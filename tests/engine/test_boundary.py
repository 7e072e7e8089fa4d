"""The engine boundary: C return codes become named exceptions, and an exception raised inside the kv-full hook
(a policy's scoring, running inside llama_decode) comes out of ``Context.decode`` as itself, not as KVFullError."""

from __future__ import annotations

import numpy as np
import pytest

from epikv_local.engine import native
from epikv_local.engine.budget import BudgetConfig, EvictionEngine
from epikv_local.engine.handles import Context, KVFullError
from epikv_local.policies import make_policy


class ScoringFails(Exception):
    pass


def _fill(ctx, toks):
    for i in range(0, ctx.n_ctx, 16):
        ctx.decode(toks[i:i + 16], np.arange(i, i + 16))


def test_an_exception_in_the_kv_full_hook_is_reraised_as_itself_naming_the_policy(model):
    toks = (model.tokenize("one two three four five six seven eight nine ten") * 40)
    with Context(model, n_ctx=64, n_batch=16) as ctx:
        _fill(ctx, toks)
        policy = make_policy("streaming")
        engine = EvictionEngine(ctx, policy, BudgetConfig(kv_budget=48, n_sink=4, n_recent=8, protect_prompt=False))
        engine.on_decoded(np.arange(ctx.n_ctx))

        def broken(positions):
            raise ScoringFails("the score went wrong")

        policy.score = broken
        ctx.set_kv_full_callback(engine.on_kv_full)
        with pytest.raises(ScoringFails, match="the score went wrong") as info:
            ctx.decode([toks[0]], [ctx.n_ctx])
        notes = getattr(info.value, "__notes__", [""])
        assert any("streaming" in n and "kv-full hook" in n for n in notes) or not hasattr(info.value, "add_note")
        # the error was consumed: the next failure is the ordinary one
        ctx.set_kv_full_callback(None)
        with pytest.raises(KVFullError):
            ctx.decode([toks[1]], [ctx.n_ctx])


def test_every_return_code_the_package_checks_has_a_name_and_a_meaning():
    assert native.DECODE_NO_KV_SLOT == 1
    assert native.decode_failure(1) == "no KV slot for the batch"
    assert native.decode_failure(2) == "aborted" and native.decode_failure(-1) == "invalid batch"
    assert native.decode_failure(-7) == "error"
    assert (native.SEQ_RM_POS_UNSUPPORTED, native.SEQ_RM_POS_BAD_ARGS) == (-1, -2)
    assert (native.LAYER_CAPTURE_BAD_LAYER, native.LAYER_CAPTURE_LAST_LAYER) == (-1, -2)
