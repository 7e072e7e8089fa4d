"""The patches and the native shim, on the real model (SmolLM2-135M, 30 layers)."""

from __future__ import annotations

import numpy as np
import pytest

from epikv_local.engine.capture import MODE_CAPTURE, MODE_PROBE, CallbackHandle, flash_attn_active
from epikv_local.engine.handles import Context, KVFullError
from epikv_local.policies.scoring import diff_norms

TEXT = ("Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15 and x = 5. "
        "Check: 3 * 5 + 5 = 20. Therefore the answer is 5. Now consider the next problem carefully.")


@pytest.fixture(scope="module")
def tokens(model):
    toks = model.tokenize(TEXT)
    assert len(toks) > 30
    return toks


def run_logits(ctx, tokens):
    ctx.decode(tokens, np.arange(len(tokens)), logits_all=True)
    return np.stack([ctx.logits(i).copy() for i in range(len(tokens))])


def test_layer_out_capture_keeps_logits_bit_identical(model, tokens):
    with Context(model, n_ctx=256, n_batch=64) as plain:
        ref = run_logits(plain, tokens)
    with Context(model, n_ctx=256, n_batch=64) as cap:
        cap.set_layer_out(9, True)
        cap.set_layer_out(20, True)
        got = run_logits(cap, tokens)
        rows = cap.layer_out(9, len(tokens))
    assert rows is not None and rows.shape == (len(tokens), model.info.n_embd)
    assert np.isfinite(rows).all() and np.abs(rows).sum() > 0
    assert np.array_equal(ref, got)


def test_layer_out_matches_eval_callback_route(model, nat, tokens):
    layers = (9, 20)
    with CallbackHandle(nat, layers, model.info.n_embd, 64, MODE_CAPTURE) as h:
        with Context(model, n_ctx=256, n_batch=64, cb_eval=h.cb_eval, cb_eval_user_data=h.user_data) as ctx:
            ctx.set_layer_out(9, True)
            ctx.set_layer_out(20, True)
            ctx.decode(tokens[:40], np.arange(40))
            g_cb = h.take()
            g_lo = np.stack([diff_norms(ctx.layer_out(il, 40), None) for il in layers], axis=1)
            # second decode: the previous token of the callback route is the last of the first batch
            ctx.decode(tokens[40:41], [40])
            g_cb2 = h.take()
            prev = None
    assert g_cb.shape == (40, 2)
    assert np.isnan(g_cb[0]).all() and np.isnan(g_lo[0]).all()
    np.testing.assert_allclose(g_cb[1:], g_lo[1:], rtol=1e-5)
    assert g_cb2.shape == (1, 2) and np.isfinite(g_cb2).all()
    del prev


def test_set_layer_out_rejects_bad_layers(model):
    with Context(model, n_ctx=64, n_batch=8) as ctx:
        with pytest.raises(ValueError, match="out of range"):
            ctx.set_layer_out(model.info.n_layer, True)
        with pytest.raises(ValueError, match="last layer"):
            ctx.set_layer_out(model.info.n_layer - 1, True)
        assert ctx.layer_out(3, 1) is None  # not enabled


def test_batched_removal_equals_one_by_one(model, tokens):
    victims = np.array([5, 9, 10, 11, 17, 30], dtype=np.int64)
    n = len(tokens) - 1
    outs = []
    for batched in (True, False):
        with Context(model, n_ctx=256, n_batch=64) as ctx:
            ctx.decode(tokens[:n], np.arange(n))
            if batched:
                assert ctx.seq_rm_positions(victims) == len(victims)
            else:
                for p in victims:
                    ctx.seq_rm_range(int(p), int(p) + 1)
            ctx.decode(tokens[n:], [n])
            outs.append(ctx.logits().copy())
    assert np.array_equal(outs[0], outs[1])
    # and the removal really changed the prediction compared with the full cache
    with Context(model, n_ctx=256, n_batch=64) as ctx:
        ctx.decode(tokens, np.arange(len(tokens)))
        full = ctx.logits().copy()
    assert not np.array_equal(full, outs[0])


def test_seq_rm_positions_ignores_absent_and_duplicates(model, tokens):
    with Context(model, n_ctx=128, n_batch=64) as ctx:
        ctx.decode(tokens[:20], np.arange(20))
        assert ctx.seq_rm_positions(np.array([3, 3, 4, 500])) == 2
        assert ctx.seq_rm_positions(np.array([3])) == 0


def test_kv_full_hook_lets_decode_continue(model, tokens):
    with Context(model, n_ctx=64, n_batch=16) as ctx:
        n_ctx = ctx.n_ctx
        toks = (tokens * 10)[: n_ctx]
        ctx.decode(toks[:16], np.arange(16))
        for i in range(16, n_ctx, 16):
            ctx.decode(toks[i:i + 16], np.arange(i, i + 16))
        # the cache is full: without a hook, decode fails with code 1
        with pytest.raises(KVFullError):
            ctx.decode([toks[0]], [n_ctx])
        calls = []

        def hook(n_tokens):
            calls.append(n_tokens)
            ctx.seq_rm_positions(np.arange(4, 4 + n_tokens))
            return True

        ctx.set_kv_full_callback(hook)
        ctx.decode([toks[0]], [n_ctx])
        assert calls == [1]
        # a hook that frees nothing is asked a bounded number of times, then decode fails
        ctx.set_kv_full_callback(lambda n: True)
        with pytest.raises(KVFullError):
            ctx.decode([toks[1]], [n_ctx + 1])


@pytest.mark.parametrize("flash_attn", [True, False])
def test_graph_nodes_show_flash_attention(model, nat, tokens, flash_attn):
    with CallbackHandle(nat, (9,), model.info.n_embd, 64, MODE_PROBE) as h:
        with Context(model, n_ctx=256, n_batch=64, flash_attn=flash_attn,
                     cb_eval=h.cb_eval, cb_eval_user_data=h.user_data) as ctx:
            ctx.decode(tokens[:8], np.arange(8))
            ctx.decode(tokens[8:9], [8])  # a single-token decode step
            nodes = h.probe_nodes()
    names = [n for n, _ in nodes]
    assert any(n.startswith("l_out-") for n in names)
    has_softmax = any(n.startswith("kq_soft_max") for n in names)
    has_fa = any(op == "FLASH_ATTN_EXT" for _, op in nodes)
    if flash_attn:
        assert has_fa and not has_softmax
        assert flash_attn_active(nodes)
    else:
        assert has_softmax and not has_fa
        assert not flash_attn_active(nodes)


def test_key_capture_rows_and_identity(model, tokens):
    """Captured keys have n_head_kv * head_dim floats per token, match between batch splits, and leave the
    logits bit-identical."""
    n = 32
    head_dim = model.info.n_embd // model.info.n_head
    with Context(model, n_ctx=128, n_batch=64) as plain:
        ref = run_logits(plain, tokens[:n])
    with Context(model, n_ctx=128, n_batch=64) as ctx:
        ctx.set_layer_capture(model.info.n_layer - 1, True, kind=1)  # keys of the last layer are capturable
        ctx.set_layer_capture(3, True, kind=1)
        got = run_logits(ctx, tokens[:n])
        k_all = ctx.layer_keys(3, n).copy()
    assert np.array_equal(ref, got)
    assert k_all.shape == (n, model.info.n_head_kv * head_dim)
    with Context(model, n_ctx=128, n_batch=64) as ctx:
        ctx.set_layer_capture(3, True, kind=1)
        ctx.decode(tokens[:20], np.arange(20))
        k1 = ctx.layer_keys(3, 20).copy()
        ctx.decode(tokens[20:n], np.arange(20, n))
        k2 = ctx.layer_keys(3, n - 20).copy()
    np.testing.assert_allclose(np.vstack([k1, k2]), k_all, rtol=1e-4, atol=1e-4)


def test_cell_positions_follow_removals(model, tokens):
    with Context(model, n_ctx=128, n_batch=64) as ctx:
        ctx.decode(tokens[:30], np.arange(30))
        cells = ctx.cell_positions()
        assert sorted(cells[cells >= 0].tolist()) == list(range(30))
        ctx.seq_rm_positions(np.array([2, 7, 8]))
        cells = ctx.cell_positions()
        assert sorted(cells[cells >= 0].tolist()) == [p for p in range(30) if p not in (2, 7, 8)]
        ctx.decode(tokens[30:32], [30, 31])  # freed cells are reused
        cells = ctx.cell_positions()
        assert sorted(cells[cells >= 0].tolist()) == [p for p in range(32) if p not in (2, 7, 8)]


def test_attention_readback_with_flash_attention_off(model, nat, tokens):
    from epikv_local.engine.capture import MODE_ATTN

    layers = (2, 9)
    with CallbackHandle(nat, layers, model.info.n_embd, 64, 0) as h:
        h.enable_attention(256)
        h.set_mode(MODE_ATTN)
        with Context(model, n_ctx=256, n_batch=64, flash_attn=False,
                     cb_eval=h.cb_eval, cb_eval_user_data=h.user_data) as ctx:
            ctx.decode(tokens[:20], np.arange(20))
            received, last, nq = h.take_attention()
            cells = ctx.cell_positions()
            ctx.decode(tokens[20:21], [20])
            received2, last2, nq2 = h.take_attention()
    assert nq == 20 and nq2 == 1
    # every query distributes a mass of 1 over the cells it may see (causal)
    assert abs(received.sum() - 20) < 1e-3
    assert abs(last.sum() - 1) < 1e-4 and abs(last2.sum() - 1) < 1e-4
    # the last query of the first batch sees exactly the 20 cells holding positions 0..19
    seen = np.flatnonzero(last > 0)
    assert sorted(cells[seen].tolist()) == list(range(20))
    np.testing.assert_allclose(received2, last2, rtol=1e-6)


def test_missing_l_out_tensor_is_a_clear_error():
    """An architecture whose graph names no l_out-<il> (llama_get_layer_capture returns NULL) is refused with
    a message naming the architecture, not a crash (the CLI prints it as one line)."""
    from epikv_local.engine.capture import LayerOutCapture
    from epikv_local.engine.native import NativeError

    class NoLOut:  # a stand-in for the engine's KVContext protocol
        def set_layer_capture(self, il, enable=True, kind=0):
            pass

        def layer_out(self, il, n_tokens):
            return None

    cap = LayerOutCapture(NoLOut(), (3, 7), arch="someformer")
    with pytest.raises(NativeError, match="someformer.*no l_out-3"):
        cap.after_decode(4)
