"""Per-request timeout (504, or an error event in a stream) and graceful shutdown: SIGTERM
while a stream runs lets it finish, refuses new work with 503 (held open by a second stream too
long to finish within the grace, which is then ended with an error event), and the process
exits 0."""
import json
import signal
import socket
import sys
import time

from harness import Server, check, finish, run_tests


def test_timeout(server):
    body = {"prompt": "A very long story:", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}
    status, _, data = server.request("POST", "/v1/completions", body)
    error = json.loads(data)["error"]
    check(status == 504 and error["code"] == "request_timeout", f"{status} {error}")
    status, _, data = server.request("POST", "/v1/completions", dict(body, stream=True))
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    check(status == 200 and events[-1] == "[DONE]", f"stream ended with {events[-1:]}")
    check(json.loads(events[-2])["error"]["code"] == "request_timeout", f"{events[-2]}")
    check(len(events) > 3, "the stream sent no tokens before the timeout")
    check(server.healthy(), "unhealthy after timeouts")


def open_stream(server, prompt, max_tokens):
    """A streaming completion on a raw socket, returned once its first two events have come (so
    the request is running, not queued): (socket, the bytes read so far)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection((server.host, server.port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
              str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 2:
        chunk = s.recv(4096)
        check(chunk, f"the stream closed early: {received[-300:]!r}")
        received += chunk
    return s, received


def finish_stream(s, received):
    """Reads a stream to its [DONE] event: its SSE data payloads, de-chunked."""
    while b"data: [DONE]" not in received:
        chunk = s.recv(4096)
        if not chunk:
            break
        received += chunk
    s.close()
    head, _, rest = received.partition(b"\r\n\r\n")
    check(b" 200 " in head.split(b"\r\n")[0], f"stream answered {head[:80]!r}")
    body = b""
    while b"\r\n" in rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0 or len(rest) < size:
            break
        body, rest = body + rest[:size], rest[size + 2:]
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


def test_sigterm_finishes_running_stream(server):
    # `short` must finish its 40 tokens within the grace. `long` asks for nearly the whole 8K
    # context, which no CPU run of this model decodes within the 10 s grace (it would take
    # 800 tokens/s): it keeps the server draining, so the 503 window is open for all of the
    # checks below however soon `short` ends, and it is then cut off with an error event.
    short, short_received = open_stream(server, "Count slowly:", 40)
    long_stream, long_received = open_stream(server, "Tell a very long story:", 8000)
    server.process.send_signal(signal.SIGTERM)
    # The signal is handled on a thread of its own: wait (bounded) until /health says so.
    for _ in range(200):
        status, _, data = server.request("GET", "/health", timeout=10)
        if status == 503:
            break
        check(status == 200, f"/health answered {status}")
        time.sleep(0.05)
    check(status == 503 and json.loads(data)["status"] == "shutting_down",
          f"/health after SIGTERM: {status} {data[:200]!r}")
    # New work is refused, with a reason and a time to retry after, while both streams run.
    status, headers, data = server.request("POST", "/v1/completions", {"prompt": "x"},
                                           timeout=10)
    check(status == 503, f"a request during shutdown got {status}")
    check(json.loads(data)["error"]["code"] == "shutting_down", f"{data[:200]!r}")
    check(headers.get("retry-after"), f"no Retry-After on the 503: {headers}")

    events = finish_stream(short, short_received)
    check(events and events[-1] == "[DONE]", "the running stream was cut off by SIGTERM")
    check(any('"finish_reason":"length"' in event for event in events),
          f"the running stream did not finish its 40 tokens: {events[-3:]}")
    events = finish_stream(long_stream, long_received)
    check(events and events[-1] == "[DONE]", f"the long stream ended with {events[-1:]}")
    check(json.loads(events[-2]).get("error", {}).get("code") == "shutting_down",
          f"the long stream was not ended by the grace's end: {events[-2]}")
    check(server.process.wait(60) == 0, f"exit code {server.process.returncode}")


def main():
    with Server(sys.argv[1], "--timeout", "2") as server:
        result = run_tests([test_timeout], server)
    with Server(sys.argv[1], "--shutdown-grace", "10") as server:
        more = run_tests([test_sigterm_finishes_running_stream], server)
    finish(result[0] + more[0], result[1] + more[1])


if __name__ == "__main__":
    main()
