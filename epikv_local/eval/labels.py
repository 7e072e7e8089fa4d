"""Counterfactual importance labels: how much does removing one KV cell hurt the next tokens?

For a teacher-forced trace and checkpoints ``c`` (multiples of ``stride``), the prefix ``[0, c)`` lives in
sequence 0 of a two-sequence context with a unified KV cache (decoded once, incrementally). For each
candidate position ``p`` in ``[c - (delay - 1) - stride, c - (delay - 1))`` (so the token was processed
``D = c - p >= delay`` tokens before the checkpoint, like an eviction after the fact):

* ``seq_copy(0, 1)`` (cells shared, no data copy), remove ``p`` from sequence 1,
* decode ``tokens[c : c + horizon]`` in sequence 1 with all logits,
* ``nll_removed`` = mean over those ``horizon`` rows of ``-log p(true next token)``,
* clear sequence 1.

``label(p) = nll_removed - nll_base`` (nats/token), where ``nll_base`` is the same branch with nothing
removed, computed once per checkpoint. Positive = the token mattered. With ``control=True`` the no-removal
branch is decoded a second time per checkpoint and written as a ``"control"`` row (its label measures the
numerical noise of re-decoding, ideally 0).

Output JSONL: a ``"header"`` row with the settings, then one ``"label"`` row per (trace, position).
Resumable: positions already present in the output file are skipped (a checkpoint whose candidates are all
present costs nothing). Progress goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..engine.handles import Context, Model
from ..errors import ConfigError, DataError, NativeError
from .io import read_jsonl
from .progress import progress_bar
from .stats import nll_rows
from .traces import load_traces

LABELS_VERSION = 1


@dataclass(frozen=True)
class LabelSettings:
    """max_tokens: trace truncation; horizon W: tokens decoded after the checkpoint (W predictions);
    delay: minimum D = c - p (>= 2: llama.cpp needs the newest prefix token in place); stride S: checkpoint spacing = candidates per checkpoint; min_pos: earlier
    positions are not labelled (they are sinks / too little context); batch: counterfactual branches decoded
    together in one llama_decode (sequences 1..batch of a unified cache; the same labels up to float rounding)."""

    max_tokens: int = 768
    horizon: int = 32
    delay: int = 2
    stride: int = 16
    min_pos: int = 16
    batch: int = 1
    flash_attn: bool | None = None   # None: on for one branch per decode, off for batched branches (see _Brancher)

    def __post_init__(self):
        for k in ("max_tokens", "horizon", "delay", "stride", "batch"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ConfigError(f"{k} must be an integer >= 1, got {getattr(self, k)!r}")
        if self.delay < 2:
            # llama.cpp requires a sequence's new tokens to follow its last stored position: the newest
            # token of the prefix (D = 1) cannot be removed before decoding the horizon
            raise ConfigError(f"delay must be >= 2 (the newest prefix token cannot be removed), got {self.delay}")
        if self.min_pos < 0:
            raise ConfigError(f"min_pos must be >= 0, got {self.min_pos}")
        if self.max_tokens < self.horizon + self.stride + 2:
            raise ConfigError(f"max_tokens {self.max_tokens} is too short for horizon {self.horizon} + stride "
                             f"{self.stride}")

    def candidates(self, c: int) -> range:
        hi = c - (self.delay - 1)
        return range(max(self.min_pos, hi - self.stride), max(self.min_pos, hi))

    def checkpoints(self, n_tokens: int) -> list[int]:
        """Checkpoints c (multiples of stride) whose horizon fits: c + horizon <= n_tokens - 1."""
        last = n_tokens - 1 - self.horizon
        return [c for c in range(self.stride, last + 1, self.stride) if len(self.candidates(c))]


class _Brancher:
    """Seq 0 holds the prefix; branches decode the horizon in seqs 1..B (``s.batch`` at once, one decode) and
    are removed again. The unified KV cache shares the prefix cells between the sequences (no copy)."""

    def __init__(self, model: Model, n_tokens: int, s: LabelSettings, n_threads: int | None):
        self.model, self.s = model, s
        self.B = s.batch
        self.n_batch = max(s.horizon * self.B, s.stride, 16)
        # Batched branches run with flash attention off: llama.cpp's CPU flash-attention kernel (0.3.36's
        # llama.cpp) gave the no-removal branch a 2 % different NLL when 8 sequences x 8 tokens shared one
        # decode of the unified cache (5 x 8 tokens: exact), while the non-flash path reproduced one branch per
        # decode exactly at every batch size (measured on SmolLM2; docs/calibration.md).
        self.ctx = Context(model, n_ctx=n_tokens + s.horizon * self.B + self.n_batch, n_batch=self.n_batch,
                           n_threads=n_threads, n_seq_max=self.B + 1,
                           flash_attn=self.B == 1 if s.flash_attn is None else s.flash_attn)
        self.n_vocab = model.info.n_vocab
        self.buf = np.empty((s.horizon, self.n_vocab), dtype=np.float32)
        self.n_prefix = 0

    def close(self):
        self.ctx.close()

    def extend(self, tokens: list[int], c: int) -> None:
        """Decode tokens[n_prefix:c] into seq 0 (no output rows: logits_from c is past the last position)."""
        for pos in self.ctx.prefill_chunks(tokens[self.n_prefix:c], start=self.n_prefix, chunk=self.n_batch,
                                           seq_id=0, logits_from=c):
            self.n_prefix = int(pos[-1]) + 1

    def branch(self, tokens: list[int], c: int, remove: int | None) -> float:
        """Mean NLL of tokens[c+1 : c+W+1] decoding tokens[c : c+W] in seq 1 = seq 0 minus ``remove``."""
        ctx, W = self.ctx, self.s.horizon
        ctx.seq_copy(0, 1)
        try:
            if remove is not None:
                if ctx.seq_rm_positions(np.array([remove]), seq_id=1) != 1:
                    raise NativeError(f"could not remove position {remove} from the branch")
            ctx.decode(tokens[c:c + W], np.arange(c, c + W), logits_all=True, seq_id=1)
            for i in range(W):
                self.buf[i] = ctx.logits(i)
        finally:
            ctx.seq_rm_range(-1, -1, seq_id=1)
        return float(nll_rows(self.buf, np.asarray(tokens[c + 1:c + W + 1])).mean())

    def branches(self, tokens: list[int], c: int, removes: list[int | None]) -> list[float]:
        """:meth:`branch` for each of ``removes``, up to ``B`` branches per decode (sequences 1..B)."""
        ctx, W = self.ctx, self.s.horizon
        out: list[float] = []
        targets = np.asarray(tokens[c + 1:c + W + 1])
        for g in range(0, len(removes), self.B):
            group = removes[g:g + self.B]
            try:
                for j, p in enumerate(group, start=1):
                    ctx.seq_copy(0, j)
                    if p is not None and ctx.seq_rm_positions(np.array([p]), seq_id=j) != 1:
                        raise NativeError(f"could not remove position {p} from branch {j}")
                k = len(group)
                ctx.decode(tokens[c:c + W] * k, np.tile(np.arange(c, c + W), k), logits_all=True,
                           seq_id=np.repeat(np.arange(1, k + 1), W))
                for j in range(k):
                    for i in range(W):
                        self.buf[i] = ctx.logits(j * W + i)
                    out.append(float(nll_rows(self.buf, targets).mean()))
            finally:
                for j in range(1, len(group) + 1):
                    ctx.seq_rm_range(-1, -1, seq_id=j)
        return out


def label_trace(model: Model, trace_id: str, tokens: list[int], s: LabelSettings, n_threads: int | None = None,
                done: set[int] | None = None, control: bool = False,
                emit: Callable[[list[dict]], None] | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[list[dict], float, int]:
    """Label one trace. Returns (rows, seconds, n_labelled). ``emit`` gets each checkpoint's rows."""
    done = done or set()
    rows: list[dict] = []
    t0 = time.perf_counter()
    n_lab = 0
    ckpts = s.checkpoints(len(tokens))
    br = _Brancher(model, len(tokens), s, n_threads)
    bar = progress_bar(total=len(ckpts), desc=f"labels {trace_id[-24:]}", unit="ckpt")
    try:
        for k, c in enumerate(ckpts):
            bar.update(1)
            cand = [p for p in s.candidates(c) if p not in done]
            if not cand and not control:
                continue
            br.extend(tokens, c)
            if s.batch > 1:  # the no-removal branch decoded in the same batch as the removals
                nlls = br.branches(tokens, c, [None] + ([None] if control else []) + list(cand))
                base, rest = nlls[0], nlls[1:]
            else:
                base = br.branch(tokens, c, None)
                rest = ([br.branch(tokens, c, None)] if control else []) + [br.branch(tokens, c, p) for p in cand]
            out = []
            if control:
                again = rest.pop(0)
                out.append({"type": "control", "trace_id": trace_id, "checkpoint": c, "label": again - base,
                            "nll_base": base})
            for p, nll in zip(cand, rest):
                out.append({"type": "label", "trace_id": trace_id, "position": p, "token": int(tokens[p]),
                            "label": nll - base, "checkpoint": c, "delay": c - p, "nll_base": base,
                            "nll_removed": nll, "horizon": s.horizon, "stride": s.stride})
            n_lab += len(cand)
            rows.extend(out)
            if emit:
                emit(out)
            if progress and (k % 8 == 7 or k == len(ckpts) - 1):
                el = time.perf_counter() - t0
                progress(f"{trace_id}: checkpoint {k + 1}/{len(ckpts)} (c={c}), {n_lab} labelled, "
                         f"{el / max(n_lab, 1):.3f}s/position")
    finally:
        bar.close()
        br.close()
    return rows, time.perf_counter() - t0, n_lab


def read_labels(path: str | Path) -> tuple[dict | None, list[dict]]:
    """(header or None, label rows) of a labels JSONL file (control rows are included, typed)."""
    header, rows = None, []
    for _, r in read_jsonl(path, "labels file"):
        if r.get("type") == "header":
            header = header or r
        else:
            rows.append(r)
    return header, rows


def make_header(model_path: Path, traces: str, s: LabelSettings, n_traces: int | None) -> dict:
    return {"type": "header", "version": LABELS_VERSION, "model": Path(model_path).name, "traces": str(traces),
            "n_traces": n_traces, "trace_order": "interleave_sources", **asdict(s),
            "label": "mean NLL over the horizon with the position removed minus with nothing removed (nats/token)"}


_SETTING_KEYS = ("version", "model", "max_tokens", "horizon", "delay", "stride", "min_pos")


def run_labels(model: Model, model_path: Path, traces_path: str | Path, out: str | Path, s: LabelSettings,
               n_traces: int | None = 4, n_threads: int | None = None, control: bool = False,
               log: Callable[[str], None] | None = None) -> dict:
    """Label ``n_traces`` traces of a JSONL file into ``out`` (resuming). Returns cost statistics."""
    log = log or (lambda m: print(f"labels: {m}", file=sys.stderr, flush=True))
    out = Path(out)
    header = make_header(model_path, traces_path, s, n_traces)
    done: dict[str, set[int]] = {}
    if out.is_file() and out.stat().st_size:
        old, rows = read_labels(out)
        if old is not None:
            diff = [k for k in _SETTING_KEYS if old.get(k) != header.get(k)]
            if diff:
                raise DataError(f"{out} was written with other settings ({', '.join(diff)}); "
                                 "use another --out file")
        for r in rows:
            if r.get("type") == "label":
                done.setdefault(r["trace_id"], set()).add(int(r["position"]))
        write_header = old is None
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_header = True
    traces = load_traces(traces_path, model, s.max_tokens, n_traces=n_traces, min_tokens=s.max_tokens,
                         interleave_sources=True)
    if not traces:
        raise DataError(f"no trace in {traces_path} has {s.max_tokens} tokens")
    total_s, total_n = 0.0, 0
    with open(out, "a") as f:
        if write_header:
            f.write(json.dumps(header) + "\n")
            f.flush()

        def emit(rows):
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()

        for i, (tid, toks) in enumerate(traces):
            log(f"trace {i + 1}/{len(traces)} {tid} ({len(toks)} tokens)")
            _, sec, n = label_trace(model, tid, toks, s, n_threads=n_threads, done=done.get(tid), control=control,
                                    emit=emit, progress=log)
            total_s += sec
            total_n += n
    stats = {"n_traces": len(traces), "n_labelled": total_n, "seconds": round(total_s, 2),
             "seconds_per_position": (total_s / total_n) if total_n else None}
    if total_n:
        log(f"labelled {total_n} positions in {total_s:.1f}s ({total_s / total_n:.3f}s per position)")
    else:
        log("nothing to label (all positions present)")
    return stats


def labels_by_trace(rows: Iterable[dict]) -> dict[str, dict[int, dict]]:
    """{trace_id: {position: row}} of the ``"label"`` rows."""
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r.get("type") == "label":
            out.setdefault(r["trace_id"], {})[int(r["position"])] = r
    return out
