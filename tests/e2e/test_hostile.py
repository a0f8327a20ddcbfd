"""Hostile input: malformed JSON, wrong types, huge and negative numbers, invalid UTF-8, oversized
and truncated bodies, garbage bytes, unknown routes, prompts past the context, and clients that
vanish mid-stream. Every answer must be the right 4xx with an OpenAI error body, and the server
must stay healthy and keep serving."""
import json
import socket
import sys
import time

from harness import Server, check, finish, parse_responses, raw_exchange, run_tests

MAX_BODY_KIB = 256


def expect_error(server, path, body, status, param=None, code=None, raw=False):
    got, _, data = server.request("POST", path, body if raw else json.dumps(body))
    check(got == status, f"{str(body)[:80]!r}: status {got}, expected {status}: {data[:300]!r}")
    error = json.loads(data)["error"]
    check(set(error) == {"message", "type", "param", "code"}, f"error body {error}")
    check(error["message"], "empty error message")
    if param is not None:
        check(error["param"] == param, f"param {error['param']!r}, expected {param!r}")
    if code is not None:
        check(error["code"] == code, f"code {error['code']!r}, expected {code!r}")


def test_bad_json_and_types(server):
    chat = "/v1/chat/completions"
    for body in [b"", b"{", b"nope", b"{\"prompt\": }", b"[1,2]", b"{\"prompt\": \"a\"} x",
                 b"[" * 100000 + b"]" * 100000]:
        expect_error(server, "/v1/completions", body, 400, code="invalid_json", raw=True)
    expect_error(server, "/v1/completions", {"prompt": 12}, 400, "prompt")
    expect_error(server, "/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens")
    expect_error(server, "/v1/completions", {"prompt": "a", "stream": "true"}, 400, "stream")
    expect_error(server, "/v1/completions", {"prompt": "a", "stop": {"x": 1}}, 400, "stop")
    expect_error(server, chat, {"messages": "hello"}, 400, "messages")
    expect_error(server, chat, {"messages": [{"role": 5, "content": "x"}]}, 400,
                 "messages[0].role")
    expect_error(server, chat, {"messages": [{"role": "user", "content": None}]}, 400,
                 "messages[0].content")
    expect_error(server, chat, {"messages": [{"role": "user", "content": "x"}],
                                "kv_policy": "bogus"}, 400, "kv_policy")


def test_numbers(server):
    for field, value in [("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 10**30),
                         ("max_tokens", 1.5), ("temperature", -1), ("temperature", 1e308),
                         ("top_p", 0), ("top_p", 7), ("n", 5), ("kv_budget", -3),
                         ("seed", 10**40)]:
        expect_error(server, "/v1/completions", {"prompt": "a", field: value}, 400, field)
    # NaN and Infinity are not JSON.
    expect_error(server, "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400,
                 code="invalid_json", raw=True)


def test_invalid_utf8(server):
    for bad in [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80"]:
        expect_error(server, "/v1/completions", b'{"prompt": "hi ' + bad + b'"}', 400,
                     code="invalid_json", raw=True)


def test_context_limits(server):
    long_prompt = "hello " * 9000  # about 9000 tokens, past the 8192-token context
    expect_error(server, "/v1/completions", {"prompt": long_prompt}, 400, "prompt",
                 "context_length_exceeded")
    expect_error(server, "/v1/completions", {"prompt": "a", "max_tokens": 9000}, 400,
                 "max_tokens", "context_length_exceeded")
    expect_error(server, "/v1/completions", {"prompt": [49152]}, 400, "prompt")
    expect_error(server, "/v1/completions", {"prompt": ""}, 400, "prompt", "empty_prompt")
    # A byte the default vocabulary has no token for encodes to nothing: the refusal says so
    # rather than calling the prompt empty.
    got, _, data = server.request("POST", "/v1/completions", json.dumps({"prompt": "\x04"}))
    message = json.loads(data)["error"]["message"] if got == 400 else ""
    check(got == 400 and "vocabulary" in message, f"unspellable prompt: {got} {data[:200]!r}")


def test_sizes_routes_and_garbage(server):
    big = json.dumps({"prompt": "x" * (MAX_BODY_KIB * 1024 + 10)})
    expect_error(server, "/v1/completions", big, 413, code="body_too_large", raw=True)
    got, _, data = server.request("GET", "/v1/nothing")
    check(got == 404 and json.loads(data)["error"]["code"] == "unknown_url", f"404: {got}")
    got, headers, data = server.request("GET", "/v1/completions")
    check(got == 405 and headers.get("allow") == "POST", f"GET on a POST route: {got} {headers}")
    check(json.loads(data)["error"]["code"] == "method_not_allowed", f"405 body {data!r}")
    # Truncated body (Content-Length promises more than arrives before the client hangs up),
    # non-HTTP bytes, a head past the limit, a negative length: each a clear refusal.
    for payload, status in [
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro", 400),
            (b"\x00\x01\x02garbage\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"A" * 70000, 431),
            (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400)]:
        got, _, data = parse_responses(raw_exchange(server.host, server.port, payload, 10))[0]
        check(got == status, f"{payload[:40]!r}: status {got}, expected {status}")
        check(json.loads(data)["error"]["message"], f"{payload[:40]!r}: no error message")
    check(server.healthy(), "unhealthy after garbage")


def test_disconnects_mid_stream(server):
    body = json.dumps({"prompt": "Tell me a long story about dragons.", "max_tokens": 2000,
                       "stream": True, "temperature": 0, "ignore_eos": True}).encode()
    for _ in range(4):
        s = socket.create_connection((server.host, server.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: ") < 3:
            received += s.recv(4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # abrupt: RST, mid-stream
    # The sequences are freed at a following step (once a write to the socket fails).
    deadline = time.time() + 20
    while time.time() < deadline:
        if server.metrics()["shadowkv_running_sequences"] == 0:
            break
        time.sleep(0.2)
    m = server.metrics()
    check(m["shadowkv_running_sequences"] == 0, "abandoned streams still running")
    check(m["shadowkv_generated_tokens_total"] < 4 * 2000, "abandoned streams ran to the end")


def test_still_serving(server):
    check(server.healthy(), "/health not ok at the end")
    got, _, data = server.request("POST", "/v1/completions",
                                  {"prompt": "The capital of France is", "max_tokens": 4,
                                   "temperature": 0})
    check(got == 200 and json.loads(data)["choices"][0]["text"], f"normal request: {got} {data}")


def main():
    with Server(sys.argv[1], "--max-body", str(MAX_BODY_KIB)) as server:
        result = run_tests([test_bad_json_and_types, test_numbers, test_invalid_utf8,
                            test_context_limits, test_sizes_routes_and_garbage,
                            test_disconnects_mid_stream, test_still_serving], server)
    finish(*result)


if __name__ == "__main__":
    main()
