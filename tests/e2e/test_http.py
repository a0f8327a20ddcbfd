"""The HTTP layer under hostile clients: the raw-request corpus in hostile_http/ (each reply's
status and error body, the server healthy after each), oversized heads, chunked bodies past
--max-body, pipelining, HTTP/1.0 streams, keep-alive and HEAD, slow senders holding more
connections than --http-threads, per-client and total connection caps, and a second server
started on a port already taken."""
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

from harness import (Server, check, finish, model_path, parse_responses, raw_exchange,
                     run_tests)

MAX_BODY_KIB = 256
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_http")
SHORT_COMPLETION = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}


def check_error(status, headers, body, what, code=None):
    check(headers.get("content-type", "").startswith("application/json"),
          f"{what}: content type {headers.get('content-type')!r}")
    error = json.loads(body)["error"]
    check(set(error) == {"message", "type", "param", "code"}, f"{what}: error body {error}")
    check(error["message"], f"{what}: empty error message")
    if code is not None:
        check(error["code"] == code, f"{what}: code {error['code']!r}, expected {code!r}")


def post_bytes(body, extra=""):
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_corpus(server):
    cases = 0
    with open(os.path.join(CORPUS, "expected.txt")) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            name, status, *code = line.split()
            with open(os.path.join(CORPUS, name), "rb") as request:
                data = request.read()
            replies = parse_responses(raw_exchange(server.host, server.port, data, timeout=20))
            check(replies, f"{name}: no reply")
            got, headers, body = replies[0]
            check(got == int(status), f"{name}: status {got}, expected {status}: {body[:200]!r}")
            if got >= 400:
                check_error(got, headers, body, name, code[0] if code else None)
            if got == 405:
                check(headers.get("allow"), f"{name}: 405 without Allow")
            check(server.healthy(), f"unhealthy after {name}")
            cases += 1
    check(cases >= 30, f"only {cases} corpus cases")


def test_oversized_heads(server):
    for what, data in [("200 KB header", b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 200000 +
                        b"\r\n\r\n"),
                       ("70 KB without a line end", b"GET / HTTP/1.1\r\nHost: x\r\n" +
                        b"A" * 70000),
                       ("500 headers", b"GET /health HTTP/1.1\r\n" +
                        b"".join(b"H%d: v\r\n" % i for i in range(500)) + b"\r\n")]:
        status, headers, body = parse_responses(raw_exchange(server.host, server.port, data))[0]
        check(status == 431, f"{what}: status {status}")
        check_error(status, headers, body, what, "header_too_large")
    check(server.healthy(), "unhealthy after oversized heads")


def send_chunked_until_reply(server, piece, total):
    """Streams a chunked body of `total` bytes in pieces; returns (reply bytes, bytes sent)."""
    s = socket.create_connection((server.host, server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    sent = 0
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    try:
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break  # the server answered before the body ended
            s.sendall(frame)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass
    reply = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    except ConnectionResetError:
        pass
    s.close()
    return reply, sent


def test_chunked_body_past_max_body(server):
    key = 'shadowkv_requests_total{endpoint="/v1/completions",status="%d"}'
    before = server.metrics()
    prompt = b'{"prompt": "' + b"hello " * 10000
    for what, piece, total in [("40 MB chunked prompt", prompt, 40 << 20),
                               ("30 MB chunked junk", b"\x00junk" * 10000, 30 << 20)]:
        reply, sent = send_chunked_until_reply(server, piece, total)
        status, headers, body = parse_responses(reply)[0]
        check(status == 413, f"{what}: status {status}: {body[:200]!r}")
        check_error(status, headers, body, what, "body_too_large")
        # Refused as the limit passed, not after the whole body (the rest sat in socket buffers).
        check(sent < total // 2, f"{what}: {sent} bytes went out before the refusal")
    after = server.metrics()
    check(after.get(key % 413, 0) == before.get(key % 413, 0) + 2, "413s not counted")
    check(after.get(key % 400, 0) == before.get(key % 400, 0), "a chunked body got 400")
    check(after["shadowkv_prompt_tokens_total"] == before["shadowkv_prompt_tokens_total"],
          "a refused body was admitted")
    # Under the limit, a chunked body is a normal request.
    body = json.dumps(SHORT_COMPLETION).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
               b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                        for i in range(0, len(body), 7)) + b"0\r\n\r\n")
    status, _, data = parse_responses(raw_exchange(server.host, server.port, chunked, 120))[0]
    check(status == 200 and json.loads(data)["choices"][0]["text"], f"chunked request: {status}")


def test_pipelining(server):
    body = json.dumps(SHORT_COMPLETION).encode()
    data = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post_bytes(body) +
            b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n" +
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    replies = parse_responses(raw_exchange(server.host, server.port, data, timeout=120))
    statuses = [r[0] for r in replies]
    check(statuses == [200, 200, 404, 200], f"pipelined replies {statuses}")
    check(json.loads(replies[0][2])["status"] == "ok", "first reply is not /health's")
    check(json.loads(replies[1][2])["object"] == "text_completion", "second is not the completion")
    check(json.loads(replies[3][2])["object"] == "list", "fourth is not /v1/models'")


def test_http10_stream(server):
    body = json.dumps(dict(SHORT_COMPLETION, max_tokens=4, stream=True)).encode()
    data = (b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body
    reply = raw_exchange(server.host, server.port, data, timeout=120)
    head, _, stream = reply.partition(b"\r\n\r\n")
    head = head.decode().lower()
    check(head.startswith("http/1.1 200"), f"status line {head.splitlines()[0]!r}")
    check("transfer-encoding" not in head, "an HTTP/1.0 client got chunked encoding")
    check("connection: close" in head, "an HTTP/1.0 stream must be delimited by the close")
    # SSE comments (": keep-alive", sent while a loaded machine has no token yet) are no events.
    events = b"".join(event + b"\n\n" for event in stream.split(b"\n\n")
                      if event and not event.startswith(b":"))
    check(events.startswith(b"data: ") and events.endswith(b"data: [DONE]\n\n"),
          f"stream body {stream[:80]!r} ... {stream[-40:]!r}")
    # HTTP/1.0 with keep-alive asked for: whole replies keep the connection.
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    connection._http_vsn, connection._http_vsn_str = 10, "HTTP/1.0"
    connection.request("GET", "/health", headers={"Connection": "keep-alive"})
    response = connection.getresponse()
    check(response.status == 200 and json.loads(response.read())["status"] == "ok", "1.0 health")
    connection.close()


def test_keep_alive_and_head(server):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    for path in ["/health", "/v1/models", "/metrics"]:
        connection.request("GET", path)
        response = connection.getresponse()
        check(response.status == 200 and response.read(), f"{path} on a kept-alive connection")
    connection.request("HEAD", "/health")
    response = connection.getresponse()
    check(response.status == 200 and int(response.getheader("content-length")) > 0,
          "HEAD /health")
    check(response.read() == b"", "HEAD sent a body")
    connection.request("POST", "/v1/completions", json.dumps(SHORT_COMPLETION),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    check(response.status == 200 and json.loads(response.read())["choices"], "completion")
    connection.close()


def test_second_server_on_the_port(server):
    second = subprocess.run([sys.argv[1], "serve", "-m", model_path(), "--host", server.host,
                             "--port", str(server.port)], capture_output=True, text=True,
                            timeout=180)
    check(second.returncode != 0, f"a second server on port {server.port} started")
    check("address in use" in second.stderr, f"unclear error: {second.stderr[-300:]!r}")
    check(server.healthy(), "the first server is unhealthy after the second one's attempt")


def trickle(sockets, data, stop, interval=1.0):
    """Sends `data` one byte per socket every `interval` seconds until `stop` is set."""
    for i in range(len(data)):
        if stop.is_set():
            return
        for s in sockets:
            try:
                s.send(data[i:i + 1])
            except OSError:
                pass
        stop.wait(interval)


def read_reply(s, timeout):
    s.settimeout(timeout)
    received = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_slow_clients(server_args):
    threads, header_timeout = 4, 4
    with Server(sys.argv[1], "--http-threads", str(threads), "--header-timeout",
                str(header_timeout), "--body-timeout", str(header_timeout)) as server:
        # The same short completion with no slow client, on this machine as loaded as it is now:
        # the bound below allows twice that plus a second, and stays under the head deadline, so
        # a request that waited for the slow ones' 408s still fails it.
        start = time.time()
        status, _, data = server.request("POST", "/v1/completions", SHORT_COMPLETION)
        check(status == 200, f"short completion alone: {status} {data[:200]!r}")
        bound = min(1 + 2 * (time.time() - start), header_timeout - 0.5)
        # 140 connections (far more than --http-threads): most trickle a head, some a body.
        heads = [socket.create_connection((server.host, server.port)) for _ in range(120)]
        bodies = [socket.create_connection((server.host, server.port)) for _ in range(20)]
        for s in bodies:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        stop = threading.Event()
        workers = [threading.Thread(target=trickle, args=(heads, b"POST /v1/completions "
                                                          b"HTTP/1.1\r\nHost: x\r\n", stop)),
                   threading.Thread(target=trickle, args=(bodies, b'{"prompt": "aaaaaaa', stop))]
        for w in workers:
            w.start()
        try:
            time.sleep(1.5)  # every slow connection has started its request
            for _ in range(3):
                start = time.time()
                check(server.healthy(), "/health not ok with slow clients connected")
                check(time.time() - start < 2, f"/health took {time.time() - start:.1f} s")
                start = time.time()
                status, _, data = server.request("POST", "/v1/completions", SHORT_COMPLETION)
                check(status == 200, f"short completion: {status} {data[:200]!r}")
                took = time.time() - start
                check(took < bound, f"a short completion took {took:.1f} s (bound {bound:.1f} s)")
            # The deadline for a whole head (or body) ends every slow request with 408.
            for what, group in [("head", heads), ("body", bodies)]:
                for s in group:
                    reply = read_reply(s, header_timeout + 10)
                    check(reply, f"a slow {what} got no reply")
                    status, headers, body = parse_responses(reply)[0]
                    check(status == 408, f"a slow {what} got {status}")
                    check_error(status, headers, body, f"slow {what}", "request_timeout")
        finally:
            stop.set()
            for w in workers:
                w.join()
            for s in heads + bodies:
                s.close()
        check(server.healthy(), "unhealthy after the slow clients")


def test_streams_holding_every_worker(server_args):
    threads = 2
    with Server(sys.argv[1], "--http-threads", str(threads)) as server:
        body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 4000, "stream": True,
                           "ignore_eos": True, "temperature": 0}).encode()
        streams = []
        for _ in range(threads):
            s = socket.create_connection((server.host, server.port), timeout=60)
            s.sendall(post_bytes(body))
            received = b""
            while b"data: " not in received:
                received += s.recv(4096)
            streams.append(s)
        try:
            # Every generation worker holds a stream: the cheap routes still answer, and a
            # further generation request is refused at once instead of waiting on its socket.
            start = time.time()
            check(server.healthy(), "/health not ok while streams hold every worker")
            check(time.time() - start < 2, f"/health took {time.time() - start:.1f} s")
            status, headers, data = server.request("POST", "/v1/completions", SHORT_COMPLETION,
                                                   timeout=30)
            check(status == 503 and int(headers["retry-after"]) >= 1, f"busy workers: {status}")
            check_error(status, headers, data, "busy workers", "server_busy")
        finally:
            for s in streams:
                s.close()
        # The closed streams free their workers (noticed at their next write).
        deadline = time.time() + 30
        while time.time() < deadline:
            status, _, data = server.request("POST", "/v1/completions", SHORT_COMPLETION)
            if status == 200:
                break
            time.sleep(0.5)
        check(status == 200, f"generation did not come back after the streams closed: {status}")
        key = 'shadowkv_requests_total{endpoint="/v1/completions",status="503"}'
        check(server.metrics().get(key, 0) >= 1, "the 503 was not counted")


def partial_requests(server, source, count, data=b"GET /health HTTP/1.1\r\n"):
    sockets = []
    for _ in range(count):
        s = socket.create_connection((server.host, server.port), timeout=20,
                                     source_address=(source, 0))
        s.sendall(data)
        sockets.append(s)
    return sockets


def bodies_under_way(server, source, count):
    """`count` connections from `source`, each with a POST head sent and one byte of its body,
    opened one after another: each waits for the server's 100 Continue, which it sends once it
    has read past the head, so no sleep has to guess when the server has read them."""
    sockets = []
    for _ in range(count):
        s = socket.create_connection((server.host, server.port), timeout=20,
                                     source_address=(source, 0))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n"
                  b"Expect: 100-continue\r\n\r\n{")
        received = b""
        while not received.endswith(b"\r\n\r\n"):
            chunk = s.recv(1)
            check(chunk, f"the server closed a body under way: {received!r}")
            received += chunk
        check(received == b"HTTP/1.1 100 Continue\r\n\r\n", f"not a 100 Continue: {received!r}")
        sockets.append(s)
    return sockets


def get_health_from(server, source):
    reply = raw_exchange(server.host, server.port, b"GET /health HTTP/1.1\r\n\r\n",
                         source=source)
    return parse_responses(reply)[0]


def test_connection_caps(server_args):
    with Server(sys.argv[1], "--max-client-connections", "4", "--max-connections", "8") as server:
        # Per client: a fifth connection from an address with four requests under way: 429.
        heads = partial_requests(server, "127.0.0.2", 4)
        time.sleep(1.0)  # the server has read them (a loaded machine needs the margin)
        status, headers, body = get_health_from(server, "127.0.0.2")
        check(status == 429 and int(headers["retry-after"]) >= 1, f"per-client cap: {status}")
        check_error(status, headers, body, "per-client cap", "too_many_connections")
        check(server.healthy(), "another address is refused by the per-client cap")
        # In all: with eight open, a ninth client gets the slot of the head arriving longest.
        bodies = bodies_under_way(server, "127.0.0.3", 4)
        time.sleep(2.5)  # the refused connection above has drained; the heads are old
        status, _, _ = get_health_from(server, "127.0.0.4")
        check(status == 200, f"a new client at the total cap with slow heads open: {status}")
        status, headers, body = parse_responses(read_reply(heads[0], 10))[0]
        check(status == 408, f"the oldest slow head got {status}")
        check_error(status, headers, body, "evicted head", "request_timeout")
        # Eight requests whose bodies are under way leave nothing to close: 503. Closed heads the
        # server has not seen yet are the slowest heads when the new bodies arrive, so they are
        # the ones closed for them; the bodies come from an address of their own, so such heads
        # cannot trip the per-client cap either.
        for s in heads:
            s.close()
        bodies += bodies_under_way(server, "127.0.0.5", 4)
        status, headers, body = get_health_from(server, "127.0.0.4")
        check(status == 503 and int(headers["retry-after"]) >= 1, f"total cap: {status}")
        check_error(status, headers, body, "total cap", "too_many_connections")
        for s in bodies:
            s.close()
        time.sleep(2.5)
        # Idle kept-alive connections are closed first to make room.
        idle = []
        for _ in range(4):
            c = http.client.HTTPConnection(server.host, server.port, timeout=20,
                                           source_address=("127.0.0.2", 0))
            c.request("GET", "/health")
            check(c.getresponse().read(), "health on an idle-to-be connection")
            idle.append(c)
        status, _, _ = get_health_from(server, "127.0.0.2")
        check(status == 200, "no room made from idle connections")
        oldest = idle[0].sock
        oldest.settimeout(5)
        check(oldest.recv(1) == b"", "the oldest idle connection was not the one closed")
        for c in idle:
            c.close()
        check(server.healthy(), "unhealthy after the caps")


def main():
    with Server(sys.argv[1], "--max-body", str(MAX_BODY_KIB)) as server:
        result = run_tests([test_corpus, test_oversized_heads, test_chunked_body_past_max_body,
                            test_pipelining, test_http10_stream, test_keep_alive_and_head,
                            test_second_server_on_the_port], server)
    more = run_tests([test_slow_clients, test_connection_caps, test_streams_holding_every_worker],
                     None)
    finish(result[0] + more[0], result[1] + more[1])


if __name__ == "__main__":
    main()
