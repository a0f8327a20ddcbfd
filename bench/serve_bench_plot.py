#!/usr/bin/env python3
"""Plots a bench/serve_bench.py JSON file: per KV policy, the request timeline, output tokens/s
over time, and TTFT and inter-token latency histograms.

  python3 bench/serve_bench_plot.py serve_bench.json serve_bench.png
"""
import json
import sys


def throughput_series(records, bins=40):
    """Output tokens/s in equal time bins over the run, from the stream chunks' arrival."""
    points = []
    for r in records:
        if r["status"] == "200" and r["chunk_times_s"]:
            share = r["completion_tokens"] / len(r["chunk_times_s"])
            points += [(t, share) for t in r["chunk_times_s"]]
    if not points:
        return [], []
    start = min(r["start_s"] for r in records)
    end = max(t for t, _ in points)
    width = max((end - start) / bins, 1e-6)
    counts = [0.0] * bins
    for t, share in points:
        counts[min(bins - 1, int((t - start) / width))] += share
    return [start + (i + 0.5) * width for i in range(bins)], [c / width for c in counts]


def plot_run(axes, run):
    records, summary = run["records"], run["summary"]
    policy = run["kv_policy"]
    timeline, rate, ttft_axis, itl_axis = axes
    steady = summary.get("steady_state")
    for i, r in enumerate(sorted(records, key=lambda r: r["index"])):
        if r.get("arrival_s") is not None and r["start_s"] > r["arrival_s"]:
            timeline.plot([r["arrival_s"], r["start_s"]], [i, i], color="0.8", lw=2)
        first = r["first_token_s"] if r["first_token_s"] is not None else r["end_s"]
        colour = "tab:orange" if r["status"] == "200" else "tab:red"
        timeline.plot([r["start_s"], first], [i, i], color=colour, lw=4, solid_capstyle="butt")
        if r["first_token_s"] is not None:
            timeline.plot([first, r["end_s"]], [i, i], color="tab:blue", lw=4,
                          solid_capstyle="butt")
    for axis in (timeline, rate):
        for a, b in (steady or {}).get("segments", []):
            axis.axvspan(a, b, color="tab:green", alpha=0.15)
    timeline.set_title(f"kv {policy}: requests (grey queued, orange to first token,\nblue "
                       "decoding, green steady state)", fontsize=8)
    timeline.set_xlabel("s from the run's start")
    timeline.set_ylabel("request")
    timeline.yaxis.get_major_locator().set_params(integer=True)

    x, y = throughput_series(records)
    rate.plot(x, y, color="tab:blue")
    rate.axhline(summary["output_tokens_per_s"], color="0.4", ls="--", lw=1,
                 label=f"whole run {summary['output_tokens_per_s']:.1f}")
    if steady:
        rate.axhline(steady["output_tokens_per_s"], color="tab:green", ls="--", lw=1,
                     label=f"steady state {steady['output_tokens_per_s']:.1f}")
    rate.legend(fontsize=7)
    rate.set_title(f"kv {policy}: output tokens/s", fontsize=8)
    rate.set_xlabel("s from the run's start")

    ttft = [1000 * (r["first_token_s"] - r["start_s"]) for r in records
            if r["status"] == "200" and r["first_token_s"] is not None]
    itl = [1000 * (b - a) for r in records if r["status"] == "200"
           for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]
    for axis, values, name, key in ((ttft_axis, ttft, "TTFT", "ttft_s"),
                                    (itl_axis, itl, "inter-token latency", "itl_s")):
        if values:
            axis.hist(values, bins=min(40, max(5, len(values) // 4)), color="tab:purple")
        for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            value = summary[key][q]
            if value is not None:
                axis.axvline(1000 * value, color="k", ls=style, lw=1,
                             label=f"{q} {1000 * value:.1f} ms")
        axis.legend(fontsize=7)
        axis.set_title(f"kv {policy}: {name}", fontsize=8)
        axis.set_xlabel("ms")


def plot_file(json_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(json_path, encoding="utf-8") as f:
        result = json.load(f)
    runs = result["runs"]
    figure, axes = plt.subplots(len(runs), 4, figsize=(18, 3.6 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        plot_run(row, run)
    s = result["settings"]
    load = (f"Poisson {s['request_rate']}/s" if s.get("request_rate") else
            f"concurrency {s['concurrency']}")
    figure.suptitle(f"shadowkv serve, {result['model']}: {s['num_requests']} "
                    f"{s['workload']} requests, ~{s['prompt_tokens']} prompt and "
                    f"{s['output_tokens']} output tokens, {load}", fontsize=10)
    figure.tight_layout()
    figure.savefig(png_path, dpi=90)
    plt.close(figure)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: serve_bench_plot.py RESULT.json OUT.png")
    plot_file(sys.argv[1], sys.argv[2])
