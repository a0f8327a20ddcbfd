"""Continuous batching under load: 32 concurrent streaming greedy chat requests of mixed prompt
and output lengths. Each output must equal the same request run alone; none may be lost; the
metrics must account for every request and token."""
import sys
import threading
import time

from harness import Server, check, client, finish, run_tests

REQUESTS = 32
TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "rain", "a library", "trains",
          "bread", "winter", "a garden", "music"]


def request_spec(i):
    # Mixed prompt lengths (a sentence to a few hundred tokens) and output lengths (3 to 24).
    topic = TOPICS[i % len(TOPICS)]
    padding = " ".join(["Here is some background about " + topic + "."] * (i % 4) * 4)
    content = f"{padding} Write one short sentence about {topic}. (request {i})".strip()
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3 + (i * 7) % 22}


def stream_one(api, spec, out, index, barrier=None):
    if barrier:
        barrier.wait()
    start = time.time()
    text, usage, first = [], None, None
    for chunk in api.chat.completions.create(model="m", stream=True, temperature=0,
                                             stream_options={"include_usage": True}, **spec):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.time()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    out[index] = {"text": "".join(text), "usage": usage, "ttft": (first or time.time()) - start,
                  "seconds": time.time() - start}


def test_concurrent_equals_alone(server):
    api = client(server)
    specs = [request_spec(i) for i in range(REQUESTS)]
    before = server.metrics()
    alone = [None] * REQUESTS
    start = time.time()
    for i, spec in enumerate(specs):
        stream_one(api, spec, alone, i)
    alone_seconds = time.time() - start

    together = [None] * REQUESTS
    barrier = threading.Barrier(REQUESTS)
    threads = [threading.Thread(target=stream_one, args=(api, spec, together, i, barrier))
               for i, spec in enumerate(specs)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    together_seconds = time.time() - start
    print(f"  {REQUESTS} requests: one at a time {alone_seconds:.1f} s, together "
          f"{together_seconds:.1f} s", flush=True)

    lost = [i for i, r in enumerate(together) if r is None or r["usage"] is None]
    check(not lost, f"requests lost or without usage: {lost}")
    mismatched = [i for i in range(REQUESTS) if together[i]["text"] != alone[i]["text"]]
    for i in mismatched:
        print(f"  request {i}: alone {alone[i]['text']!r}\n  together {together[i]['text']!r}")
    check(not mismatched, f"outputs differ from the same request run alone: {mismatched}")
    for i in range(REQUESTS):
        check(together[i]["usage"].completion_tokens == alone[i]["usage"].completion_tokens,
              f"request {i}: token counts differ")
        check(together[i]["usage"].completion_tokens <= specs[i]["max_tokens"], "max_tokens")
    check(len({r["text"] for r in together}) > REQUESTS // 2, "outputs suspiciously alike")

    # Every request and token is in /metrics (the logger counts a stream once it has ended, and
    # the engine drops a finished sequence from its gauges at its next step: poll for both).
    generated = sum(r["usage"].completion_tokens for r in alone + together)
    prompt = sum(r["usage"].prompt_tokens for r in alone + together)
    key = 'shadowkv_requests_total{endpoint="/v1/chat/completions",status="200"}'
    deadline = time.time() + 10
    while True:
        after = server.metrics()
        counted = after.get(key, 0) - before.get(key, 0)
        idle = after["shadowkv_running_sequences"] == 0 and after["shadowkv_queue_depth"] == 0
        if (counted >= 2 * REQUESTS and idle) or time.time() > deadline:
            break
        time.sleep(0.2)
    print(f"  /metrics: {counted:.0f} requests, "
          f"{after['shadowkv_generated_tokens_total'] - before.get('shadowkv_generated_tokens_total', 0):.0f} "
          f"generated tokens (clients counted {generated})")
    check(counted == 2 * REQUESTS, f"{key} grew by {counted}, expected {2 * REQUESTS}")
    grown = lambda name: after[name] - before.get(name, 0)
    check(grown("shadowkv_generated_tokens_total") == generated,
          f"generated tokens {grown('shadowkv_generated_tokens_total')} != {generated}")
    check(grown("shadowkv_prompt_tokens_total") == prompt,
          f"prompt tokens {grown('shadowkv_prompt_tokens_total')} != {prompt}")
    check(grown("shadowkv_time_to_first_token_seconds_count") == 2 * REQUESTS, "TTFT count")
    check(after["shadowkv_running_sequences"] == 0 and after["shadowkv_queue_depth"] == 0,
          "work left over")
    ttfts = sorted(r["ttft"] for r in together)
    print(f"  together: TTFT p50 {ttfts[len(ttfts) // 2]:.2f} s, max {ttfts[-1]:.2f} s")


def main():
    # Fewer batch slots than requests: later requests queue, then join the running batch.
    with Server(sys.argv[1], "--max-batch", "16", "--max-queue", "64") as server:
        result = run_tests([test_concurrent_equals_alone], server)
    finish(*result)


if __name__ == "__main__":
    main()
