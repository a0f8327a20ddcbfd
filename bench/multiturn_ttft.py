#!/usr/bin/env python3
"""Time to first token of a second chat turn with and without multi-turn KV reuse.

Starts `shadowkv serve` (the e2e harness's Server) and, per KV policy and round, sends the
conversation of tests/e2e/test_multiturn.py: turn 1, then turn 2 prefilled from scratch
(kv_reuse false), then turn 2 from turn 1's held state. Reports the median TTFT of each and
their ratio; the e2e test checks only what reuse must get right (cached tokens, the answer).

  python3 bench/multiturn_ttft.py build/shadowkv --policies full,shadowkv --rounds 5
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))
from harness import Server, client  # noqa: E402
from test_multiturn import STORY  # noqa: E402


def ttft(api, messages, **extra):
    """Seconds to the first content token of one streamed turn, and the answer."""
    start = time.perf_counter()
    first, text = None, []
    for chunk in api.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                             temperature=0, stream=True, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    return (first or time.perf_counter()) - start, "".join(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("--policies", default="full,shadowkv")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with Server(args.binary) as server:
        api = client(server)
        for policy in args.policies.split(","):
            fresh, reused = [], []
            for round_index in range(args.rounds):
                # A distinct first line per round, so that no round reuses an earlier one's state.
                turn1 = [{"role": "user", "content": f"Note {round_index}. " + STORY +
                          "My dog is called Biscuit. Please remember the name of my dog."}]
                _, answer1 = ttft(api, turn1, kv_policy=policy)
                turn2 = turn1 + [{"role": "assistant", "content": answer1},
                                 {"role": "user", "content": "What is the name of my dog?"}]
                fresh.append(ttft(api, turn2, kv_policy=policy, kv_reuse=False)[0])
                reused.append(ttft(api, turn2, kv_policy=policy)[0])
            f, r = statistics.median(fresh), statistics.median(reused)
            print(f"{policy}: turn-2 TTFT median {r * 1000:.1f} ms with reuse, "
                  f"{f * 1000:.1f} ms from scratch ({f / r:.2f}x), {args.rounds} rounds")


if __name__ == "__main__":
    main()
