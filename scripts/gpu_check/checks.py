"""The native checks that gpu_check adds to tests/engine/test_native.py, as pytest tests behind the backend
fixture (``gpu_check.backend``: the device and the model; run by ``native``, or by hand:
``python -m pytest -p gpu_check.backend --backend gpu --backend-model M scripts/gpu_check/checks.py`` with
``scripts/`` on PYTHONPATH).

Each test is the JSON's ``native_checks`` entry of the same name (``test_budget_held`` -> ``budget_held``) and
fills ``figures`` with that entry's numbers before it asserts, so a failed check still reports them. The
fourth entry, ``flash_attn_graph``, is not here: it is test_native.py's ``test_graph_nodes_show_flash_attention``
run on the same backend, with the node counts the plugin records of its graph probe.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.handles import Context, Model
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.policies import make_policy
from epikv_local.policies.scoring import diff_norms

TEXT = ("Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15 and x = 5. "
        "Check: 3 * 5 + 5 = 20. Therefore the answer is 5. Now consider the next problem carefully.")
# GPU-resident vs CPU capture. The two runs use different kernels (activation quantization of the matrix
# products, flash attention), so the captured rows differ by rounding: on the CPU alone, flash attention on vs
# off already moves layers 9/20 of a 30-layer model by up to 2.5-3.4 % (relative L2 per row) and g by up to
# 1-2 %. A broken capture (wrong rows, stale or zero buffers) is off by O(1).
CAPTURE_RTOL = 0.10  # max relative L2 error of a captured hidden-state row, and max relative error of g
CAPTURE_MIN_PEARSON = 0.99  # correlation of g over the tokens
# decodes of 16 tokens: below ggml's 32-token threshold for running a CPU-resident model's matrix products on
# the GPU, so the CPU model of the comparison really runs on the CPU
CAPTURE_BATCH = 16
PROMPT = 40  # prompt tokens of the session checks


@pytest.fixture(scope="module")
def tokens(backend_model) -> list[int]:
    """48 tokens of TEXT (repeated as needed: a random model's tokenizer may be coarse)."""
    toks = backend_model.tokenize(TEXT)
    while len(toks) < 48:
        toks = toks + backend_model.tokenize(TEXT, add_special=False)
    return toks[:48]


def greedy_decode(session, n: int, keep_logits: bool = False) -> tuple[list[int], list]:
    toks, logits = [], []
    for _ in range(n):
        row = session.logits()
        if keep_logits:
            logits.append(row.copy())
        toks.append(int(np.argmax(row)))
        session.decode_chunk([toks[-1]])
    return toks, logits


def capture_rows(model, layers, toks, n_batch: int, threads: int | None) -> dict:
    """layer -> (T, n_embd) captured outputs of the tokens, decoded n_batch at a time."""
    rows: dict[int, list] = {il: [] for il in layers}
    with Context(model, n_ctx=256, n_batch=n_batch, n_threads=threads) as ctx:
        for il in layers:
            ctx.set_layer_out(il, True)
        for i in range(0, len(toks), n_batch):
            part = toks[i:i + n_batch]
            ctx.decode(part, np.arange(i, i + len(part)))
            for il in layers:
                rows[il].append(ctx.layer_out(il, len(part)).copy())
    return {il: np.vstack(r).astype(np.float64) for il, r in rows.items()}


def compare_rows(a: np.ndarray, b: np.ndarray) -> dict:
    """Errors of the captured rows a against the reference b, and of their g (diff norms)."""
    rel = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    ga, gb = diff_norms(a, None)[1:], diff_norms(b, None)[1:]
    # a constant g has no correlation: then only an exact match counts
    r = float(np.corrcoef(ga, gb)[0, 1]) if np.std(ga) > 0 and np.std(gb) > 0 else float(np.array_equal(ga, gb))
    return {"max_rel_err_hidden": float(np.max(rel)),
            "max_rel_err_g": float(np.max(np.abs(ga - gb) / np.maximum(np.abs(gb), 1e-30))),
            "g_pearson": r, "mean_rel_err_hidden": float(np.mean(rel))}


def test_capture_gpu_vs_cpu(backend, backend_model, tokens, figures):
    """The captured outputs of EPIKV's layers on the backend's device equal those of the same file on the CPU."""
    t0 = time.perf_counter()
    layers = tuple(make_policy("epikv").bind(backend_model.info.shape).g_layers)
    with Model(backend_model.path, n_gpu_layers=0, native=backend_model.nat) as cpu_model:
        h_cpu = capture_rows(cpu_model, layers, tokens, CAPTURE_BATCH, backend.threads)
    h_dev = capture_rows(backend_model, layers, tokens, CAPTURE_BATCH, backend.threads)
    per_layer = {str(il): compare_rows(h_dev[il], h_cpu[il]) for il in layers}
    on_gpu = backend.device == "gpu"
    figures.update(
        tolerance={"max_rel_err_hidden": CAPTURE_RTOL, "max_rel_err_g": CAPTURE_RTOL,
                   "min_g_pearson": CAPTURE_MIN_PEARSON},
        max_rel_err_hidden=max(e["max_rel_err_hidden"] for e in per_layer.values()),
        max_rel_err_g=max(e["max_rel_err_g"] for e in per_layer.values()),
        min_g_pearson=min(e["g_pearson"] for e in per_layer.values()),
        layers=list(layers), tokens=len(tokens), n_batch=CAPTURE_BATCH, gpu_offload=on_gpu, per_layer=per_layer,
        compared=("every layer on the GPU vs the same file with n_gpu_layers=0" if on_gpu else
                  "CPU mode: both runs are on the CPU (plumbing only, the errors must be 0)"),
        seconds=round(time.perf_counter() - t0, 2))
    assert figures["max_rel_err_hidden"] <= CAPTURE_RTOL
    assert figures["max_rel_err_g"] <= CAPTURE_RTOL
    assert figures["min_g_pearson"] >= CAPTURE_MIN_PEARSON


def test_budget_held(backend, backend_model, tokens, figures):
    """An evicting session never holds more live cells than its budget, and llama.cpp's cells agree."""
    budget = 64
    with Session(backend_model, make_policy("epikv"), BudgetConfig(kv_budget=budget, protect_prompt=False),
                 SessionConfig(n_batch=16, n_threads=backend.threads)) as s:
        s.feed(tokens[:PROMPT])
        max_cells, agree = 0, True
        for _ in range(10):
            greedy_decode(s, 20)
            cells = s.ctx.cell_positions()
            cells = np.sort(cells[cells >= 0])
            max_cells = max(max_cells, len(cells))
            agree = agree and np.array_equal(cells, s.live_positions())
        st = s.stats()
    figures.update(kv_budget=budget, tokens=st.n_past, max_live=st.max_live, max_cells_in_cache=max_cells,
                   engine_and_cache_agree=bool(agree), n_evicted=st.n_evicted, n_rounds=st.n_rounds,
                   flash_attn=st.flash_attn)
    assert st.max_live <= budget and max_cells <= budget
    assert agree, "llama.cpp's cells differ from the engine's live positions"
    assert st.n_evicted > 0 and st.flash_attn


def test_bit_identical_no_eviction(backend, backend_model, tokens, figures):
    """A budget >= the sequence: EPIKV (capture on, nothing evicted) gives logits bit-identical to no eviction."""
    n_ctx, n_new, runs = 256, 64, {}
    for pol in ("none", "epikv"):
        with Session(backend_model, make_policy(pol), BudgetConfig(kv_budget=n_ctx, protect_prompt=False),
                     SessionConfig(n_batch=16, n_ctx=n_ctx, n_threads=backend.threads)) as s:
            s.feed(tokens[:PROMPT])
            gen, logits = greedy_decode(s, n_new, keep_logits=True)
            runs[pol] = (gen, np.stack(logits), s.stats())
    (gen_none, lg_none, _), (gen_epikv, lg_epikv, st) = runs["none"], runs["epikv"]
    figures.update(steps=n_new, prompt_tokens=PROMPT, n_ctx=n_ctx,
                   logits_bit_identical=bool(np.array_equal(lg_none, lg_epikv)),
                   max_abs_diff=float(np.max(np.abs(lg_none - lg_epikv))), tokens_identical=gen_none == gen_epikv,
                   epikv_evicted=st.n_evicted)
    assert figures["logits_bit_identical"] and gen_none == gen_epikv
    assert st.n_evicted == 0
