"""bench/serve_bench.py end to end, briefly: a fixed-concurrency run comparing two KV policies
on a server it starts itself, a Poisson passkey run against a running server, and the token-id
workload (prompts of exact lengths, ids below the vocabulary /v1/models reports or the one
given). Checks that the JSON's numbers agree with its own per-request records and that the PNG
was drawn; no timing is asserted."""
import json
import os
import subprocess
import sys
import tempfile

from harness import Server, check, finish, model_path, run_tests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "serve_bench.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))
from serve_bench import build_id_prompt  # noqa: E402
OUTPUT_TOKENS = 12


def run_bench(*args, expect_ok=True):
    command = [sys.executable, BENCH, *args]
    print("e2e: running", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:], flush=True)
    if expect_ok:
        check(done.returncode == 0, f"serve_bench exited {done.returncode}: {done.stderr[-2000:]}")
    return done


def ordered(d, name):
    check(d["count"] > 0, f"{name}: no values")
    check(d["p50"] <= d["p90"] <= d["p99"] <= d["max"], f"{name}: percentiles out of order {d}")
    check(d["p50"] >= 0, f"{name}: negative")


def close(a, b, name):
    check(abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b)), f"{name}: {a} != {b}")


def check_run(run, requests, scored):
    s, records = run["summary"], run["records"]
    check(s["requests"] == requests and len(records) == requests, "request count")
    check(sorted(r["index"] for r in records) == list(range(requests)), "indices")
    check(s["failed"] == 0 and s["errors_by_status"] == {}, f"errors: {s['errors_by_status']}")
    check(s["completed"] == requests, "completed count")
    for r in records:
        check(r["status"] == "200", f"request {r['index']}: {r['status']} {r['error']}")
        # ignore_eos: every request generates exactly what it asked for.
        check(r["completion_tokens"] == OUTPUT_TOKENS, f"request {r['index']} tokens")
        check(r["prompt_tokens"] > 0, "prompt tokens")
        times = r["chunk_times_s"]
        check(0 < len(times) <= r["completion_tokens"], "chunks vs tokens")
        check(times == sorted(times), "chunk times out of order")
        check(r["arrival_s"] <= r["start_s"] <= r["first_token_s"] == times[0] <= times[-1]
              <= r["end_s"], f"request {r['index']}: times out of order")
    check(s["output_tokens"] == sum(r["completion_tokens"] for r in records), "output tokens")
    check(s["prompt_tokens"] == sum(r["prompt_tokens"] for r in records), "prompt tokens")
    close(s["duration_s"], max(r["end_s"] for r in records) - min(r["start_s"] for r in records),
          "duration")
    close(s["requests_per_s"], requests / s["duration_s"], "requests/s")
    close(s["output_tokens_per_s"], s["output_tokens"] / s["duration_s"], "output tok/s")
    for key in ("ttft_s", "e2e_s", "itl_s", "tpot_s"):
        ordered(s[key], key)
    check(s["ttft_s"]["count"] == requests and s["e2e_s"]["count"] == requests, "counts")
    check(s["itl_s"]["count"] == sum(len(r["chunk_times_s"]) - 1 for r in records), "ITL count")
    steady = s["steady_state"]
    if steady is None:
        check(bool(s["steady_state_note"]), "no steady state and no reason")
    else:
        check(steady["window_s"] > 0, "steady window")
        close(steady["window_s"], sum(b - a for a, b in steady["segments"]), "window length")
        for a, b in steady["segments"]:
            middle = (a + b) / 2
            decoding = sum(1 for r in records if r["first_token_s"] <= middle
                           <= r["chunk_times_s"][-1])
            check(decoding >= steady["decoders"], f"only {decoding} decoding in {a}..{b}")
        check(0 < steady["output_tokens"] <= s["output_tokens"], "steady tokens")
        check(steady["itl_count"] <= s["itl_s"]["count"], "steady ITL count")
        if steady["itl_count"]:
            check(steady["itl_p50_s"] >= 0, "steady ITL")
    check(s["scored"] == scored, f"scored {s['scored']}, expected {scored}")
    if scored:
        for r in records:
            check(r["correct"] == all(a in r["text"] for a in r["answers"]), "scoring")
        check(s["correct"] == sum(1 for r in records if r["correct"]), "correct count")
        close(s["share_right"], s["correct"] / scored, "share right")


def check_png(path):
    with open(path, "rb") as f:
        check(f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG")


def test_concurrency_two_policies(binary, work):
    out = os.path.join(work, "fixed.json")
    run_bench("--binary", binary, "--model", model_path(), "--kv", "full,shadowkv",
              "--num-requests", "6", "--concurrency", "2", "--prompt-tokens", "96",
              "--output-tokens", str(OUTPUT_TOKENS), "--json", out, "--", "--max-batch", "4")
    with open(out) as f:
        result = json.load(f)
    check([s["exit_status"] for s in result["servers"]] == [0], "the server did not exit 0")
    lines = result["servers"][0]["startup_lines"]
    check(lines and lines[0].startswith("shadowkv serve: listening on http://127.0.0.1:"),
          f"start-up lines {lines}")
    check([r["kv_policy"] for r in result["runs"]] == ["full", "shadowkv"], "runs")
    for run in result["runs"]:
        check_run(run, 6, scored=0)
        check(all(r["kv_policy"] == run["kv_policy"] for r in run["records"]), "policy label")
    check(set(result["ratios"]) == {"shadowkv/full"}, f"ratios {result['ratios']}")
    close(result["ratios"]["shadowkv/full"]["output_tokens_per_s"],
          result["runs"][1]["summary"]["output_tokens_per_s"] /
          result["runs"][0]["summary"]["output_tokens_per_s"], "ratio")
    check_png(os.path.join(work, "fixed.png"))


def test_poisson_passkey(binary, work):
    out = os.path.join(work, "poisson.json")
    with Server(binary, "--max-batch", "8") as server:
        run_bench("--base-url", server.base_url, "--workload", "passkey", "--endpoint",
                  "completions", "--num-requests", "6", "--request-rate", "4", "--seed", "3",
                  "--prompt-tokens", "160", "--output-tokens", str(OUTPUT_TOKENS),
                  "--keep-text", "100000", "--json", out, "--png",
                  os.path.join(work, "poisson_plot.png"))
        check(server.healthy(), "server unhealthy after the run")
    with open(out) as f:
        result = json.load(f)
    run = result["runs"][0]
    check_run(run, 6, scored=6)
    arrivals = [r["arrival_s"] for r in sorted(run["records"], key=lambda r: r["index"])]
    check(arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0, "arrivals")
    check(result["calibration"]["units"] >= 1, "calibration")
    check_png(os.path.join(work, "poisson_plot.png"))


def test_prompt_ids(binary, work):
    out = os.path.join(work, "ids.json")
    with Server(binary, "--max-batch", "4") as server:
        status, _, data = server.request("GET", "/v1/models")
        check(status == 200, f"/v1/models: {status}")
        vocab = json.loads(data)["data"][0]["vocab_size"]
        check(isinstance(vocab, int) and vocab > 256, f"vocab_size {vocab}")
        run_bench("--base-url", server.base_url, "--prompt-ids", "80", "--num-requests", "4",
                  "--concurrency", "2", "--output-tokens", str(OUTPUT_TOKENS), "--json", out)
        shared = os.path.join(work, "ids_shared.json")
        run_bench("--base-url", server.base_url, "--prompt-ids", "90", "--shared-prompt",
                  "--num-requests", "3", "--concurrency", "3", "--client-processes", "2",
                  "--output-tokens",
                  str(OUTPUT_TOKENS), "--json", shared)
        small = os.path.join(work, "ids_small.json")
        run_bench("--base-url", server.base_url, "--prompt-ids", "40", "--vocab-size", "300",
                  "--num-requests", "2", "--output-tokens", str(OUTPUT_TOKENS), "--json", small)
        check(server.healthy(), "server unhealthy after the runs")
    with open(out) as f:
        result = json.load(f)
    run = result["runs"][0]
    check_run(run, 4, scored=0)
    # The server counts exactly the ids sent: no BOS, no tokenizer.
    check(all(r["prompt_tokens"] == 80 for r in run["records"]),
          f"prompt tokens {[r['prompt_tokens'] for r in run['records']]}")
    check(result["calibration"] == {"prompt_ids": 80, "vocab_size": vocab,
                                    "shared_prompt": False},
          f"calibration {result['calibration']}")
    check(result["settings"]["endpoint"] == "completions", "endpoint")
    check(result["model_label"] is None, "a real model labelled synthetic")
    with open(shared) as f:
        result = json.load(f)
    run = result["runs"][0]
    check_run(run, 3, scored=0)
    # Every request started from a copy of the held shared part (the CPU's full attention
    # forks): 89 of its 90 prompt tokens were not prefilled again.
    check([r["cached_tokens"] for r in run["records"]] == [89] * 3,
          f"cached tokens {[r['cached_tokens'] for r in run['records']]}")
    check(run["summary"]["engine_steps"] is not None, "no step breakdown from /metrics")
    # Two client processes: every request once, on one clock (all started near 0).
    check(sorted(r["index"] for r in run["records"]) == [0, 1, 2], "records lost or repeated")
    check(all(0 <= r["start_s"] < 5 for r in run["records"]),
          f"start times {[r['start_s'] for r in run['records']]}")
    with open(small) as f:
        result = json.load(f)
    check(result["calibration"]["vocab_size"] == 300, "--vocab-size ignored")
    check_run(result["runs"][0], 2, scored=0)
    # Seeded, per request, below the vocabulary.
    a, b = build_id_prompt(1, 0, 500, 300), build_id_prompt(1, 1, 500, 300)
    check(a.text == build_id_prompt(1, 0, 500, 300).text, "ids not reproducible")
    check(a.text != b.text, "two requests share a prompt")
    check(all(0 <= t < 300 for t in a.text + b.text), "ids outside the vocabulary")


def test_bad_arguments(binary, work):
    done = run_bench("--concurrency", "0", expect_ok=False)
    check(done.returncode != 0 and "--concurrency" in done.stderr, "--concurrency 0 accepted")
    bad = os.path.join(work, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"prompt": "fine"}\n{"prompt": 3}\n')
    # Refused before any server starts: the binary is never run.
    done = run_bench("--binary", "/nonexistent", "--prompts-file", bad, expect_ok=False)
    check(done.returncode != 0 and "bad.jsonl:2" in done.stderr, f"bad file: {done.stderr}")
    for args, needle in ((["--prompt-ids", "8", "--endpoint", "chat"], "only /v1/completions"),
                         (["--prompt-ids", "0"], "--prompt-ids must be"),
                         (["--vocab-size", "100"], "goes with --prompt-ids"),
                         (["--synthetic", "llama3-8b", "--base-url", "http://127.0.0.1:1"],
                          "--synthetic starts a server")):
        done = run_bench("--binary", "/nonexistent", *args, expect_ok=False)
        check(done.returncode != 0 and needle in done.stderr, f"{args}: {done.stderr[-500:]}")


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as work:
        result = run_tests([test_bad_arguments, test_concurrency_two_policies,
                            test_poisson_passkey, test_prompt_ids], binary, work)
    finish(*result)


if __name__ == "__main__":
    main()
