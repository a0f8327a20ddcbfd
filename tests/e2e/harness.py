"""Shared e2e helpers: start `shadowkv serve` on a free loopback port, raw HTTP, metrics."""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def model_path():
    if os.environ.get("SHADOWKV_MODEL"):
        return os.environ["SHADOWKV_MODEL"]
    cache = os.environ.get("SHADOWKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                              "shadowkv")
    return os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")


def check(condition, message):
    if not condition:
        raise AssertionError(message)


class Server:
    """`shadowkv serve` on 127.0.0.1 with --port 0; the port comes from its first output line."""

    def __init__(self, binary, *args, startup_seconds=120, weights=None):
        """weights: the flags naming the model (default -m and the default model)."""
        self.log = tempfile.NamedTemporaryFile(prefix="shadowkv-serve-", suffix=".log",
                                               delete=False)
        weights = weights if weights is not None else ["-m", model_path()]
        command = [binary, "serve", *weights, "--host", "127.0.0.1", "--port", "0", *args]
        print("e2e: starting", " ".join(command), flush=True)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True)
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, self.process.stdout.readline()))
        reader.start()
        reader.join(startup_seconds)
        match = re.search(r"http://([\d.]+):(\d+)", line[0] or "")
        if not match:
            self.process.kill()
            raise AssertionError(f"server did not start: {line[0]!r}\n{self.log_text()}")
        self.host, self.port = match.group(1), int(match.group(2))
        self.base_url = f"http://{self.host}:{self.port}"
        # Keep draining stdout so that the server never blocks on a full pipe.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def log_text(self):
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def request(self, method, path, body=None, headers=None, timeout=120):
        """One HTTP request on a fresh connection: (status, headers dict, body bytes)."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        all_headers = {"Content-Type": "application/json"}
        all_headers.update(headers or {})
        connection.request(method, path, body=body, headers=all_headers)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def metrics(self):
        """/metrics as {series with labels: value}."""
        status, _, data = self.request("GET", "/metrics")
        check(status == 200, f"/metrics answered {status}")
        values = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def healthy(self):
        status, _, data = self.request("GET", "/health", timeout=30)
        return status == 200 and json.loads(data)["status"] == "ok"

    def stop(self):
        """SIGTERM; the server must finish and exit 0."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError("server did not exit within 60 s of SIGTERM")
        check(code == 0, f"server exited with {code} after SIGTERM\n{self.log_text()}")
        print("e2e: server stopped cleanly (exit 0)", flush=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, trace):
        if kind is not None:
            print("e2e: server log tail:\n" + self.log_text(), file=sys.stderr)
            self.process.kill()
            self.process.wait()
            return False
        self.stop()
        return False


def raw_exchange(host, port, data, timeout=30, source=None):
    """Sends raw bytes on a fresh connection (from `source`, an address, if given), half-closes
    it and reads until the server closes: the bytes received. A hang raises socket.timeout."""
    with socket.create_connection((host, port), timeout=timeout,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        received = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                return received
            received += chunk
        return received


def parse_responses(data):
    """The HTTP/1.1 responses that follow one another in `data`: [(status, headers, body)], each
    body framed by Content-Length, chunked encoding, or the end of the data."""
    responses = []
    while data:
        head, separator, data = data.partition(b"\r\n\r\n")
        check(separator, f"a response head without its end: {head[:200]!r}")
        lines = head.decode("latin-1").split("\r\n")
        check(lines[0].startswith("HTTP/1."), f"not a status line: {lines[0]!r}")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status == 100:
            continue
        if "content-length" in headers:
            length = int(headers["content-length"])
            body, data = data[:length], data[length:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, data = data.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    data = data[2:]
                    break
                body, data = body + data[:size], data[size + 2:]
        else:
            body, data = data, b""
        responses.append((status, headers, body))
    return responses


def client(server, timeout=300):
    import openai
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def run_tests(tests, *args):
    """Runs test functions in order (each gets *args); returns (passed, failed)."""
    import traceback
    passed = failed = 0
    for test in tests:
        start = time.time()
        try:
            test(*args)
            passed += 1
            print(f"PASS {test.__name__} ({time.time() - start:.1f} s)", flush=True)
        except Exception as error:  # report every failure, not only the first
            failed += 1
            print(f"FAIL {test.__name__}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
    return passed, failed


def finish(passed, failed):
    """The summary line ctest output shows; exit status 1 on any failure."""
    print(f"{passed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)
