#!/usr/bin/env python3
"""Throughput of `shadowkv serve` under concurrent streaming load, one server per KV policy.

Starts the server on a free loopback port for each policy (--kv POLICY), sends --requests
streaming chat requests from --concurrency client threads (distinct long prompts, greedy,
ignore_eos so every request generates exactly --max-tokens), and reports requests/s, generated
tokens/s, time to first token (p50/p99) and inter-token latency (p50/p99). Standard library only.

  python3 bench/serve_load.py --binary build/shadowkv --policies full,shadowkv
"""
import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

PASSAGE = ("The committee met on a grey morning to review the harbour accounts. Each ledger was "
           "read aloud, the figures were checked twice, and every discrepancy was noted in the "
           "margin for the clerk to resolve before the next session. ")


def default_model():
    cache = os.environ.get("SHADOWKV_CACHE") or os.path.expanduser("~/.cache/shadowkv")
    return os.environ.get("SHADOWKV_MODEL") or os.path.join(cache,
                                                            "SmolLM2-135M-Instruct.Q4_1.gguf")


def percentile(values, fraction):
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def start_server(args, policy):
    command = [args.binary, "serve", "-m", args.model, "--host", "127.0.0.1", "--port", "0",
               "--kv", policy, "--max-batch", str(args.max_batch), *args.server_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    line = process.stdout.readline()
    match = re.search(r"http://([\d.]+):(\d+)", line)
    if not match:
        process.kill()
        sys.exit(f"serve_load: the server did not start: {line!r}")
    threading.Thread(target=process.stdout.read, daemon=True).start()
    return process, match.group(1), int(match.group(2))


def one_request(host, port, index, args):
    """Streams one request; returns (ttft seconds, [token arrival times], end time)."""
    words = PASSAGE * max(1, args.prompt_tokens // 40)
    body = json.dumps({
        "messages": [{"role": "user", "content": f"Request {index}. {words}\nSummarise the "
                                                 "notes above in one sentence."}],
        "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    start = time.time()
    connection = http.client.HTTPConnection(host, port, timeout=3600)
    connection.request("POST", "/v1/chat/completions", body=body,
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    arrivals, usage = [], None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            if choice.get("delta", {}).get("content"):
                arrivals.append(time.time())
    connection.close()
    return start, arrivals, usage


def run_policy(args, policy):
    process, host, port = start_server(args, policy)
    results = []
    lock = threading.Lock()
    next_index = [0]

    def worker():
        while True:
            with lock:
                if next_index[0] >= args.requests:
                    return
                index = next_index[0]
                next_index[0] += 1
            outcome = one_request(host, port, index, args)
            with lock:
                results.append(outcome)

    began = time.time()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - began
    process.send_signal(signal.SIGTERM)
    process.wait(60)

    ttft = [arrivals[0] - start for start, arrivals, _ in results if arrivals]
    gaps = [b - a for _, arrivals, _ in results for a, b in zip(arrivals, arrivals[1:])]
    generated = sum(u["completion_tokens"] for _, _, u in results)
    prompt = statistics.mean(u["prompt_tokens"] for _, _, u in results)
    return {"policy": policy, "requests": len(results), "seconds": elapsed,
            "prompt_tokens_mean": prompt, "generated_tokens": generated,
            "requests_per_s": len(results) / elapsed, "tokens_per_s": generated / elapsed,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/shadowkv")
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--policies", default="full,shadowkv")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="approximate")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("server_args", nargs="*", help="more `shadowkv serve` flags (after --)")
    args = parser.parse_args()

    rows = [run_policy(args, policy) for policy in args.policies.split(",")]
    print(f"{args.requests} requests, {args.concurrency} concurrent, prompt ~"
          f"{rows[0]['prompt_tokens_mean']:.0f} tokens, {args.max_tokens} generated each")
    print("| policy | requests/s | generated tokens/s | TTFT p50 | TTFT p99 | "
          "inter-token p50 | inter-token p99 | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['requests_per_s']:.3f} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s | {1000 * r['itl_p50']:.0f} ms | "
              f"{1000 * r['itl_p99']:.0f} ms | {r['seconds']:.1f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
