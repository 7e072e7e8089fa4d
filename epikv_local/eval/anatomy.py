"""Anatomy: which layer's residual-stream change predicts counterfactual importance?

For the traces of a labels file (:mod:`epikv_local.eval.labels`), one teacher-forced pass (flash attention on, as
at run time) captures ``g_l`` for every capturable layer ``0 .. n_layer - 2`` and the keys of every layer;
``z_l = rolling_zscore(g_l, window)``. Optionally a second pass with flash attention off reads the attention
matrix back (averaged over all layers and heads, per KV cell, mapped to positions).

For every labelled position ``p`` (checkpoint ``c``) the signals are (higher = keep):

* ``z_l(p)`` for each layer; ``epikv`` = smooth(z_A - z_B) at the default layers (and at any pair asked for);
* ``knorm``: -mean over layers of ||k_l(p)||;
* ``keydiff``: -mean over 4 spaced layers of cos(k_l(p), mean unit key of positions < c);
* ``attn_received``: attention received by p from the queries before c (H2O's accumulated score);
* ``attn_future``: attention received from the horizon queries [c, c + W) (an oracle, not deployable);
* ``recency``: the position p; ``random``: seeded normal noise.

Statistics (:mod:`.stats`): Spearman rank correlation with the label (average ranks for ties) over all
positions, the mean of the per-checkpoint Spearman (``spearman_within``, removes between-checkpoint
differences), and the AUROC of the signal for "label in the top decile".
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..engine.capture import CallbackHandle, KeyCapture, LayerOutCapture
from ..engine.handles import Context, Model
from ..engine.native import MODE_ATTN
from ..errors import DataError
from ..policies._keys import spaced_layers
from ..policies.scoring import ScoringConfig, causal_moving_average, rolling_zscore
from .stats import signal_stats


# -- capture -------------------------------------------------------------------------------------------------
def layer_z(g: np.ndarray, window: int) -> np.ndarray:
    """Rolling z-score of every layer's g: (T, L) -> (T, L), window in tokens (see policies.scoring)."""
    return np.stack([rolling_zscore(g[:, j], window) for j in range(g.shape[1])], axis=1)


def capture_pass(model: Model, tokens: list[int], chunk: int = 64, n_threads: int | None = None,
                 keys: bool = True) -> dict:
    """Flash-attention-on pass over ``tokens`` capturing g of layers 0..n_layer-2 (T, n_layer-1) and per-layer
    key norms (T, n_layer) plus unit keys of 4 spaced layers (T, 4, d_k), through the engine's captures."""
    n_layer = model.info.n_layer
    layers = tuple(range(n_layer - 1))
    kl = spaced_layers(n_layer, 4)
    T = len(tokens)
    g = np.empty((T, len(layers)))
    knorm = np.empty((T, n_layer)) if keys else None
    kunit = None
    with Context(model, n_ctx=T + chunk, n_batch=chunk, n_threads=n_threads) as ctx:
        gcap = LayerOutCapture(ctx, layers, model.info.arch)
        kcap = KeyCapture(ctx, tuple(range(n_layer)), model.info.arch) if keys else None
        for pos in ctx.prefill_chunks(tokens, chunk=chunk):  # no logits are read, only the captures
            i, n = int(pos[0]), len(pos)
            g[i:i + n] = gcap.after_decode(n)
            if kcap is not None:
                k = kcap.after_decode(n).astype(np.float64)  # (n, n_layer, d_k)
                knorm[i:i + n] = np.linalg.norm(k, axis=2)
                ks = k[:, list(kl)]
                if kunit is None:
                    kunit = np.empty((T, len(kl), k.shape[2]), dtype=np.float32)
                kunit[i:i + n] = ks / (np.linalg.norm(ks, axis=2, keepdims=True) + 1e-12)
    return {"g": g, "layers": list(layers), "knorm": knorm, "kunit": kunit}


def attention_pass(model: Model, tokens: list[int], chunk: int, n_threads: int | None = None) -> np.ndarray:
    """Flash-attention-off pass; returns A (n_chunks, T) float32: attention received by each position from the
    queries of each chunk of ``chunk`` tokens (mean over all layers and heads; each query contributes 1)."""
    n_layer = model.info.n_layer
    T = len(tokens)
    n_chunks = (T + chunk - 1) // chunk
    A = np.zeros((n_chunks, T), dtype=np.float32)
    with CallbackHandle(model.nat, tuple(range(n_layer)), model.info.n_embd, chunk) as h:
        with Context(model, n_ctx=T + chunk, n_batch=chunk, flash_attn=False, n_threads=n_threads,
                     cb_eval=h.cb_eval, cb_eval_user_data=h.user_data) as ctx:
            h.enable_attention(ctx.n_ctx)
            h.set_mode(MODE_ATTN)
            for k, _ in enumerate(ctx.prefill_chunks(tokens, chunk=chunk)):  # chunk k's queries, no logits read
                recv, _, _ = h.take_attention()
                cp = ctx.cell_positions()
                n = min(len(cp), len(recv))
                ok = cp[:n] >= 0
                A[k, cp[:n][ok]] = recv[:n][ok]
    return A


# -- signals at the labelled positions --------------------------------------------------------------------------
def trace_signals(cap: dict, labels: dict[int, dict], window: int, n_layer: int, attn: np.ndarray | None,
                  attn_chunk: int, horizon: int, pairs: dict[str, tuple[int, int | None]],
                  smooth: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Per labelled position (sorted) of one trace: label, checkpoint, z of every layer, baseline signals."""
    pos = np.array(sorted(labels), dtype=np.int64)
    ck = np.array([labels[p]["checkpoint"] for p in pos], dtype=np.int64)
    out: dict[str, np.ndarray] = {"position": pos, "checkpoint": ck,
                                  "label": np.array([labels[p]["label"] for p in pos], dtype=np.float64)}
    z = layer_z(cap["g"], window)
    out["z"] = z[pos]
    for name, (a, b) in pairs.items():
        d = z[:, a] - (z[:, b] if b is not None else 0.0)
        out[name] = causal_moving_average(d, smooth)[pos]
    if cap.get("knorm") is not None:
        out["knorm"] = -cap["knorm"].mean(axis=1)[pos]
        ku = cap["kunit"].astype(np.float64)  # (T, L, d)
        csum = np.cumsum(ku, axis=0)
        mean = csum[ck - 1] / ck[:, None, None]  # mean unit key of positions < c
        mean /= np.linalg.norm(mean, axis=-1, keepdims=True) + 1e-12
        out["keydiff"] = -np.einsum("nld,nld->nl", ku[pos], mean).mean(axis=1)
    if attn is not None:
        ca = np.cumsum(attn.astype(np.float64), axis=0)  # ca[k] = received from chunks 0..k
        kc = ck // attn_chunk  # chunks strictly before c (c is a multiple of attn_chunk)
        past = np.where(kc > 0, ca[np.maximum(kc - 1, 0), pos], 0.0)
        kend = np.minimum((ck + horizon + attn_chunk - 1) // attn_chunk, attn.shape[0]) - 1
        out["attn_received"] = past
        out["attn_future"] = ca[kend, pos] - past
    out["recency"] = pos.astype(np.float64)
    out["random"] = np.random.default_rng(seed + int(pos.sum()) % 1000).normal(size=len(pos))
    return out


def analyse(per_trace: list[dict[str, np.ndarray]], n_layer: int) -> dict:
    """Pool the traces and compute the statistics of every signal."""
    keys = per_trace[0].keys()
    pooled = {k: np.concatenate([t[k] for t in per_trace]) for k in keys}
    # checkpoints are per trace: make the group ids unique across traces
    groups = np.concatenate([t["checkpoint"] + 1_000_000 * i for i, t in enumerate(per_trace)])
    y = pooled["label"]
    layers = []
    for j in range(pooled["z"].shape[1]):
        st = signal_stats(pooled["z"][:, j], y, groups)
        layers.append({"layer": j, "rel_depth": j / n_layer, **st})
    signals = {k: signal_stats(pooled[k], y, groups) for k in keys
               if k not in ("position", "checkpoint", "label", "z")}
    return {"n_positions": int(len(y)), "label_mean": float(y.mean()), "label_std": float(y.std()),
            "label_top10_threshold": float(np.quantile(y, 0.9)), "layers": layers, "signals": signals}


def rank_layers(layers: list[dict], key: str = "spearman", k: int = 3) -> tuple[list[int], list[int]]:
    """(top-k layers by the statistic, bottom-k layers), skipping NaN."""
    ok = [l for l in layers if not np.isnan(l[key])]
    s = sorted(ok, key=lambda l: l[key], reverse=True)
    return [l["layer"] for l in s[:k]], [l["layer"] for l in s[::-1][:k]]


def run_anatomy(model: Model, traces: list[tuple[str, list[int]]], labels: dict[str, dict[int, dict]],
                window: int = 128, horizon: int = 32, attn_chunk: int = 16, attention: bool = True,
                keys: bool = True, n_threads: int | None = None, cfg: ScoringConfig | None = None,
                progress: Callable[[str], None] | None = None) -> dict:
    """Capture, build signals and analyse; returns the JSON-able result (without the figure)."""
    n_layer = model.info.n_layer
    cfg = cfg or ScoringConfig(window=window)
    dl = cfg.layers_for_depth(n_layer)
    pairs = {"epikv_default": (dl[0], dl[1] if len(dl) > 1 else None)}
    per_trace, zfull, t_cap, t_att = [], [], 0.0, 0.0
    for tid, toks in traces:
        if tid not in labels:
            continue
        t0 = time.perf_counter()
        cap = capture_pass(model, toks, n_threads=n_threads, keys=keys)
        t_cap += time.perf_counter() - t0
        attn = None
        if attention:
            t0 = time.perf_counter()
            attn = attention_pass(model, toks, attn_chunk, n_threads=n_threads)
            t_att += time.perf_counter() - t0
        per_trace.append(trace_signals(cap, labels[tid], window, n_layer, attn, attn_chunk, horizon, pairs,
                                       smooth=cfg.smooth))
        zfull.append(layer_z(cap["g"], window))
        if progress:
            progress(f"{tid}: {len(labels[tid])} positions")
    if not per_trace:
        raise DataError("no labelled trace matches the traces given")
    res = analyse(per_trace, n_layer)
    pos_l, neg_l = rank_layers(res["layers"])
    # the EPIKV score at the best anatomy pair (chosen on these same labels: an optimistic number)
    if pos_l and neg_l and pos_l[0] != neg_l[0]:
        a, b = pos_l[0], neg_l[0]
        sig, ys, grp = [], [], []
        for i, (t, zf) in enumerate(zip(per_trace, zfull)):
            sig.append(causal_moving_average(zf[:, a] - zf[:, b], cfg.smooth)[t["position"]])
            ys.append(t["label"])
            grp.append(t["checkpoint"] + 1_000_000 * i)
        res["signals"]["epikv_best_pair"] = signal_stats(np.concatenate(sig), np.concatenate(ys),
                                                          np.concatenate(grp))
        res["best_pair"] = [a, b]
    res.update({"n_layer": n_layer, "window": window, "default_layers": list(dl), "top_positive": pos_l,
                "top_negative": neg_l, "capture_seconds": round(t_cap, 2), "attention_seconds": round(t_att, 2),
                "attention": attention, "attention_chunk": attn_chunk,
                "traces": [t for t, _ in traces if t in labels]})
    return res
