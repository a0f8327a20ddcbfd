"""Per-request timeout (504, or an error event in a stream) and graceful shutdown: SIGTERM
while a stream runs lets it finish, refuses new work with 503, and the process exits 0."""
import json
import signal
import socket
import sys
import threading
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


def test_sigterm_finishes_running_stream(server):
    body = json.dumps({"prompt": "Count slowly:", "max_tokens": 40, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection((server.host, server.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
              str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 2:
        received += s.recv(4096)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # New work is refused while the running stream finishes (the listener may already be gone).
    try:
        status, _, _ = server.request("POST", "/v1/completions", {"prompt": "x"}, timeout=10)
        check(status == 503, f"a request during shutdown got {status}")
    except (ConnectionError, OSError):
        pass
    while b"data: [DONE]" not in received:
        chunk = s.recv(4096)
        if not chunk:
            break
        received += chunk
    s.close()
    text = received.decode()
    check("data: [DONE]" in text, "the running stream was cut off by SIGTERM")
    check('"finish_reason":"length"' in text, "the running stream did not finish its 40 tokens")
    check(server.process.wait(60) == 0, f"exit code {server.process.returncode}")


def main():
    with Server(sys.argv[1], "--timeout", "2") as server:
        result = run_tests([test_timeout], server)
    with Server(sys.argv[1], "--shutdown-grace", "60") as server:
        more = run_tests([test_sigterm_finishes_running_stream], server)
    finish(result[0] + more[0], result[1] + more[1])


if __name__ == "__main__":
    main()
