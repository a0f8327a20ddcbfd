#!/usr/bin/env python3
"""Prints a Markdown table of task scores (percent) per KV policy from `shadowkv eval --json`
reports, merging the questions of every report given (e.g. one report per seed).

Usage: scripts/eval_table.py REPORT.json [REPORT.json ...]

Rows are tasks in first-seen order plus the average over tasks; columns are policies in the
order of the first report. Each cell is the mean score of that task's questions; the sample
count of each task is shown beside its name.
"""
import json
import sys
from collections import OrderedDict


def main(paths):
    scores = OrderedDict()  # task -> policy -> [score]
    policies = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for question in report["questions"]:
            row = scores.setdefault(question["task"], OrderedDict())
            for output in question["outputs"]:
                if output["policy"] not in policies:
                    policies.append(output["policy"])
                row.setdefault(output["policy"], []).append(100.0 * output["score"])
    print("| task (samples) | " + " | ".join(policies) + " |")
    print("|---" * (len(policies) + 1) + "|")
    means = {p: [] for p in policies}
    for task, row in scores.items():
        cells = []
        counts = {len(v) for v in row.values()}
        for p in policies:
            values = row.get(p, [])
            if values:
                mean = sum(values) / len(values)
                means[p].append(mean)
                cells.append(f"{mean:.1f}")
            else:
                cells.append("")
        label = f"{task} ({'/'.join(str(c) for c in sorted(counts))})"
        print(f"| {label} | " + " | ".join(cells) + " |")
    averages = [f"**{sum(m) / len(m):.1f}**" if m else "" for m in means.values()]
    print("| **average** | " + " | ".join(averages) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
