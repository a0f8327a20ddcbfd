"""Multi-turn KV reuse: turn 2 extends turn 1's conversation, starts from turn 1's held KV state
(usage.prompt_tokens_details.cached_tokens), answers a question about turn 1's content, and gives
the answer of the same turn prefilled from scratch. (How much sooner its first token comes is
bench/multiturn_ttft.py's to measure.)"""
import sys

from harness import Server, check, client, finish, run_tests

STORY = (
    "Here is a note about my trip. Last spring I travelled to a small town by the sea. "
    "The streets were narrow and the houses were painted in bright colours. Every morning I "
    "walked along the harbour and watched the fishing boats come in. The people there were "
    "friendly and the food was simple and good. I stayed in a little hotel with a view of the "
    "water. In the evenings I read books on the balcony and listened to the waves. ") * 4


def ask(api, messages, **extra):
    """Streams one chat turn: (answer, usage)."""
    text, usage = [], None
    for chunk in api.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    return "".join(text), usage


def conversation(api, policy):
    turn1 = [{"role": "user", "content": STORY + "My dog is called Biscuit. Please remember "
                                                  "the name of my dog."}]
    answer1, usage1 = ask(api, turn1, kv_policy=policy)
    print(f"  [{policy}] turn 1 ({usage1.prompt_tokens} prompt tokens): {answer1!r}")
    check(usage1.prompt_tokens_details.cached_tokens == 0, "turn 1 reused something")
    turn2 = turn1 + [{"role": "assistant", "content": answer1},
                     {"role": "user", "content": "What is the name of my dog?"}]
    # Prefill from scratch first (kv_reuse false) so that the held state is still there after.
    answer_fresh, usage_fresh = ask(api, turn2, kv_policy=policy, kv_reuse=False)
    answer2, usage2 = ask(api, turn2, kv_policy=policy)
    cached = usage2.prompt_tokens_details.cached_tokens
    print(f"  [{policy}] turn 2 ({usage2.prompt_tokens} prompt tokens, {cached} reused): "
          f"answer {answer2!r}, from scratch {answer_fresh!r}")
    check(usage_fresh.prompt_tokens_details.cached_tokens == 0, "kv_reuse=false reused")
    check(usage_fresh.prompt_tokens == usage2.prompt_tokens,
          f"the same turn counted {usage_fresh.prompt_tokens} prompt tokens from scratch, "
          f"{usage2.prompt_tokens} with reuse")
    check(cached >= usage1.prompt_tokens, f"turn 2 reused {cached} < turn 1's prompt "
                                          f"{usage1.prompt_tokens} tokens")
    check(cached < usage2.prompt_tokens, "reused more than the prompt")
    check("Biscuit" in answer2, f"turn 2 does not name the dog: {answer2!r}")
    check("Biscuit" in answer_fresh, f"turn 2 from scratch does not name the dog: {answer_fresh!r}")
    return cached


def test_full_attention_reuse(server):
    cached = conversation(client(server), "full")
    m = server.metrics()
    check(m["shadowkv_reused_prompt_tokens_total"] >= cached, "reused tokens not in /metrics")


def test_shadowkv_reuse(server):
    # The story (~500 tokens) is past ShadowKV's budget of 256: turn 1 is compressed, and turn 2's
    # tokens join its low-rank basis, landmarks and value store.
    conversation(client(server), "shadowkv")


def main():
    with Server(sys.argv[1]) as server:
        result = run_tests([test_full_attention_reuse, test_shadowkv_reuse], server)
    finish(*result)


if __name__ == "__main__":
    main()
