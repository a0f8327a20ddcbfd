#!/usr/bin/env python3
"""Plots the singular-value spectra written by `shadowkv inspect --json` into one PNG.

Usage: scripts/plot_inspect.py REPORT.json OUT.png
Three panels (pre-RoPE keys, post-RoPE keys, values), one line per layer, relative singular
values on a log scale, as in the ShadowKV paper's spectrum figure.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        report = json.load(f)
    series = [("pre_rope_keys", "pre-RoPE keys"), ("post_rope_keys", "post-RoPE keys"),
              ("values", "values")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharey=True)
    layers = report["layers"]
    cmap = plt.get_cmap("viridis")
    for ax, (key, title) in zip(axes, series):
        for i, layer in enumerate(layers):
            values = layer[key]["relative_singular_values"]
            ax.plot(range(1, len(values) + 1), values, color=cmap(i / max(1, len(layers) - 1)),
                    linewidth=1)
        r90 = sorted(layer[key]["rank_for_energy"]["90"] for layer in layers)
        ax.set_title(f"{title}\nmedian rank for 90% energy: {r90[len(r90) // 2]}", fontsize=10)
        ax.set_yscale("log")
        ax.set_xlabel("index of singular value")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("singular value / largest")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, len(layers) - 1))
    fig.colorbar(sm, ax=axes, label="layer")
    fig.suptitle(f"{report['model']}\n{report['prompt_tokens']} prompt tokens", fontsize=10, y=1.06)
    fig.savefig(sys.argv[2], dpi=110, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
