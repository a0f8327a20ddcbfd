#!/usr/bin/env python3
"""Prints Markdown tables of eval scores (percent) per KV policy with 95% bootstrap intervals
from `shadowkv eval --json` reports (.json or .json.gz), merging the questions of every report
given (e.g. one report per seed); a question two reports share (same seed, task, length, sample)
gets the policies of both, so a later run of new policies on the same seed pairs with the first
(a policy both reports ran counts once, where it answered the same).

Usage: scripts/eval_table.py [--json] [--baseline POLICY] REPORT.json [REPORT.json ...]

One table per context length. Rows are tasks (needle depths, turns) in first-seen order, then
the average over rows and each policy's paired difference to the baseline (the first policy, or
--baseline's, e.g. quest:budget=640 to compare the sparse policies with one another); columns
are policies in first-seen order. Each cell is the mean score with its interval, computed exactly as
`shadowkv eval` does (src/eval/bootstrap.h): percentile bootstrap over the questions, 2000
resamples, the average resampling within each row, seeded from the first report's seed, so a
single report re-tabled here shows the intervals the eval printed. A row of one question gets
no interval (its spread is unknown), nor does an average over such rows. Where the report records
attended tokens per query, each policy's mean is given under its table.

--json prints the summary as JSON instead ({length: {row: {policy: {...}}}}), for checks.
"""
import gzip
import json
import math
import sys
from collections import OrderedDict

RESAMPLES = 2000
LEVEL = 0.95
MASK = (1 << 64) - 1


class Rng:
    """SplitMix64 with rejection sampling, as src/eval/rng.h."""

    def __init__(self, seed):
        self.state = seed & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, bound):
        limit = MASK - MASK % bound
        x = self.next()
        while x >= limit:
            x = self.next()
        return x % bound


def derive_seed(seed, tag, a=0, b=0):
    h = 0xCBF29CE484222325 ^ (seed & MASK)
    for byte in tag.encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK
    mix = Rng(h ^ ((a * 0x9E3779B97F4A7C15) & MASK) ^ ((b * 0xC2B2AE3D27D4EB4F) & MASK))
    mix.next()
    return mix.next()


def bootstrap_seed(report_seed, length, row):
    return derive_seed(report_seed, "bootstrap:" + row, length & MASK)


def mean_of_means(strata):
    means = [sum(s) / len(s) for s in strata if s]
    return sum(means) / len(means) if means else math.nan


_draws = {}


def resample_indices(seed, sizes):
    """Per resample, the drawn indices of every non-empty stratum, in the eval's draw order."""
    key = (seed, tuple(sizes))
    if key not in _draws:
        rng = Rng(seed)
        _draws[key] = [[[rng.below(n) for _ in range(n)] for n in sizes if n]
                       for _ in range(RESAMPLES)]
    return _draws[key]


def quantile(values, q):
    position = q * (len(values) - 1)
    below = math.floor(position)
    if below + 1 >= len(values):
        return values[-1]
    return values[below] + (position - below) * (values[below + 1] - values[below])


def bootstrap(strata, seed):
    if math.isnan(mean_of_means(strata)) or any(len(s) == 1 for s in strata):
        return None  # one question has no spread to show
    used = [s for s in strata if s]
    statistics = []
    for draw in resample_indices(seed, [len(s) for s in strata]):
        total = 0.0
        for stratum, indices in zip(used, draw):
            part = 0.0
            for i in indices:
                part += stratum[i]
            total += part / len(stratum)
        statistics.append(total / len(used))
    statistics.sort()
    return [quantile(statistics, (1.0 - LEVEL) / 2.0), quantile(statistics, (1.0 + LEVEL) / 2.0)]


def row_label(mode, question):
    if mode == "niah_grid":
        return f"depth {question['depth']:g}%"
    if mode == "multi_turn":
        return f"turn {question['turn']}"
    return question["task"]


def load(paths):
    """(seed, policies, {length: {row: [question outputs by policy name]}}). A question that an
    earlier report holds too (same seed, length, task, sample and turn: the same prompt) gains the
    later report's policies instead of counting twice. A policy a later report repeats (e.g. its
baseline) counts once where its answer is the same; a different answer is an error."""
    seed, policies, data = None, [], OrderedDict()
    seen = {}
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            report = json.load(f)
        settings = report.get("settings", {})
        report_seed = settings.get("seed", 42)
        if seed is None:
            seed = report_seed
        mode = settings.get("mode", "tasks")
        for question in report["questions"]:
            row = row_label(mode, question)
            key = (report_seed, question["length"], row, question.get("task"),
                   question.get("sample"), question.get("conversation"), question.get("turn"))
            outputs = seen.get(key)
            if outputs is None:
                outputs = seen[key] = OrderedDict()
                rows = data.setdefault(question["length"], OrderedDict())
                rows.setdefault(row, []).append(outputs)
            for output in question["outputs"]:
                if output["policy"] not in policies:
                    policies.append(output["policy"])
                earlier = outputs.get(output["policy"])
                if earlier is not None:
                    if (earlier.get("text"), earlier.get("score")) == \
                            (output.get("text"), output.get("score")):
                        continue  # the same policy rerun with the same answer: counted once
                    sys.exit(f"{path}: {output['policy']} answered {row}, sample "
                             f"{question.get('sample')} at {question['length']} differently in "
                             "an earlier report")
                outputs[output["policy"]] = output
    return seed, policies, data


def summarize(seed, policies, data, first):
    summary = OrderedDict()
    for length, rows in data.items():
        table = OrderedDict()
        average_seed = bootstrap_seed(seed, length, "")
        strata = {p: [] for p in policies}
        deltas = {p: [] for p in policies}
        for row, questions in rows.items():
            row_seed = bootstrap_seed(seed, length, row)
            cells = OrderedDict()
            for p in policies:
                values = [100.0 * q[p]["score"] for q in questions if p in q]
                delta = [100.0 * (q[p]["score"] - q[first]["score"]) for q in questions
                         if p in q and first in q] if p != first else []
                strata[p].append(values)
                deltas[p].append(delta)
                cells[p] = cell(values and [values], delta and [delta], row_seed, p != first)
                cells[p]["questions"] = len(values)
            table[row] = cells
        table["average"] = OrderedDict(
            (p, cell(strata[p], deltas[p], average_seed, p != first)) for p in policies)
        attended = OrderedDict()
        for p in policies:
            found = [q[p]["attended_tokens_per_query"] for qs in rows.values() for q in qs
                     if p in q and q[p].get("attended_tokens_per_query") is not None]
            attended[p] = sum(found) / len(found) if found else None
        summary[length] = {"rows": table, "attended_tokens_per_query": attended}
    return summary


def cell(strata, deltas, seed, paired):
    strata = strata or [[]]
    out = {"mean": nan_to_none(mean_of_means(strata)), "interval": bootstrap(strata, seed)}
    if paired:
        deltas = deltas or [[]]
        out["difference"] = {"mean": nan_to_none(mean_of_means(deltas)),
                             "interval": bootstrap(deltas, seed)}
    return out


def nan_to_none(value):
    return None if math.isnan(value) else value


def text(c):
    if c is None or c["mean"] is None:
        return "-"
    if c["interval"] is None:
        return f"{c['mean']:.1f}"
    return f"{c['mean']:.1f} [{c['interval'][0]:.1f}, {c['interval'][1]:.1f}]"


def print_tables(policies, summary, sparse, first):
    for length, part in summary.items():
        print(f"context {length} tokens, score % [95%]:\n")
        print("| row (questions) | " + " | ".join(policies) + " |")
        print("|---" * (len(policies) + 1) + "|")
        for row, cells in part["rows"].items():
            if row == "average":
                label = "**average**"
            else:
                counts = sorted({c["questions"] for c in cells.values() if c["questions"]})
                label = f"{row} ({'/'.join(str(c) for c in counts)})"
            print(f"| {label} | " + " | ".join(text(cells[p]) for p in policies) + " |")
        average = part["rows"]["average"]
        print(f"| average - {first} | " +
              " | ".join(text(average[p].get("difference")) for p in policies) + " |")
        attended = part["attended_tokens_per_query"]
        listed = [f"{p} {v:.1f}" for p, v in attended.items() if v is not None]
        print()
        if listed:
            print("Attended tokens per query and layer (mean over questions): " +
                  ", ".join(listed) + ".")
            values = [v for p, v in attended.items() if v is not None and sparse(p)]
            if len(values) > 1:
                print(f"Sparse policies attend {min(values):.1f} to {max(values):.1f} tokens "
                      f"(the most {100.0 * (max(values) - min(values)) / min(values):.1f}% above "
                      "the least).")
        else:
            print("Attended tokens per query: not recorded in this report.")
        print()
    print(f"[95%]: percentile bootstrap over the questions, {RESAMPLES} resamples seeded from "
          "the report's seed; the average resamples within each row; "
          f"\"average - {first}\": each policy minus {first} on the same questions (paired).")


def main(argv):
    argv = list(argv)
    as_json = "--json" in argv
    baseline = None
    if "--baseline" in argv:
        at = argv.index("--baseline")
        if at + 1 >= len(argv):
            sys.exit("--baseline needs a policy name")
        baseline = argv[at + 1]
        del argv[at:at + 2]
    paths = [a for a in argv if a != "--json"]
    if not paths:
        sys.exit(__doc__)
    seed, policies, data = load(paths)
    if not policies:
        sys.exit("no questions in the report(s)")
    if baseline is not None and baseline not in policies:
        sys.exit(f"--baseline {baseline}: not a policy of the report(s) ({', '.join(policies)})")
    first = baseline if baseline is not None else policies[0]
    summary = summarize(seed, policies, data, first)
    if as_json:
        print(json.dumps({str(k): v for k, v in summary.items()}, indent=1))
    else:
        print_tables(policies, summary, lambda p: p.split(":")[0] != "full", first)


if __name__ == "__main__":
    main(sys.argv[1:])
