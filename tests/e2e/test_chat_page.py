"""The chat page at / in headless Chromium: type a message, press Send, and see the streamed
answer appear (the page reads SSE from /v1/chat/completions). Chromium is driven over the
DevTools protocol on a pipe (--remote-debugging-pipe), so no extra Python package is needed."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from harness import Server, check, finish, run_tests

# What ctest reads as "skipped" (SKIP_RETURN_CODE in tests/CMakeLists.txt).
SKIP_EXIT_CODE = 77


class Browser:
    """Chromium with DevTools messages as NUL-terminated JSON on fds 3 (in) and 4 (out)."""

    def __init__(self, executable):
        self.profile = tempfile.mkdtemp(prefix="shadowkv-chromium-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        # The child gets the pipe ends as fds 3 and 4.
        def child_fds():
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)
        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", "about:blank"],
            # close_fds would close 3 and 4 after preexec_fn has placed them.
            preexec_fn=child_fds, close_fds=False,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.buffer = b""
        self.next_id = 0

    def call(self, method, params=None, session=None, timeout=60):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    check("error" not in reply, f"{method}: {reply.get('error')}")
                    return reply["result"]
            chunk = os.read(self.from_browser, 1 << 16)
            check(chunk, "chromium closed the DevTools pipe")
            self.buffer += chunk
        raise AssertionError(f"{method}: no reply in {timeout} s")

    def close(self):
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def evaluate(browser, session, expression):
    result = browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                               "awaitPromise": True}, session)
    return result["result"].get("value")


def wait_for(browser, session, expression, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = evaluate(browser, session, expression)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {expression}")


def test_page_streams_an_answer(server, executable):
    browser = Browser(executable)
    try:
        target = browser.call("Target.createTarget", {"url": server.base_url + "/"})["targetId"]
        session = browser.call("Target.attachToTarget",
                               {"targetId": target, "flatten": True})["sessionId"]
        wait_for(browser, session, "document.readyState === 'complete' && "
                                   "document.getElementById('model').textContent", 30)
        # Count text updates of the answer bubble: a streamed answer grows in several steps.
        evaluate(browser, session, """
            window.updates = 0;
            new MutationObserver(() => window.updates++).observe(
                document.getElementById('log'), {subtree: true, childList: true,
                                                 characterData: true});
            document.getElementById('temperature').value = '0';
            document.getElementById('max_tokens').value = '24';
            document.getElementById('input').value = 'What is the capital of France?';
            document.getElementById('send').click();
            true""")
        wait_for(browser, session, "document.body.dataset.state === 'streaming'", 10)
        wait_for(browser, session, "document.querySelector('.assistant[data-done]') !== null",
                 120)
        answer = evaluate(browser, session, "document.querySelector('.assistant').textContent")
        updates = evaluate(browser, session, "window.updates")
        stats = evaluate(browser, session, "document.querySelector('.stats').textContent")
        errors = evaluate(browser, session, "document.querySelectorAll('.error').length")
        print(f"  page answer: {answer!r} ({updates} DOM updates); {stats}")
        check(errors == 0, "the page shows an error")
        check("Paris" in answer, f"answer without Paris: {answer!r}")
        check(updates >= 4, f"only {updates} DOM updates: the answer was not streamed")
        # A second turn extends the conversation: the server reuses the first turn's KV state.
        evaluate(browser, session, """
            document.getElementById('input').value = 'Thank you. And what is the capital of Italy?';
            document.getElementById('send').click();
            true""")
        wait_for(browser, session,
                 "document.querySelectorAll('.assistant[data-done]').length === 2", 120)
        second = evaluate(browser, session,
                          "[...document.querySelectorAll('.stats')].map(e => e.textContent)")
        print(f"  second turn: {second[-1]}")
        reused = int(second[-1].split("(")[1].split(" ")[0])
        check(reused > 0, f"the second turn reused nothing: {second[-1]}")
        shot = browser.call("Page.captureScreenshot", {"format": "png"}, session)
        check(len(shot["data"]) > 1000, "empty screenshot")
        if os.environ.get("SHADOWKV_E2E_SCREENSHOT"):
            import base64
            with open(os.environ["SHADOWKV_E2E_SCREENSHOT"], "wb") as f:
                f.write(base64.b64decode(shot["data"]))
    finally:
        browser.close()


def main():
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        why = "chromium is not installed (scripts/setup.sh installs Debian's chromium)"
        # In CI setup.sh has run, so a missing browser is a broken setup, not a reason to pass.
        if os.environ.get("CI", "") not in ("", "0", "false", "FALSE", "no"):
            print(f"FAIL: {why}", flush=True)
            finish(0, 1)
        print(f"SKIP: {why}", flush=True)
        sys.exit(SKIP_EXIT_CODE)
    with Server(sys.argv[1]) as server:
        result = run_tests([test_page_streams_an_answer], server, executable)
    finish(*result)


if __name__ == "__main__":
    main()
