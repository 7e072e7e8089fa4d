#!/usr/bin/env python3
"""Regenerate the benchmark figures and tables from the committed results (one command).

Reads ``results/`` (fidelity summaries, speed.json, overhead.json, long_*.jsonl, collapse_*.json), writes the figures to
``docs/figures/`` and replaces the generated block of ``docs/benchmarks.md`` (between the
``<!-- BEGIN GENERATED -->`` / ``<!-- END GENERATED -->`` markers) with the tables. Needs matplotlib.

    python scripts/report.py            # figures + docs/benchmarks.md tables
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the source tree (epikv_local.eval.longrange, epikv_local.fileio)
RESULTS = ROOT / "results"
FIGS = ROOT / "docs" / "figures"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def fmt_ci(m: dict, digits: int = 3, signed: bool = False) -> str:
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    return f"{f.format(m['mean'])} [{f.format(m['ci_low'])}, {f.format(m['ci_high'])}]"


def fmt_opt(v: dict, key: str, spec: str) -> str:
    """``v[key]`` formatted with ``spec``, or – when it is missing or None."""
    x = v.get(key)
    return "–" if x is None else format(x, spec)


def md_row(cells) -> str:
    """One row of a markdown table."""
    return "| " + " | ".join(cells) + " |"


def md_head(cells) -> list[str]:
    """A markdown table's header row and the separator under it."""
    return [md_row(cells), "|---" * len(cells) + "|"]


def budget_head(first: str, budgets) -> list[str]:
    """The header of a table with one column per KV budget."""
    return md_head([first] + [f"budget {b}" for b in budgets])


def fidelity_section(summary_path: Path) -> str:
    data = json.loads(summary_path.read_text())
    rows = data["summary"] if "summary" in data else data["results"]
    name = summary_path.stem.replace("fidelity_", "").replace("_summary", "")
    budgets = sorted({r["kv_budget"] for r in rows})
    policies = sorted({r["policy"] for r in rows},
                      key=lambda p: min(r["delta_nll"]["mean"] for r in rows if r["policy"] == p))
    by = {(r["policy"], r["kv_budget"]): r for r in rows}
    out = [f"### Fidelity: `{name}`", ""]
    git = data.get("git_revision") or data.get("git")
    out.append(f"Command: `{data.get('command')}` (git `{git}`, {data.get('date')}, {data.get('wall_seconds', 0):.0f} s).")
    settings = data.get("settings", {})
    if settings:
        out.append("Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items() if not isinstance(v, (dict, list))) + ".")
    out.append("")
    for metric, title, signed in (("delta_nll", "ΔNLL vs full cache (nats/token, lower is better)", True),
                                  ("top1_agreement", "top-1 agreement with the full cache (higher is better)", False),
                                  ("kl", "KL(full ‖ evicted) (nats, lower is better)", False)):
        out += [f"**{title}** — mean [95% bootstrap CI over traces]", "", *budget_head("policy", budgets)]
        for p in policies:
            best = []
            for b in budgets:
                r = by.get((p, b))
                if r is None:
                    best.append("–")
                    continue
                vals = [by[(q, b)][metric]["mean"] for q in policies if (q, b) in by]
                top = (max(vals) if metric == "top1_agreement" else min(vals))
                cell = fmt_ci(r[metric], 3, signed)
                best.append(f"**{cell}**" if r[metric]["mean"] == top else cell)
            out.append(md_row([p] + best))
        out.append("")
    out.append(f"![fidelity {name}](figures/fidelity_{name}.png)")
    out.append("")
    plot_fidelity(rows, policies, budgets, FIGS / f"fidelity_{name}.png", name)
    if any("paired_vs_streaming" in r for r in rows):
        out.append(paired_section(rows, budgets, name))
    jsonl = summary_path.with_name(summary_path.name.replace("_summary.json", ".jsonl"))
    if "calibrated" in {r["policy"] for r in rows} and jsonl.is_file():
        out.append(goal_section(jsonl, budgets))
    return "\n".join(out)


def goal_section(jsonl: Path, budgets) -> str:
    """The issue-12 goal, cell by cell for ``calibrated``: its paired difference to StreamingLLM, and every other
    policy that is significantly better than it (paired on the same traces; CI of other − calibrated below 0)."""
    from epikv_local.eval.longrange import paired_summary

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    vs_cal = paired_summary(rows, baseline="calibrated", metrics=[m for m, _ in PAIRED])
    out = ["**Goal check for `calibrated`**: paired difference calibrated − streaming [95% CI] (**bold** = "
           "significantly better), and the policies significantly better than `calibrated` in that cell "
           "(other − calibrated [95% paired CI]; none = no policy beats it significantly)", "",
           *budget_head("metric", budgets)]
    for metric, title in PAIRED:
        if not any(metric in r for r in rows):
            continue
        cells = []
        for b in budgets:
            st = vs_cal.get(("streaming", b), {}).get(metric)
            if not st or st.get("mean") is None:
                cells.append("–")
                continue
            d = {"mean": -st["mean"], "ci_low": -st["ci_high"], "ci_high": -st["ci_low"]}  # calibrated − streaming
            c = fmt_ci(d, 3, True)
            c = (f"**{c}**" if d["ci_high"] < 0 else f"*{c}*" if d["ci_low"] > 0 else
                 "0 (the same passes as streaming)" if d["ci_low"] == d["ci_high"] == 0 else c)
            better = sorted(((v[metric]["mean"], p, v[metric]) for (p, bb), v in vs_cal.items()
                             if bb == b and metric in v and v[metric].get("ci_high") is not None
                             and v[metric]["ci_high"] < 0), key=lambda t: t[0])
            beat = "; ".join(f"{p} {fmt_ci(m, 3, True)}" for _, p, m in better) or "none"
            cells.append(f"{c}<br>beaten by: {beat}")
        out.append(md_row([title] + cells))
    out.append("")
    return "\n".join(out)


PAIRED = (("delta_nll", "all-token ΔNLL"), ("key_delta_nll", "key-token ΔNLL"),
          ("answer_delta_nll", "answer-span ΔNLL"))


def paired_section(rows, budgets, name: str) -> str:
    """Per-trace paired differences policy − streaming (nats/token; negative = better than streaming) with
    their paired bootstrap CIs; bold: CI excludes 0 on the better side, italic: on the worse side."""
    by = {(r["policy"], r["kv_budget"]): r for r in rows}
    pols = sorted({r["policy"] for r in rows if "paired_vs_streaming" in r})
    out = []
    for metric, title in PAIRED:
        if not any(metric in r.get("paired_vs_streaming", {}) for r in rows):
            continue
        out += [f"**Paired {title}: policy − streaming** — mean [95% paired bootstrap CI over traces]; "
                "**bold** = significantly better than streaming, *italic* = significantly worse", "",
                *budget_head("policy", budgets)]
        for p in sorted(pols, key=lambda q: sum(by[(q, b)]["paired_vs_streaming"].get(metric, {}).get("mean") or 0
                                                 for b in budgets if (q, b) in by)):
            cells = []
            for b in budgets:
                m = by.get((p, b), {}).get("paired_vs_streaming", {}).get(metric)
                if not m or m.get("mean") is None:
                    cells.append("–")
                    continue
                c = fmt_ci(m, 3, True)
                cells.append(f"**{c}**" if m["ci_high"] < 0 else f"*{c}*" if m["ci_low"] > 0 else c)
            out.append(md_row([p] + cells))
        out.append("")
    plot_paired(rows, pols, budgets, FIGS / f"paired_{name}.png", name)
    out += [f"![paired {name}](figures/paired_{name}.png)", ""]
    return "\n".join(out)


def plot_paired(rows, policies, budgets, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["policy"], r["kv_budget"]): r for r in rows}
    metrics = [(m, t) for m, t in PAIRED if any(m in r.get("paired_vs_streaming", {}) for r in rows)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 5), squeeze=False)
    width = 0.8 / max(len(policies), 1)
    for ax, (metric, title) in zip(axes[0], metrics):
        for i, p in enumerate(policies):
            xs, ys, lo, hi = [], [], [], []
            for j, b in enumerate(budgets):
                m = by.get((p, b), {}).get("paired_vs_streaming", {}).get(metric)
                if not m or m.get("mean") is None:
                    continue
                xs.append(j + (i - len(policies) / 2) * width)
                ys.append(m["mean"])
                lo.append(m["mean"] - m["ci_low"])
                hi.append(m["ci_high"] - m["mean"])
            style = dict(lw=2.0) if p.startswith("epikv") or p == "calibrated" else dict(lw=0.8)
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", ms=3, label=p, color=plt.cm.tab20(i % 20), **style)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(range(len(budgets)))
        ax.set_xticklabels([str(b) for b in budgets])
        ax.set_xlabel("KV budget (cells)")
        ax.set_title(f"{title}: policy − streaming")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Paired differences to StreamingLLM, 95% paired bootstrap CIs ({name}; below 0 = better)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(rows, policies, budgets, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["policy"], r["kv_budget"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, p in enumerate(policies):
        xs = [b for b in budgets if (p, b) in by]
        style = dict(lw=2.5) if p.startswith("epikv") else dict(lw=1.2, ls="--")
        style["color"] = plt.cm.tab20(i % 20)
        for ax, metric in zip(axes, ("delta_nll", "top1_agreement")):
            ys = [by[(p, b)][metric]["mean"] for b in xs]
            ax.plot(xs, ys, marker="o", label=p, **style)
    for ax, title in zip(axes, ("ΔNLL vs full cache (nats/token)", "top-1 agreement with full cache")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        ax.set_xlabel("KV budget (cells)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle(f"Teacher-forced fidelity ({name})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speed_head(title: str, path: Path, d: dict, details: str) -> list[str]:
    """The title and the command line of a speed-benchmark section (``speed.json``, ``overhead.json``)."""
    return [f"### {title}: `{path.name}`", "", f"Command: `{d['command']}` (git `{d['git']}`, {d['date']}); {details}",
            ""]


def speed_section(path: Path) -> str:
    d = json.loads(path.read_text())
    out = speed_head("Decode speed per policy", path, d,
                     f"model {d.get('model_desc', d['model'])}, budget {d['kv_budget']}, n_ctx {d['n_ctx']}, "
                     f"prompt {d['prompt_tokens']} tokens, {d['decoded_tokens']} decoded tokens per run, "
                     f"{d['rounds']} alternating rounds, {d.get('threads')} threads.")
    out += md_head(["variant", "flash attn", "median tok/s", "ratio to plain (FA on)", "ratio to plain (FA off)",
                    "ms per eviction round"])
    for name, v in d["variants"].items():
        out.append(md_row([name, "on" if v.get("flash_attn_requested") else "off", f"{v['median_tokens_per_s']:.1f}",
                           f"{v['median_ratio_to_plain']:.3f}", f"{v['median_ratio_to_plain_noFA']:.3f}",
                           fmt_opt(v, "mean_eviction_round_ms", ".2f")]))
    cmp_ = d.get("epikv_speed_vs_attention_policies", {})
    if cmp_:
        out += ["", "EPIKV tokens/s relative to each attention-based policy (median of per-round ratios): "
                + ", ".join(f"{k} {v['median_speed_ratio']:.2f}×" for k, v in cmp_.items()) + "."]
    return "\n".join(out) + "\n"


def overhead_section(path: Path) -> str:
    d = json.loads(path.read_text())
    out = speed_head("EPIKV overhead", path, d,
                     f"budget {d['kv_budget']}, prompt {d['prompt_tokens']} tokens, {d['decoded_tokens']} decoded "
                     f"tokens per run, {d['rounds']} rounds.")
    out += md_head(["variant", "median tok/s", "median ratio to plain", "evicted per run", "ms per eviction round"])
    for name, v in d["variants"].items():
        out.append(md_row([name, f"{v['median_tokens_per_s']:.1f}", fmt_opt(v, "median_ratio_to_plain", ".3f"),
                           str(v["evictions_per_run"]), fmt_opt(v, "mean_eviction_round_ms", ".2f")]))
    return "\n".join(out) + "\n"


def long_section() -> str:
    files = sorted(RESULTS.glob("long_*.jsonl"))
    if not files:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    out = ["### Long generation", "", *md_head(["run", "generated tokens", "last-interval tok/s",
                                                 "first-interval tok/s", "RSS at end (MiB)", "live cells at end",
                                                 "KV allocated (MiB)"])]
    for f in files:
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("interval_tokens_per_s")]
        if not rows:
            continue
        label = f.stem.replace("long_", "")
        xs = [r["tokens"] for r in rows]
        axes[0].plot(xs, [r["interval_tokens_per_s"] for r in rows], label=label)
        axes[1].plot(xs, [r["rss_bytes"] / 2**20 for r in rows], label=label)
        last, first = rows[-1], rows[0]
        out.append(f"| {label} | {last['tokens']} | {last['interval_tokens_per_s']:.1f} | "
                   f"{first['interval_tokens_per_s']:.1f} | {last['rss_bytes'] / 2**20:.0f} | {last['live_cells']} | "
                   f"{last['kv_bytes'] / 2**20:.1f} |")
        summ = f.with_suffix(".summary.json")
        if summ.exists():
            s = json.loads(summ.read_text())
            out.append(f"|  ↳ `{s.get('command', '')}` | stop: {s.get('stop_reason', '')} | | | | | |")
    axes[0].set_title("decode tokens/s over the generation")
    axes[1].set_title("resident memory (MiB)")
    for ax in axes:
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    FIGS.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGS / "long_generation.png", dpi=110)
    plt.close(fig)
    out += ["", "![long generation](figures/long_generation.png)", ""]
    return "\n".join(out)


COLLAPSE_COLS = (("mean_generated_tokens", "tokens", 0, False), ("distinct_3_prefix", "distinct-3 (first 64)", 2, False),
                 ("longest_repeat_share", "longest repeat share", 2, False), ("loop", "loop", 2, False),
                 ("hit_max_tokens", "hit max tokens", 2, False))
COLLAPSE_PAIRED = (("distinct_3_prefix", "distinct-3 (first 64)"), ("longest_repeat_share", "longest repeat share"),
                   ("loop", "loop"))


def collapse_section(path: Path) -> str:
    """Free-generation collapse (``collapse_<name>.json``): per run the means [95% CI over prompts], then the
    paired differences to the full cache; a paired CI that excludes 0 is bold."""
    d = json.loads(path.read_text())
    st = d["settings"]
    order = sorted(d["summary"], key=lambda s: (s["kv_budget"] is not None, s["kv_budget"] or 0, s["policy"]))
    out = [f"### Free-generation collapse: `{path.name}`", "",
           f"Command: `{d['command'].replace(str(ROOT) + '/', '')}` (git `{d['git_revision']}`, {d['date']}, "
           f"{d['wall_seconds']:.0f} s); {st['n_prompts']} MATH-500 prompts after the first "
           f"{st.get('skip_prompts', 0)}, {st['max_tokens']} tokens, temperature {st['temperature']}, top-p "
           f"{st['top_p']}, seed per prompt shared by every run. Means [95% bootstrap CI over prompts]; paired: "
           "run − full cache on the same prompt and seed [95% paired CI], **bold** = CI excludes 0.", "",
           *md_head(["run"] + [c[1] for c in COLLAPSE_COLS] + [f"paired {c[1]}" for c in COLLAPSE_PAIRED])]
    for s in order:
        label = "full cache" if s["kv_budget"] is None else f"{s['policy']}@{s['kv_budget']}"
        cells = []
        for key, _, digits, _ in COLLAPSE_COLS:
            v = s.get(key)
            cells.append("–" if v is None else f"{v:.{digits}f}" if not isinstance(v, dict) else
                         (f"{v['mean']:.0f}" if digits == 0 else fmt_ci(v, digits)))
        pv = s.get("paired_vs_none") or {}
        for key, _ in COLLAPSE_PAIRED:
            m = pv.get(key)
            if not m or m.get("mean") is None:
                cells.append("–")
            else:
                txt = fmt_ci(m, 2, signed=True)
                cells.append(f"**{txt}**" if m["ci_low"] > 0 or m["ci_high"] < 0 else txt)
        out.append(md_row([label] + cells))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables instead of updating the doc")
    args = ap.parse_args(argv)
    parts = []
    if (RESULTS / "overhead.json").exists():
        parts.append(overhead_section(RESULTS / "overhead.json"))
    for p in sorted(RESULTS.glob("speed*.json")):
        parts.append(speed_section(p))
    long_md = long_section()
    if long_md:
        parts.append(long_md)
    for p in sorted(RESULTS.glob("fidelity_*_summary.json")):
        parts.append(fidelity_section(p))
    for p in sorted(RESULTS.glob("collapse_*.json")):
        parts.append(collapse_section(p))
    text = "\n".join(parts)
    if args.print:
        print(text)
        return 0
    doc = DOC.read_text() if DOC.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in doc or END not in doc:
        print(f"report: error: {DOC} lacks the {BEGIN} / {END} markers", file=sys.stderr)
        return 2
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    from epikv_local.fileio import write_atomic

    write_atomic(DOC, head + BEGIN + "\n" + text + "\n" + END + tail)
    print(f"updated {DOC} and {FIGS}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
