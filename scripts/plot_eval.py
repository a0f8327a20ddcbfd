#!/usr/bin/env python3
"""Plots a report written by `shadowkv eval --json` into one PNG.

Usage: scripts/plot_eval.py REPORT.json OUT.png

  niah_grid:  one heatmap per KV policy, context length x needle depth, score colour-coded
              (red 0 .. green 100), as in the ShadowKV paper's NIAH figure;
  multi_turn: accuracy per turn, one line per policy, one panel per context length, as in the
              paper's multi-turn NIAH figure;
  tasks:      grouped bars, task x policy, one panel per context length, with the report's
              95% bootstrap intervals as error bars where it has them.
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402


def length_label(tokens):
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def plot_grid(report, out):
    grid = report["grid"]
    lengths, depths, scores = grid["lengths"], grid["depths"], grid["scores"]
    policies = list(scores)
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    cols = min(len(policies), 3)
    rows = math.ceil(len(policies) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 1, 3.8 * rows), squeeze=False,
                             constrained_layout=True)
    image = None
    for ax, policy in zip(axes.flat, policies):
        # scores[length][depth] -> rows: depth, columns: length
        matrix = [[scores[policy][l][d] if scores[policy][l][d] is not None else float("nan")
                   for l in range(len(lengths))] for d in range(len(depths))]
        image = ax.imshow(matrix, cmap=cmap, vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(lengths)), [length_label(l) for l in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        flat = [v for row in matrix for v in row if not math.isnan(v)]
        mean = sum(flat) / len(flat) if flat else float("nan")
        ax.set_title(f"{policy} (average {mean:.1f})")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (%)")
        for d in range(len(depths)):
            for l in range(len(lengths)):
                if not math.isnan(matrix[d][l]) and len(lengths) * len(depths) <= 120:
                    ax.text(l, d, f"{matrix[d][l]:.0f}", ha="center", va="center", fontsize=7)
    for ax in list(axes.flat)[len(policies):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, label="score (%)")
    task = report["settings"]["tasks"][0]
    fig.suptitle(f"NIAH ({task}) per KV policy: {report['model']['summary'].split(':')[0]}")
    fig.savefig(out, dpi=120, bbox_inches="tight")


def plot_turns(report, out):
    turns = report["turns"]
    lengths, numbers, scores = turns["lengths"], turns["turns"], turns["scores"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 3.8), squeeze=False,
                             constrained_layout=True)
    for i, (ax, length) in enumerate(zip(axes.flat, lengths)):
        for policy, matrix in scores.items():
            values = [v if v is not None else float("nan") for v in matrix[i]]
            ax.plot(numbers, values, marker="o", label=policy)
        ax.set_title(f"multi-turn NIAH, {length_label(length)} context")
        ax.set_xlabel("turn")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-5, 105)
        ax.set_xticks(numbers)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")


def plot_tasks(report, out):
    scores = report["scores"]
    lengths = list(scores)
    fig, axes = plt.subplots(len(lengths), 1, figsize=(12, 3.6 * len(lengths)), squeeze=False)
    for ax, length in zip(axes.flat, lengths):
        rows = list(scores[length])
        policies = list(scores[length][rows[0]])
        width = 0.8 / len(policies)
        intervals = report.get("intervals", {}).get(length)  # reports before intervals: none
        for p, policy in enumerate(policies):
            values = [scores[length][r][policy] or 0.0 for r in rows]
            error = None
            if intervals:
                bounds = [intervals[r][policy] or [v, v] for r, v in zip(rows, values)]
                error = [[v - b[0] for v, b in zip(values, bounds)],
                         [b[1] - v for v, b in zip(values, bounds)]]
            ax.bar([x + p * width for x in range(len(rows))], values, width, label=policy,
                   yerr=error, capsize=2, error_kw={"elinewidth": 0.8})
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], rows, rotation=30,
                      ha="right")
        ax.set_ylabel("score (%)")
        ax.set_ylim(0, 105)
        ax.set_title(f"{length_label(int(length))} context")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=len(labels), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        report = json.load(f)
    mode = report["settings"]["mode"]
    if mode == "niah_grid":
        plot_grid(report, sys.argv[2])
    elif mode == "multi_turn":
        plot_turns(report, sys.argv[2])
    else:
        plot_tasks(report, sys.argv[2])
    print(f"plot written to {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
