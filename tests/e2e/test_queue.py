"""The queue bound: a burst past batch slots + queue gets 429 with Retry-After and an OpenAI
error body; every accepted request still completes; /metrics counts both."""
import json
import sys
import threading
import time

import openai

from harness import Server, check, client, finish, run_tests

BATCH, QUEUE, BURST = 2, 3, 14


def test_burst_past_the_queue(server):
    results = [None] * BURST
    barrier = threading.Barrier(BURST)

    def raw(i):
        barrier.wait()
        body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        results[i] = server.request("POST", "/v1/completions", body)

    threads = [threading.Thread(target=raw, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    statuses = [r[0] for r in results]
    print(f"  statuses: {statuses}")
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    check(len(accepted) + len(refused) == BURST, f"unexpected statuses {statuses}")
    # At most BATCH running + QUEUE waiting at the burst; the rest are refused.
    check(len(refused) >= BURST - BATCH - QUEUE - 1, f"too few 429s: {statuses}")
    check(len(accepted) >= BATCH, f"too few accepted: {statuses}")
    for status, headers, body in refused:
        error = json.loads(body)["error"]
        check(error["type"] == "rate_limit_error" and error["code"] == "queue_full", error)
        check(int(headers["retry-after"]) >= 1, f"Retry-After {headers.get('retry-after')}")
    for status, headers, body in accepted:
        reply = json.loads(body)
        check(reply["usage"]["completion_tokens"] == 24, f"accepted request cut short: {reply}")
        check(reply["choices"][0]["finish_reason"] == "length", reply)

    # The official client sees the same refusal as RateLimitError.
    api = client(server)
    errors = []

    def sdk(i):
        try:
            api.completions.create(model="m", prompt=f"Tale {i}", max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
        except openai.RateLimitError as error:
            errors.append(error)

    threads = [threading.Thread(target=sdk, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    check(errors, "no RateLimitError from the openai client")

    # A response is counted once it has been sent: poll until the last ones are in.
    key = 'shadowkv_requests_total{endpoint="/v1/completions",status="429"}'
    ok_key = 'shadowkv_requests_total{endpoint="/v1/completions",status="200"}'
    expected = {key: len(refused) + len(errors), ok_key: len(accepted) + BURST - len(errors)}
    deadline = time.time() + 10
    while True:
        m = server.metrics()
        if all(m.get(k, 0) >= v for k, v in expected.items()) or time.time() > deadline:
            break
        time.sleep(0.2)
    for k, v in expected.items():
        check(m.get(k, 0) == v, f"{k} = {m.get(k)}, expected {v}")
    check(server.healthy(), "unhealthy after the burst")


def main():
    with Server(sys.argv[1], "--max-batch", str(BATCH), "--max-queue", str(QUEUE)) as server:
        result = run_tests([test_burst_past_the_queue], server)
    finish(*result)


if __name__ == "__main__":
    main()
