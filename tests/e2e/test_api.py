"""The OpenAI API surface through the official client: completions and chat, streamed and not,
usage, stop sequences, max_tokens, seeds, KV policy override, models, health, metrics; a server
started with a KV variant."""
import subprocess
import sys

from harness import Server, check, client, finish, model_path, run_tests

GREEDY = {"temperature": 0}


def test_models_and_health(server):
    models = client(server).models.list()
    check(len(models.data) == 1, f"one model expected, got {models.data}")
    check(models.data[0].id.startswith("SmolLM2-135M-Instruct"), f"model id {models.data[0].id}")
    check(server.healthy(), "/health is not ok")


def test_completion_whole_and_streamed(server):
    api = client(server)
    whole = api.completions.create(model="m", prompt="The capital of France is", max_tokens=8,
                                   **GREEDY)
    text = whole.choices[0].text
    print(f"  completion: {text!r}")
    check(text.strip(), "empty completion")
    check(whole.object == "text_completion", f"object {whole.object}")
    check(whole.usage.prompt_tokens == 5, f"prompt tokens {whole.usage.prompt_tokens}")
    check(1 <= whole.usage.completion_tokens <= 8, f"usage {whole.usage}")
    check(whole.usage.total_tokens == 5 + whole.usage.completion_tokens, "total tokens")
    check(whole.choices[0].finish_reason in ("stop", "length"), whole.choices[0].finish_reason)
    pieces = []
    reasons = []
    for chunk in api.completions.create(model="m", prompt="The capital of France is",
                                        max_tokens=8, stream=True, **GREEDY):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    check("".join(pieces) == text, f"streamed {''.join(pieces)!r} != whole {text!r}")
    check(reasons[-1] == whole.choices[0].finish_reason and all(r is None for r in reasons[:-1]),
          f"finish reasons {reasons}")
    check(len([p for p in pieces if p]) >= 2, "the text came in one piece: not streamed")


def test_chat_whole_and_streamed(server):
    api = client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = api.chat.completions.create(model="m", messages=messages, max_tokens=24, **GREEDY)
    answer = whole.choices[0].message.content
    print(f"  chat: {answer!r}")
    check("Paris" in answer, f"answer without Paris: {answer!r}")
    check(whole.choices[0].message.role == "assistant", "role")
    check(whole.usage.prompt_tokens > 10, f"usage {whole.usage}")
    stream = api.chat.completions.create(model="m", messages=messages, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == answer, f"streamed {text!r} != whole {answer!r}")
    check(chunks[0].choices[0].delta.role == "assistant", "first chunk carries the role")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(finals == [whole.choices[0].finish_reason], f"finish reasons {finals}")
    usage = chunks[-1].usage
    check(usage is not None and not chunks[-1].choices, "last chunk: usage without choices")
    check(usage.completion_tokens == whole.usage.completion_tokens, f"usage {usage}")
    check(usage.prompt_tokens == whole.usage.prompt_tokens, f"usage {usage}")


def test_stop_and_max_tokens(server):
    api = client(server)
    prompt = "Count: 1, 2, 3, 4,"
    full = api.completions.create(model="m", prompt=prompt, max_tokens=12, **GREEDY)
    text = full.choices[0].text
    print(f"  counting: {text!r}")
    check(" 6" in text, f"greedy count without 6: {text!r}")
    stopped = api.completions.create(model="m", prompt=prompt, max_tokens=12, stop=[" 6"],
                                     **GREEDY)
    check(stopped.choices[0].text == text[:text.index(" 6")],
          f"stop: {stopped.choices[0].text!r} from {text!r}")
    check(stopped.choices[0].finish_reason == "stop", stopped.choices[0].finish_reason)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model="m", prompt=prompt, max_tokens=12, stop=[" 6"], stream=True, **GREEDY))
    check(streamed == stopped.choices[0].text, f"streamed stop {streamed!r}")
    one = api.completions.create(model="m", prompt=prompt, max_tokens=1, **GREEDY)
    check(one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1,
          f"max_tokens=1: {one}")


def test_seeded_sampling_repeats(server):
    api = client(server)
    args = dict(model="m", prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95)
    a = api.completions.create(seed=1234, **args).choices[0].text
    b = api.completions.create(seed=1234, **args).choices[0].text
    check(a == b, f"same seed, different text: {a!r} vs {b!r}")


def test_kv_policy_override(server):
    api = client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for policy in ("shadowkv", "snapkv", "quest", "streaming"):
        reply = api.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                            extra_body={"kv_policy": policy, "kv_budget": 256},
                                            **GREEDY)
        # The prompt is shorter than the budget: every policy attends to all of it.
        check("Paris" in reply.choices[0].message.content,
              f"{policy}: {reply.choices[0].message.content!r}")
    status, _, body = server.request("POST", "/v1/chat/completions",
                                     {"messages": messages, "kv_policy": "shadowkv",
                                      "kv_budget": 3})
    check(status == 400 and b"budget" in body, f"impossible budget: {status} {body[:200]}")


def test_metrics_count_requests(server):
    m = server.metrics()
    key = 'shadowkv_requests_total{endpoint="/v1/completions",status="200"}'
    check(m.get(key, 0) >= 8, f"{key} = {m.get(key)}")
    check(m["shadowkv_generated_tokens_total"] > 0, "no generated tokens counted")
    check(m["shadowkv_time_to_first_token_seconds_count"] >= 8, "TTFT histogram empty")
    check(m["shadowkv_running_sequences"] == 0, "sequences still running")
    check('shadowkv_kv_memory_bytes{tier="fast",owner="held"}' in m, "KV memory by tier missing")


def test_server_kv_variant(binary):
    """`serve --kv` takes one variant, as bench and eval name them; a bad one is refused."""
    with Server(binary, "--kv", "shadowkv:budget=300:rank=32") as server:
        reply = client(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, **GREEDY)
        check("Paris" in reply.choices[0].message.content, reply.choices[0].message.content)
    refused = subprocess.run([binary, "serve", "-m", model_path(), "--kv", "shadowkv:colour=red"],
                             capture_output=True, text=True, timeout=120)
    check(refused.returncode != 0 and "unknown setting 'colour'" in refused.stderr,
          f"exit {refused.returncode}: {refused.stderr[-300:]}")


def main():
    with Server(sys.argv[1]) as server:
        result = run_tests([test_models_and_health, test_completion_whole_and_streamed,
                            test_chat_whole_and_streamed, test_stop_and_max_tokens,
                            test_seeded_sampling_repeats, test_kv_policy_override,
                            test_metrics_count_requests], server)
    variant = run_tests([test_server_kv_variant], sys.argv[1])
    finish(result[0] + variant[0], result[1] + variant[1])


if __name__ == "__main__":
    main()
