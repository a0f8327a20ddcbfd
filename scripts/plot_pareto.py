#!/usr/bin/env python3
"""Accuracy against cost, one point per KV policy: the Pareto view of `shadowkv eval` reports.

Usage: scripts/plot_pareto.py REPORT.json[.gz] [REPORT.json...] --out OUT.png
           [--bench BENCH.json]   # `shadowkv bench --json` of the same policies on the same model
           [--length TOKENS]      # the reports' context length to plot (default: the first's first)

The reports are merged by question as scripts/eval_table.py merges them (reports of one seed
split by task, or later runs of new policies on the same questions), and the scores and their
intervals are eval_table's.

Left panel: the average score over the report's tasks, with its 95% bootstrap interval, against
the fast-tier KV bytes per context token: the mean over questions of the report's
`kv_fast_bytes` divided by the row's context length (prompt plus answer). The CUDA backend sizes
a ShadowKV sequence for that length, so on the GPU the bytes are what one sequence allocates;
the CPU backend counts fp32, the GPU bf16, so compare points of one backend only. Right panel
(with --bench): the same scores against the bench's decode tokens per second, each policy at
its best batch at the bench context closest to the length. Points on the upper-left (less
memory) or upper-right (more speed) frontier are drawn filled; the others hollow.
Also prints the table it plots.
"""
import argparse
import gzip
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eval_table  # noqa: E402


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def points(paths, length):
    seed, policies, data = eval_table.load(paths)
    if length not in data:
        raise SystemExit(f"no questions at {length} tokens in the reports")
    summary = eval_table.summarize(seed, policies, {length: data[length]}, policies[0])[length]
    average = summary["rows"]["average"]
    rows = []
    for policy in policies:
        outputs = [q[policy] for qs in data[length].values() for q in qs if policy in q]
        fast = [o.get("kv_fast_bytes", 0) for o in outputs]
        per_token = sum(fast) / len(fast) / length if fast else math.nan
        low, high = average[policy]["interval"] or [math.nan, math.nan]
        score = average[policy]["mean"]
        rows.append({"policy": policy, "score": math.nan if score is None else score,
                     "low": low, "high": high,
                     "bytes_per_token": per_token if per_token > 0 else math.nan,
                     "attended": summary["attended_tokens_per_query"][policy]})
    return rows


def best_speed(bench, policy, length):
    results = [r for r in bench["results"] if r.get("policy") == policy]
    if not results:
        return math.nan
    context = min({r["context"] for r in results}, key=lambda c: abs(c - length))
    return max(r["decode_tokens_per_s"] for r in results if r["context"] == context)


def frontier(rows, x_key, larger_x_better):
    """Policies no other point beats on both score and x."""
    kept = set()
    for a in rows:
        if math.isnan(a[x_key]):
            continue
        beaten = False
        for b in rows:
            if b is a or math.isnan(b[x_key]):
                continue
            better_x = b[x_key] >= a[x_key] if larger_x_better else b[x_key] <= a[x_key]
            if better_x and b["score"] >= a["score"] and (b[x_key] != a[x_key] or
                                                           b["score"] != a["score"]):
                beaten = True
                break
        if not beaten:
            kept.add(a["policy"])
    return kept


def scatter(ax, rows, x_key, larger_x_better, xlabel):
    best = frontier(rows, x_key, larger_x_better)
    for row in rows:
        if math.isnan(row[x_key]):
            continue
        filled = row["policy"] in best
        err = None
        if not math.isnan(row["low"]):
            err = [[row["score"] - row["low"]], [row["high"] - row["score"]]]
        ax.errorbar(row[x_key], row["score"], yerr=err, fmt="o", capsize=3,
                    markerfacecolor=None if filled else "none")
        ax.annotate(row["policy"], (row[x_key], row["score"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("average score (%), 95% interval")
    ax.grid(alpha=0.3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--bench")
    parser.add_argument("--length", type=int)
    args = parser.parse_args()
    first = load(args.reports[0])
    length = args.length or first["settings"]["lengths"][0]
    model = first["model"].get("summary", "").split(" (")[0]
    rows = points(args.reports, length)
    bench = None
    if args.bench:
        bench = load(args.bench)
        for row in rows:
            row["tokens_per_s"] = best_speed(bench, row["policy"], length)
    print(f"{'policy':44} {'score':>6} {'95% interval':>16} {'bytes/token':>12} "
          f"{'attended':>9}" + (f" {'decode tok/s':>13}" if bench else ""))
    for row in rows:
        interval = f"[{row['low']:.1f}, {row['high']:.1f}]"
        attended = f"{row['attended']:.1f}" if row["attended"] is not None else "-"
        line = (f"{row['policy']:44} {row['score']:6.1f} {interval:>16} "
                f"{row['bytes_per_token']:12.0f} {attended:>9}")
        if bench:
            line += f" {row['tokens_per_s']:13.1f}"
        print(line)
    panels = 2 if bench else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False,
                             constrained_layout=True)
    scatter(axes[0][0], rows, "bytes_per_token", False, "fast-tier KV bytes per context token")
    if bench:
        scatter(axes[0][1], rows, "tokens_per_s", True, "bench decode tokens/s (best batch)")
    fig.suptitle(f"{model}: score against cost at {length} tokens")
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
