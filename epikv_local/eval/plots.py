"""Figures of the evaluation harness (matplotlib, imported only when drawing)."""

from __future__ import annotations

from pathlib import Path


def plot_anatomy(res: dict, path: str | Path, title: str) -> None:
    """Correlation vs relative depth, default layers A/B marked, baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layer = res["n_layer"]
    x = [l["layer"] / n_layer for l in res["layers"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, [l["spearman"] for l in res["layers"]], "o-", label="z_l: Spearman (pooled)")
    ax.plot(x, [l["spearman_within"] for l in res["layers"]], "s--", ms=3, label="z_l: Spearman within checkpoint")
    ax.axhline(0, color="k", lw=0.6)
    a, *rest = res["default_layers"]
    ax.axvline(a / n_layer, color="tab:green", ls=":", label=f"default A (layer {a})")
    if rest:
        ax.axvline(rest[0] / n_layer, color="tab:red", ls=":", label=f"default B (layer {rest[0]})")
    colors = {"knorm": "tab:purple", "keydiff": "tab:brown", "attn_received": "tab:orange",
              "recency": "tab:gray", "epikv_default": "tab:olive"}
    for k, c in colors.items():
        if k in res["signals"]:
            ax.axhline(res["signals"][k]["spearman"], color=c, lw=1, alpha=0.7,
                       label=f"{k}: {res['signals'][k]['spearman']:+.3f}")
    ax.set_xlabel("relative depth (layer / n_layer)")
    ax.set_ylabel("Spearman(signal, counterfactual label)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
