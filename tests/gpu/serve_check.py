"""`shadowkv serve --device cuda` end to end, for a GPU machine (scripts/cuda_device_run.sh serve):
concurrent completions beyond the GPU pool, streaming, greedy repeatability, refusals of other
KV settings and of prompts past --ctx-size, /metrics, and a clean SIGTERM exit.

Usage: python3 serve_check.py SHADOWKV_BINARY MODEL.gguf|synthetic:NAME [serve flags...]
Token-id prompts: any GGUF works (the tiny random models of the GPU tests included), and so do
random weights (synthetic:smollm2-135m: `serve --synthetic smollm2-135m`, whose /v1/models and
/metrics must then say so)."""
import json
import os
import random
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from harness import Server, check, finish, run_tests  # noqa: E402

CONTEXT = int(os.environ.get("SERVE_CHECK_CONTEXT", "1024"))  # --ctx-size on the GPU
CUDA = "cuda" in sys.argv[3:]
SYNTHETIC = len(sys.argv) > 2 and sys.argv[2].startswith("synthetic:")


def completion(server, prompt, max_tokens, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update(extra)
    status, _, data = server.request("POST", "/v1/completions", body, timeout=300)
    return status, json.loads(data)


def prompt_of(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def test_concurrent_requests_beyond_the_pool(server):
    lengths = [12, 700, 40, 260, 5, 500, 90, 333]  # long ones compress under shadowkv
    results = [None] * len(lengths)

    def run(i):
        results[i] = completion(server, prompt_of(lengths[i], i), 24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lengths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i, (status, body) in enumerate(results):
        check(status == 200, f"request {i}: {status} {body}")
        choice = body["choices"][0]
        check(choice["finish_reason"] == "length", f"request {i}: {choice}")
        check(body["usage"]["completion_tokens"] == 24, f"request {i}: {body['usage']}")
        check(body["usage"]["prompt_tokens"] == lengths[i], f"request {i}: {body['usage']}")


def test_greedy_is_repeatable(server):
    prompt = prompt_of(300, 77)
    first = completion(server, prompt, 16, kv_reuse=False)
    second = completion(server, prompt, 16, kv_reuse=False)
    check(first[0] == 200 and second[0] == 200, f"{first} {second}")
    check(first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"],
          f"{first[1]['choices'][0]['text']!r} != {second[1]['choices'][0]['text']!r}")


def test_streaming(server):
    body = {"prompt": prompt_of(200, 5), "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True}
    status, headers, data = server.request("POST", "/v1/completions", body, timeout=300)
    check(status == 200 and headers.get("content-type", "").startswith("text/event-stream"),
          f"{status} {headers}")
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    check(events and events[-1] == "[DONE]", f"stream ends with {events[-1:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    check(chunks[-1]["choices"][0]["finish_reason"] == "length", f"{chunks[-1]}")


def test_refusals(server):
    if CUDA:
        status, body = completion(server, prompt_of(10, 1), 4, kv_policy="snapkv")
        check(status == 400 and "one KV setting" in body["error"]["message"], f"{status} {body}")
    status, body = completion(server, prompt_of(CONTEXT, 2), 4)
    check(status == 400 and body["error"]["code"] == "context_length_exceeded", f"{status} {body}")
    status, body = completion(server, prompt_of(CONTEXT - 10, 3), 20)
    check(status == 400 and body["error"]["code"] == "context_length_exceeded", f"{status} {body}")


def test_synthetic_weights_say_so(server):
    status, _, data = server.request("GET", "/v1/models")
    check(status == 200, f"/v1/models answered {status}")
    entry = json.loads(data)["data"][0]
    if CUDA:
        check(entry["context_length"] == CONTEXT, f"context_length {entry['context_length']}")
    status, _, metrics = server.request("GET", "/metrics")
    check(status == 200, f"/metrics answered {status}")
    if SYNTHETIC:
        check(entry.get("weights") == "synthetic" and "SYNTHETIC" in entry.get("label", ""),
              f"/v1/models entry {entry}")
        check(server.metrics().get("shadowkv_synthetic_weights") == 1.0, "no synthetic series")
        check(b"# SYNTHETIC WEIGHTS" in metrics, "no label in /metrics")
    else:
        check("weights" not in entry and "label" not in entry, f"/v1/models entry {entry}")
        check(b"synthetic" not in metrics, "a real model's /metrics says synthetic")


def test_metrics_count_the_tokens(server):
    values = server.metrics()
    generated = sum(v for k, v in values.items() if k.startswith("shadowkv_generated_tokens_total"))
    check(generated >= 8 * 24, f"generated tokens {generated}")


if __name__ == "__main__":
    binary, model = sys.argv[1], sys.argv[2]
    weights = ["--synthetic", model.split(":", 1)[1]] if SYNTHETIC else ["-m", model]
    flags = ["--ctx-size", str(CONTEXT)] if CUDA else []
    with Server(binary, *flags, *sys.argv[3:], weights=weights) as server:
        passed, failed = run_tests([test_concurrent_requests_beyond_the_pool,
                                    test_greedy_is_repeatable, test_streaming, test_refusals,
                                    test_synthetic_weights_say_so,
                                    test_metrics_count_the_tokens], server)
    finish(passed, failed)
