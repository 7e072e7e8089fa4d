#!/usr/bin/env python
"""Layer anatomy of counterfactual importance: which layer's z-scored residual change predicts the label?

Reads (or first computes) a labels file (``epikv-local labels``), captures g of every capturable layer, keys
and (optionally) the attention matrix on the same traces, and writes ``<out>/anatomy_<model>.json`` and the
figure ``<figures>/anatomy_<model>.png`` (Spearman vs relative depth, default layers A/B marked).
See ``epikv_local/eval/anatomy.py`` for the definitions.

Examples:
  .venv/bin/python scripts/anatomy.py --labels results/labels_smollm2_dev.jsonl --threads 2
  .venv/bin/python scripts/anatomy.py --n-traces 2 --max-tokens 512 --no-attention   # labels computed first
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from epikv_local.errors import DataError, run_main  # noqa: E402


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] anatomy: {msg}", file=sys.stderr, flush=True)


def model_tag(path: Path) -> str:
    stem = path.stem.lower()
    return "smollm2" if stem.startswith("smollm2") else stem.split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="anatomy", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the cached default model)")
    ap.add_argument("--traces", default=str(REPO.parent / "shared" / "data" / "r1_traces_dev.jsonl"))
    ap.add_argument("--labels", help="labels JSONL (default: <out>/labels_<model>_<traces stem>.jsonl, "
                                     "computed/resumed first)")
    ap.add_argument("--n-traces", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--horizon", type=int, default=32)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--delay", type=int, default=2)
    ap.add_argument("--window", type=int, default=128, help="rolling z-score window (default 128)")
    ap.add_argument("--no-attention", action="store_true", help="skip the flash-attention-off attention pass")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default=str(REPO / "results"))
    ap.add_argument("--figures", default=str(REPO / "docs" / "figures"))
    ap.add_argument("--name", help="tag in the output names (default: from the model file)")
    args = ap.parse_args(argv)

    from epikv_local.api.models import default_model_path
    from epikv_local.engine.handles import Model, check_gguf
    from epikv_local.eval.anatomy import run_anatomy
    from epikv_local.eval.io import to_json, write_atomic
    from epikv_local.eval.provenance import portable
    from epikv_local.eval.labels import LabelSettings, labels_by_trace, read_labels, run_labels
    from epikv_local.eval.plots import plot_anatomy
    from epikv_local.eval.traces import load_traces

    model_path = check_gguf(args.model) if args.model else default_model_path()
    tag = args.name or model_tag(model_path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with Model(model_path) as model:
        if args.labels:
            lab_path = Path(args.labels)
        else:
            lab_path = out / f"labels_{tag}_{Path(args.traces).stem}.jsonl"
            s = LabelSettings(max_tokens=args.max_tokens, horizon=args.horizon, delay=args.delay,
                              stride=args.stride)
            run_labels(model, model_path, args.traces, lab_path, s, n_traces=args.n_traces, n_threads=args.threads,
                       log=_log)
        header, rows = read_labels(lab_path)
        if header is None:
            raise DataError(f"{lab_path} has no header row")
        labels = labels_by_trace(rows)
        traces = load_traces(header["traces"], model, header["max_tokens"], n_traces=header["n_traces"],
                             min_tokens=header["max_tokens"], interleave_sources=True)
        _log(f"{sum(len(v) for v in labels.values())} labelled positions in {len(labels)} traces")
        res = run_anatomy(model, traces, labels, window=args.window, horizon=header["horizon"],
                          attn_chunk=header["stride"], attention=not args.no_attention, n_threads=args.threads,
                          progress=_log)
    res.update({"model": model_path.name, "labels_file": str(lab_path),
                "label_settings": {k: header[k] for k in ("max_tokens", "horizon", "delay", "stride", "min_pos")}})
    jpath = out / f"anatomy_{tag}.json"
    write_atomic(jpath, to_json(portable(res)) + "\n")
    fig = Path(args.figures) / f"anatomy_{tag}.png"
    plot_anatomy(res, fig, f"{model_path.name}: z_l vs counterfactual label ({res['n_positions']} positions, "
                           f"window {args.window}, horizon {header['horizon']})")
    d = res["default_layers"]
    print(f"default layers {d}: " + ", ".join(
        f"z_{l}: rho={res['layers'][l]['spearman']:+.3f} auroc={res['layers'][l]['auroc_top10']:.3f}" for l in d))
    print(f"top positive layers {res['top_positive']}, top negative layers {res['top_negative']}")
    for k, v in res["signals"].items():
        print(f"  {k:<16} rho={v['spearman']:+.3f} within={v['spearman_within']:+.3f} auroc={v['auroc_top10']:.3f}")
    _log(f"wrote {jpath} and {fig}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("anatomy", main))
