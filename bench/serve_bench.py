#!/usr/bin/env python3
"""Serving benchmark for `shadowkv serve`, driven by the official openai client.

Sends --num-requests streaming requests, either --concurrency at a time or as Poisson arrivals
at --request-rate per second (seeded), to a running server (--base-url) or to one it starts
(--binary/--model, extra `serve` flags after --). Reports requests/s, whole-run output tokens/s,
steady-state decode tokens/s and its inter-token latency, TTFT/ITL/TPOT/end-to-end percentiles,
errors by status and, for the passkey workload, the share answered right; writes a JSON file
with the settings and every request's record, and a PNG (bench/serve_bench_plot.py).

  python3 bench/serve_bench.py --binary build/shadowkv --kv full,shadowkv --num-requests 8 \
      --concurrency 4 --prompt-tokens 512 --output-tokens 32 --json out.json

--prompt-ids N sends completions whose prompt is N random token ids (seeded, below the
vocabulary size that /v1/models reports, or --vocab-size): exact prompt lengths with no
tokenizer in the way, e.g. 122K-token prompts to a server of random weights (--synthetic NAME,
passed to the server it starts, with --device cuda unless the serve flags name a device).
"""
import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from serve_load import default_model  # the same default model as the older load script

# The filler of the random workload: sentences of words drawn from this list.
WORDS = ("river harbour ledger morning window garden letter number market bridge station "
         "engine winter summer valley forest castle village teacher doctor sailor farmer "
         "painter writer student captain signal lantern pocket basket kettle candle mirror "
         "ribbon saddle anchor compass pebble meadow orchard thunder silver copper marble "
         "velvet cotton timber granite quiet early gentle narrow broad bright heavy patient "
         "careful sudden distant hidden steady humble clever rapid walks carries finds keeps "
         "paints opens closes writes reads builds mends counts sells follows crosses gathers "
         "before after under across beside beyond through toward").split()
# The passkey workload's haystack line (the eval tasks' noise sentence) and its question.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about the important information there.")
CALIBRATION_UNITS = 32


def percentile(values, q):
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values):
    values = list(values)
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(values), "mean": sum(values) / len(values),
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


# ---- workloads -------------------------------------------------------------------------------


class Prompt:
    """One request's input: text (the user turn, or the whole prompt for completions) and the
    strings a right answer contains (empty: not scored)."""

    def __init__(self, text, answers=()):
        self.text = text  # or a list of token ids (completions only)
        self.answers = list(answers)


def build_id_prompt(seed, index, length, vocab_size):
    """`length` token ids drawn uniformly below `vocab_size`, from (seed, index): every request
    its own prompt, so none starts from another's held KV state."""
    rng = random.Random(f"ids:{seed}:{index}")
    return Prompt([rng.randrange(vocab_size) for _ in range(length)])


def build_shared_id_prompt(seed, index, length, vocab_size):
    """`length` token ids of which all but the last are the same for every request (one shared
    prompt, as a long system prompt or document), the last from (seed, index)."""
    shared = build_id_prompt(seed, "shared", length - 1, vocab_size).text
    return Prompt(shared + [random.Random(f"last:{seed}:{index}").randrange(vocab_size)])


def build_prompt(workload, endpoint, seed, index, units):
    rng = random.Random(f"{seed}:{index}")
    if workload == "passkey":
        passkey = str(rng.randrange(10000, 100000))
        lines = [NOISE] * units
        depth = rng.random()
        lines.insert(round(depth * units),
                     f"The pass key is {passkey}. Remember it. {passkey} is the pass key.")
        text = PASSKEY_INTRO + "\n" + "\n".join(lines) + "\nWhat is the pass key?"
        if endpoint == "completions":
            text += "\nThe pass key is"
        return Prompt(text, [passkey])
    # A distinct first line per request, so that no request starts from another's held KV state.
    sentences = [" ".join(rng.choice(WORDS) for _ in range(8)).capitalize() + "."
                 for _ in range(units)]
    text = f"Notes {seed}-{index}.\n" + " ".join(sentences) + "\nSummarise the notes above."
    if endpoint == "completions":
        text += "\nSummary:"
    return Prompt(text)


def read_prompts_file(path):
    """JSON lines, each {"prompt": text, "answers": [strings]} (answers optional)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                sys.exit(f"serve_bench: {path}:{number}: not JSON: {error}")
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                sys.exit(f"serve_bench: {path}:{number}: needs a string field \"prompt\"")
            answers = item.get("answers", [])
            if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
                sys.exit(f"serve_bench: {path}:{number}: \"answers\" must be a list of strings")
            prompts.append(Prompt(item["prompt"], answers))
    if not prompts:
        sys.exit(f"serve_bench: {path} holds no prompts")
    return prompts


# ---- one request -----------------------------------------------------------------------------


def request_arguments(args, model, text, max_tokens, kv_policy, index, stream):
    extra = {"ignore_eos": args.ignore_eos, "kv_reuse": args.kv_reuse}
    # A server started per policy (--server-per-kv) runs that policy, variants included: the
    # request names none (a request may name a policy, not a variant).
    if kv_policy and not args.server_per_kv:
        extra["kv_policy"] = kv_policy
    if kv_policy and args.kv_budget is not None:
        extra["kv_budget"] = args.kv_budget
    arguments = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature,
                 "seed": args.seed + index, "extra_body": extra}
    if stream:
        arguments.update(stream=True, stream_options={"include_usage": True})
    if args.endpoint == "chat":
        arguments["messages"] = [{"role": "user", "content": text}]
    else:
        arguments["prompt"] = text
    return arguments


def error_status(error):
    """A short label for a failed request: the HTTP status, or what broke."""
    import openai
    if isinstance(error, openai.APIStatusError):
        return str(error.status_code)
    if isinstance(error, openai.APITimeoutError):
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    if isinstance(error, openai.APIError):
        return "stream_error"  # an error event inside a stream that had started
    return type(error).__name__


async def stream_request(client, args, model, prompt, index, kv_policy, clock, max_tokens=None):
    """Streams one request (--output-tokens, or `max_tokens`); returns its record (times in
    seconds from the run's start)."""
    record = {"index": index, "kv_policy": kv_policy or "server", "start_s": clock(),
              "first_token_s": None, "end_s": None, "chunk_times_s": [], "prompt_tokens": None,
              "completion_tokens": None, "cached_tokens": None, "finish_reason": None,
              "status": "200", "error": None, "answers": prompt.answers, "correct": None}
    pieces = []
    create = (client.chat.completions.create if args.endpoint == "chat" else
              client.completions.create)
    try:
        stream = await create(**request_arguments(args, model, prompt.text,
                                                  max_tokens or args.output_tokens, kv_policy,
                                                  index, True))
        async for chunk in stream:
            now = clock()
            if chunk.usage:
                record["prompt_tokens"] = chunk.usage.prompt_tokens
                record["completion_tokens"] = chunk.usage.completion_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                record["cached_tokens"] = getattr(details, "cached_tokens", None)
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = choice.delta.content if args.endpoint == "chat" else choice.text
            if piece:
                pieces.append(piece)
                record["chunk_times_s"].append(now)
                if record["first_token_s"] is None:
                    record["first_token_s"] = now
            if choice.finish_reason:
                record["finish_reason"] = choice.finish_reason
        if record["completion_tokens"] is None:
            record["status"], record["error"] = "no_usage", "the stream ended without usage"
    except Exception as error:  # every failure is recorded and counted, none ends the run
        record["status"], record["error"] = error_status(error), str(error)[:300]
    record["end_s"] = clock()
    text = "".join(pieces)
    record["text"] = text[:args.keep_text]
    if prompt.answers and record["status"] == "200":
        record["correct"] = all(answer in text for answer in prompt.answers)
    return record


# ---- a run -----------------------------------------------------------------------------------


def arrival_times(args, count):
    """Seconds from the run's start at which each request arrives (all at once, or Poisson)."""
    arrivals = [0.0] * count
    if args.request_rate:
        rng = random.Random(args.seed)
        at = 0.0
        for i in range(count):
            arrivals[i] = at
            at += rng.expovariate(args.request_rate)
    return arrivals


async def run_policy(client, args, model, prompts, kv_policy, indices=None, began=None,
                     concurrency=None):
    """The requests `indices` (default all) under one KV policy, `concurrency` (default
    --concurrency) at a time; returns their records in index order. Times are seconds from
    `began` (a time.perf_counter value, the same clock in every process)."""
    began = time.perf_counter() if began is None else began
    clock = lambda: time.perf_counter() - began
    concurrency = args.concurrency if concurrency is None else concurrency
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    arrivals = arrival_times(args, len(prompts))
    indices = list(range(len(prompts))) if indices is None else indices

    async def one(index):
        while (delay := arrivals[index] - clock()) > 0:  # a timer may fire a little early
            await asyncio.sleep(delay)
        if limit:
            async with limit:
                record = await stream_request(client, args, model, prompts[index], index,
                                              kv_policy, clock)
        else:
            record = await stream_request(client, args, model, prompts[index], index, kv_policy,
                                          clock)
        record["arrival_s"] = arrivals[index]
        return record

    return list(await asyncio.gather(*(one(i) for i in indices)))


def client_process(job):
    """One client process's share of a run (--client-processes): its own event loop and
    client, started at the shared `began`."""
    args, base_url, model, prompts, kv_policy, indices, began, concurrency = job

    async def go():
        import openai
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=args.request_timeout)
        while (delay := began - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        try:
            return await run_policy(client, args, model, prompts, kv_policy, indices, began,
                                    concurrency)
        finally:
            await client.close()

    return asyncio.run(go())


async def run_policy_split(args, base_url, model, prompts, kv_policy):
    """run_policy over --client-processes processes, request i in process i mod N with its
    share of --concurrency: one Python process parses about 10K streamed chunks a second,
    below what a GPU server sends."""
    import concurrent.futures
    import multiprocessing
    n = min(args.client_processes, len(prompts))
    began = time.perf_counter() + 5.0  # the processes start and import the client meanwhile
    jobs = []
    for w in range(n):
        indices = list(range(w, len(prompts), n))
        share = None
        if args.concurrency:
            share = max(1, args.concurrency // n + (1 if w < args.concurrency % n else 0))
        jobs.append((args, base_url, model, prompts, kv_policy, indices, began, share))
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(
            n, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = await asyncio.gather(*(loop.run_in_executor(pool, client_process, job)
                                       for job in jobs))
    return sorted((r for part in parts for r in part), key=lambda r: r["index"])


def steady_state(records, decoders):
    """Output tokens/s and inter-token latency while `decoders` requests decode at once.

    A request decodes from its first streamed token to its last. With every request running
    together (decoders = all of them) the window is the acceptance's: from the last request's
    first token to the first request's last token. Tokens are counted at their chunks'
    arrival inside the window (a chunk carrying several tokens counts for its share)."""
    spans = [(r["first_token_s"], r["chunk_times_s"][-1], r) for r in records
             if r["status"] == "200" and r["chunk_times_s"]]
    if decoders < 1 or len(spans) < decoders:
        return None, "fewer requests produced tokens than the steady state needs"
    events = sorted([(a, 1) for a, _, _ in spans] + [(b, -1) for _, b, _ in spans],
                    key=lambda e: (e[0], -e[1]))
    segments, running, opened = [], 0, None
    for t, step in events:
        running += step
        if running >= decoders and opened is None:
            opened = t
        elif running < decoders and opened is not None:
            if t > opened:
                segments.append((opened, t))
            opened = None
    if not segments:
        return None, (f"no moment with {decoders} requests decoding at once (the first request "
                      "finished before the last one started)")
    tokens, gaps = 0.0, []
    for _, _, r in spans:
        share = r["completion_tokens"] / len(r["chunk_times_s"])
        times = r["chunk_times_s"]
        for a, b in segments:
            tokens += share * sum(1 for t in times if a < t <= b)
            gaps += [t1 - t0 for t0, t1 in zip(times, times[1:]) if t0 >= a and t1 <= b]
    window = sum(b - a for a, b in segments)
    return {"decoders": decoders, "start_s": segments[0][0], "end_s": segments[-1][1],
            "window_s": window, "segments": [list(s) for s in segments], "output_tokens": tokens,
            "output_tokens_per_s": tokens / window, "itl_p50_s": percentile(gaps, 50),
            "itl_count": len(gaps)}, None


# The engine loop's and the handlers' time counters in /metrics (docs/SERVER.md, Metrics).
STEP_SERIES = re.compile(
    r'^(shadowkv_engine_steps_total|shadowkv_engine_step_rows_total|'
    r'shadowkv_engine_step_seconds_total|shadowkv_handler_seconds_total|'
    r'shadowkv_handler_wakeups_total|shadowkv_handler_tokens_total|'
    r'shadowkv_kv_compress_seconds_total)(\{[^}]*\})? (\S+)$')


def scrape_step_counters(base_url):
    """{series{labels}: value} of the loop's and handlers' counters; {} when unreadable."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=30) as reply:
            text = reply.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError):
        return {}
    counters = {}
    for line in text.splitlines():
        match = STEP_SERIES.match(line)
        if match:
            counters[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return counters


def step_breakdown(before, after):
    """Per engine step and per handed-out token, from two scrapes around a run."""
    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)
    steps = delta('shadowkv_engine_steps_total{kind="all"}')
    decode_steps = delta('shadowkv_engine_steps_total{kind="decode_only"}')
    if steps <= 0:
        return None
    phase = 'shadowkv_engine_step_seconds_total{{phase="{}"}}'
    handler = 'shadowkv_handler_seconds_total{{phase="{}"}}'
    wakeups = delta("shadowkv_handler_wakeups_total")
    tokens = delta("shadowkv_handler_tokens_total")
    return {
        "steps": steps, "decode_only_steps": decode_steps,
        "rows_per_step": delta("shadowkv_engine_step_rows_total") / steps,
        "schedule_ms_per_step": 1000 * delta(phase.format("schedule")) / steps,
        "model_ms_per_step": 1000 * delta(phase.format("model")) / steps,
        "publish_ms_per_step": 1000 * delta(phase.format("publish")) / steps,
        "model_ms_per_decode_only_step": (1000 * delta(phase.format("model_decode_only")) /
                                          decode_steps) if decode_steps > 0 else None,
        "handoff_ms_per_wakeup": (1000 * delta(handler.format("handoff")) / wakeups)
        if wakeups > 0 else None,
        "tokens_per_wakeup": tokens / wakeups if wakeups > 0 else None,
        "detokenize_us_per_token": (1e6 * delta(handler.format("detokenize")) / tokens)
        if tokens > 0 else None,
        "write_us_per_token": (1e6 * delta(handler.format("write")) / tokens)
        if tokens > 0 else None,
        # Prompt compression (ShadowKV on the GPU), summed over the policies of finished requests.
        "compress_seconds": sum(after[key] - before.get(key, 0.0) for key in after
                                if key.startswith("shadowkv_kv_compress_seconds_total")),
    }


def summarize(records, args):
    ok = [r for r in records if r["status"] == "200"]
    errors = {}
    for r in records:
        if r["status"] != "200":
            errors[r["status"]] = errors.get(r["status"], 0) + 1
    started = min((r["start_s"] for r in records), default=0.0)
    ended = max((r["end_s"] for r in records), default=0.0)
    duration = max(ended - started, 1e-9)
    output_tokens = sum(r["completion_tokens"] for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok]
    chunks = sum(len(r["chunk_times_s"]) for r in ok)
    with_tokens = [r for r in ok if r["chunk_times_s"]]
    itl = [t1 - t0 for r in with_tokens for t0, t1 in zip(r["chunk_times_s"],
                                                           r["chunk_times_s"][1:])]
    tpot = [(r["chunk_times_s"][-1] - r["first_token_s"]) / (r["completion_tokens"] - 1)
            for r in with_tokens if r["completion_tokens"] > 1]
    decoders = len(with_tokens) if not args.concurrency else min(args.concurrency,
                                                                len(with_tokens))
    steady, steady_note = steady_state(records, decoders)
    scored = [r for r in ok if r["answers"]]
    summary = {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors_by_status": errors, "duration_s": duration,
        "requests_per_s": len(ok) / duration, "prompt_tokens": sum(prompt_tokens),
        "prompt_tokens_per_request": distribution(prompt_tokens),
        "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (sum(prompt_tokens) + output_tokens) / duration,
        "stream_chunks": chunks, "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "ttft_s": distribution(r["first_token_s"] - r["start_s"] for r in with_tokens),
        "itl_s": distribution(itl), "tpot_s": distribution(tpot),
        "e2e_s": distribution(r["end_s"] - r["start_s"] for r in ok),
        "queue_wait_s": distribution(r["start_s"] - r["arrival_s"] for r in records),
        "steady_state": steady, "steady_state_note": steady_note,
        "scored": len(scored), "correct": sum(1 for r in scored if r["correct"]),
        "share_right": (sum(1 for r in scored if r["correct"]) / len(scored)) if scored else None,
    }
    return summary


# ---- reporting -------------------------------------------------------------------------------


def ms(value):
    return "-" if value is None else f"{1000 * value:.1f}"


def number(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def print_summary(policy, s):
    steady = s["steady_state"] or {}
    print(f"\n== kv {policy}: {s['completed']}/{s['requests']} completed in "
          f"{s['duration_s']:.2f} s, prompt ~{number(s['prompt_tokens_per_request']['mean'], 0)} "
          f"tokens, {s['output_tokens']} output tokens")
    print(f"  requests/s {s['requests_per_s']:.3f}   output tok/s (whole run) "
          f"{s['output_tokens_per_s']:.1f}   prompt+output tok/s {s['total_tokens_per_s']:.1f}")
    if steady:
        print(f"  steady-state decode ({steady['decoders']} decoding, {steady['window_s']:.2f} s): "
              f"{steady['output_tokens_per_s']:.1f} tok/s, ITL p50 {ms(steady['itl_p50_s'])} ms")
    else:
        print(f"  steady-state decode: none ({s['steady_state_note']})")
    print("  | ms | mean | p50 | p90 | p99 |")
    print("  |---|---|---|---|---|")
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"),
                      ("E2E", "e2e_s")):
        d = s[key]
        print(f"  | {name} | {ms(d['mean'])} | {ms(d['p50'])} | {ms(d['p90'])} | {ms(d['p99'])} |")
    b = s.get("engine_steps")
    if b:
        print(f"  engine loop: {b['steps']:.0f} steps ({b['decode_only_steps']:.0f} decode-only), "
              f"{b['rows_per_step']:.1f} rows/step; ms per step: schedule "
              f"{b['schedule_ms_per_step']:.3f}, model {b['model_ms_per_step']:.2f} (decode-only "
              f"{number(b['model_ms_per_decode_only_step'])}), publish "
              f"{b['publish_ms_per_step']:.3f}; handlers: handoff "
              f"{number(b['handoff_ms_per_wakeup'], 3)} ms per wake-up "
              f"({number(b['tokens_per_wakeup'], 1)} tokens), detokenize "
              f"{number(b['detokenize_us_per_token'], 1)} us and write "
              f"{number(b['write_us_per_token'], 1)} us per token")
        if b.get("compress_seconds"):
            print(f"  prompt compression: {b['compress_seconds']:.2f} s in the loop "
                  f"({1000 * b['compress_seconds'] / max(1, s['completed']):.1f} ms per request)")
    if s["errors_by_status"]:
        print(f"  errors by status: {s['errors_by_status']}")
    if s["share_right"] is not None:
        print(f"  answered right: {s['correct']}/{s['scored']} ({100 * s['share_right']:.0f}%)")


RATIO_KEYS = (("output_tokens_per_s", lambda s: s["output_tokens_per_s"]),
              ("steady_output_tokens_per_s",
               lambda s: s["steady_state"] and s["steady_state"]["output_tokens_per_s"]),
              ("ttft_p50_s", lambda s: s["ttft_s"]["p50"]),
              ("itl_p50_s", lambda s: s["itl_s"]["p50"]),
              ("e2e_p50_s", lambda s: s["e2e_s"]["p50"]),
              ("share_right", lambda s: s["share_right"]))


def ratios(runs):
    """Each later policy's figures over the first's."""
    base = runs[0]
    out = {}
    for run in runs[1:]:
        row = {}
        for key, get in RATIO_KEYS:
            a, b = get(run["summary"]), get(base["summary"])
            row[key] = a / b if a is not None and b else None
        out[f"{run['kv_policy']}/{base['kv_policy']}"] = row
    return out


# ---- the server ------------------------------------------------------------------------------


def wait_healthy(base_url, seconds):
    deadline = time.time() + seconds
    last = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=10) as response:
                if response.status == 200 and json.loads(response.read()).get("status") == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError) as error:
            last = error
        time.sleep(0.25)
    sys.exit(f"serve_bench: {base_url}/health did not answer ok within {seconds} s ({last})")


class StartedServer:
    """`shadowkv serve --port 0` on 127.0.0.1; the URL comes from its first output line."""

    def __init__(self, args, extra):
        self.log = tempfile.NamedTemporaryFile(prefix="serve-bench-", suffix=".log", delete=False)
        weights = ["-m", args.model]
        if args.synthetic:
            weights = ["--synthetic", args.synthetic]
            if "--device" not in args.server_args:
                weights += ["--device", "cuda"]
        self.command = [args.binary, "serve", *weights, "--host", "127.0.0.1", "--port", "0",
                        *args.server_args, *extra]
        print("serve_bench: starting", " ".join(self.command), flush=True)
        try:
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                            stderr=self.log, text=True)
        except OSError as error:
            sys.exit(f"serve_bench: cannot run {args.binary}: {error}")
        line = [""]
        reader = threading.Thread(target=lambda: line.__setitem__(0,
                                                                  self.process.stdout.readline()))
        reader.start()
        reader.join(args.startup_timeout)
        match = re.search(r"http://([\d.]+):(\d+)", line[0] or "")
        if not match:
            self.process.kill()
            sys.exit(f"serve_bench: the server did not start: {line[0]!r}\n{self.log_tail()}")
        # The lines after it (the synthetic label, the GPU pool and what bounded it) are shown
        # and kept for the JSON; the rest of stdout is drained unread.
        self.startup_lines = [line[0].rstrip("\n")]
        threading.Thread(target=self.drain, daemon=True).start()
        self.base_url = f"http://{match.group(1)}:{match.group(2)}"

    def drain(self):
        for text in self.process.stdout:
            if text.startswith("shadowkv serve:") and len(self.startup_lines) < 16:
                self.startup_lines.append(text.rstrip("\n"))
                print(text.rstrip("\n"), flush=True)

    def log_tail(self):
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-3000:]

    def stop(self):
        """SIGTERM, then the exit status (killed after 60 s); the log stays only after trouble."""
        self.process.terminate()
        deadline = time.time() + 60
        while self.process.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if self.process.poll() is None:
            print("serve_bench: the server ignored SIGTERM for 60 s; killing it", file=sys.stderr)
            self.process.kill()
        code = self.process.wait()
        if code == 0:
            os.unlink(self.log.name)
        else:
            print(f"serve_bench: the server's log is {self.log.name}:\n{self.log_tail()}",
                  file=sys.stderr)
        return code


# ---- main ------------------------------------------------------------------------------------


async def calibrate(client, args, model):
    """Prompt tokens of the workload's template alone and with CALIBRATION_UNITS filler units,
    from the server's usage; returns (units for --prompt-tokens, the measurements)."""
    counts = []
    for units in (0 if args.workload == "random" else 1, CALIBRATION_UNITS):
        text = build_prompt(args.workload, args.endpoint, args.seed, 0, units).text
        create = (client.chat.completions.create if args.endpoint == "chat" else
                  client.completions.create)
        try:
            reply = await create(**request_arguments(args, model, text, 1, None, 0, False))
        except Exception as error:
            sys.exit(f"serve_bench: calibration request failed ({error_status(error)}): {error}")
        counts.append((units, reply.usage.prompt_tokens))
    (u0, t0), (u1, t1) = counts
    per_unit = (t1 - t0) / (u1 - u0)
    units = max(u0, u0 + round((args.prompt_tokens - t0) / per_unit)) if per_unit > 0 else u0
    if t0 > args.prompt_tokens:
        print(f"serve_bench: the prompt template alone is {t0} tokens, more than "
              f"--prompt-tokens {args.prompt_tokens}", file=sys.stderr)
    return units, {"points": counts, "tokens_per_unit": per_unit, "units": units}


async def bench(args, file_prompts, base_url, policies):
    """Every policy's run against one server: (model id, calibration, runs)."""
    import openai
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=args.request_timeout)
    models = await client.models.list()
    model = models.data[0].id if models.data else "default"
    entry = models.data[0].model_dump() if models.data else {}
    args.model_label = entry.get("label")
    if args.model_label:
        print(f"serve_bench: *** {args.model_label} ***", flush=True)
    calibration = None
    if args.prompts_file:
        prompts = [file_prompts[i % len(file_prompts)] for i in range(args.num_requests)]
    elif args.prompt_ids:
        vocab_size = args.vocab_size or entry.get("vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            sys.exit(f"serve_bench: /v1/models reports no vocabulary size for {model!r}; give "
                     "--vocab-size")
        calibration = {"prompt_ids": args.prompt_ids, "vocab_size": vocab_size,
                       "shared_prompt": args.shared_prompt}
        build = build_shared_id_prompt if args.shared_prompt else build_id_prompt
        prompts = [build(args.seed, i, args.prompt_ids, vocab_size)
                   for i in range(args.num_requests)]
    else:
        units, calibration = await calibrate(client, args, model)
        prompts = [build_prompt(args.workload, args.endpoint, args.seed, i, units)
                   for i in range(args.num_requests)]
    runs = []
    for policy in policies:
        if args.shared_prompt:
            # One request holds the shared part first; the run's requests start from its copies
            # (reported as cached prompt tokens).
            warm = Prompt(prompts[0].text[:-1])
            record = await stream_request(client, args, model, warm, 0, policy, time.perf_counter,
                                          max_tokens=1)
            print(f"serve_bench: shared prompt held ({record['status']}, "
                  f"{record['prompt_tokens']} tokens)", flush=True)
        before = scrape_step_counters(base_url)
        if args.client_processes > 1:
            records = await run_policy_split(args, base_url, model, prompts, policy)
        else:
            records = await run_policy(client, args, model, prompts, policy)
        summary = summarize(records, args)
        summary["engine_steps"] = step_breakdown(before, scrape_step_counters(base_url))
        print_summary(policy or "server", summary)
        runs.append({"kv_policy": policy or "server", "base_url": base_url, "summary": summary,
                     "records": records})
    await client.close()
    return model, calibration, runs


def bench_servers(args, file_prompts):
    """Runs every policy against --base-url, against one started server, or (--server-per-kv)
    against a server started per policy with `--kv POLICY`; returns the result object."""
    policies = args.kv.split(",") if args.kv else [None]
    sessions = [(policy,) for policy in policies] if args.server_per_kv else [tuple(policies)]
    servers, runs, model, calibration = [], [], None, None
    for session in sessions:
        extra = ["--kv", session[0]] if args.server_per_kv else []
        server = None if args.base_url else StartedServer(args, extra)
        base_url = args.base_url or server.base_url
        entry = {"base_url": base_url, "command": server.command if server else None}
        servers.append(entry)
        try:
            wait_healthy(base_url, args.startup_timeout)
            model, session_calibration, session_runs = asyncio.run(
                bench(args, file_prompts, base_url, list(session)))
        finally:
            if server:
                entry["startup_lines"] = server.startup_lines
                entry["exit_status"] = server.stop()
                print(f"serve_bench: server stopped ({entry['exit_status']})", flush=True)
        calibration = calibration or session_calibration
        runs += session_runs
    result = {"benchmark": "serve_bench", "settings": dict(vars(args)), "model": model,
              "model_label": getattr(args, "model_label", None),
              "servers": servers, "calibration": calibration, "runs": runs,
              "ratios": ratios(runs) if len(runs) > 1 else {}}
    if result["ratios"]:
        print("\nratios (each policy over the first):")
        for name, row in result["ratios"].items():
            print(f"  {name}: " + ", ".join(f"{k} {number(v, 3)}" for k, v in row.items()))
    return result


def write_plot(json_path, png_path, plot_python):
    """Draws the PNG in this interpreter when it has matplotlib, else with another Python
    (the openai client and matplotlib may live in different environments)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import matplotlib  # noqa: F401
        sys.path.insert(0, here)
        import serve_bench_plot
        serve_bench_plot.plot_file(json_path, png_path)
        return True
    except ImportError:
        pass
    for python in [plot_python] if plot_python else ["python3", "/usr/bin/python3"]:
        try:
            done = subprocess.run([python, os.path.join(here, "serve_bench_plot.py"), json_path,
                                   png_path], capture_output=True, text=True)
        except OSError:
            continue
        if done.returncode == 0:
            return True
        print(f"serve_bench: plotting with {python} failed: {done.stderr.strip()[-500:]}",
              file=sys.stderr)
    return False


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_argument_group("server")
    where.add_argument("--base-url", help="a running server (http://host:port); else one is "
                                          "started from --binary and --model")
    where.add_argument("--binary", default="build/shadowkv")
    where.add_argument("--model", default=default_model())
    where.add_argument("--synthetic", help="start the server with random weights of this "
                                           "model's shapes (e.g. llama3-8b) instead of --model")
    where.add_argument("--startup-timeout", type=float, default=300, help="seconds")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=("random", "passkey"), default="random",
                      help="random word sentences, or a pass key hidden in filler and asked back")
    work.add_argument("--prompts-file", help="JSON lines {\"prompt\", \"answers\"} instead")
    work.add_argument("--endpoint", choices=("chat", "completions"),
                      help="default chat; completions with --prompt-ids")
    work.add_argument("--prompt-ids", type=int, metavar="N",
                      help="completions prompts of N random token ids instead of text")
    work.add_argument("--vocab-size", type=int,
                      help="--prompt-ids below this (default: /v1/models' vocab_size)")
    work.add_argument("--prompt-tokens", type=int, default=256, help="about this many")
    work.add_argument("--output-tokens", type=int, default=64)
    work.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="let requests stop at end of turn (default: exactly --output-tokens)")
    work.add_argument("--kv-reuse", action="store_true",
                      help="let requests start from held KV states (default: off)")
    work.add_argument("--shared-prompt", action="store_true",
                      help="with --prompt-ids: every prompt the same but its last id, held by a "
                           "first request so that the run's requests start from its copies "
                           "(long-context decode without a prefill per request; implies "
                           "--kv-reuse)")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--num-requests", type=int, default=16)
    work.add_argument("--concurrency", type=int, default=None,
                      help="requests in flight (default 4; with --request-rate: no limit)")
    work.add_argument("--request-rate", type=float, default=None,
                      help="Poisson arrivals per second instead of all at once")
    work.add_argument("--seed", type=int, default=1)
    work.add_argument("--client-processes", type=int, default=1,
                      help="client processes sharing the requests (one Python process reads "
                           "about 10K streamed tokens a second; a GPU server sends more)")
    work.add_argument("--kv", help="kv_policy per request, comma-separated runs in turn "
                                   "(e.g. full,shadowkv); default the server's")
    work.add_argument("--kv-budget", type=int, help="kv_budget with --kv")
    where.add_argument("--server-per-kv", action="store_true",
                       help="start a server per --kv policy with `--kv POLICY` (the GPU server "
                            "serves one KV setting)")
    work.add_argument("--request-timeout", type=float, default=1800, help="seconds")
    out = parser.add_argument_group("output")
    out.add_argument("--json", default="serve_bench.json")
    out.add_argument("--png", help="default: the JSON path with .png")
    out.add_argument("--keep-text", type=int, default=200, help="output characters kept per "
                                                                "request in the JSON")
    out.add_argument("--plot-python", help="a Python with matplotlib, if this one has none")
    parser.add_argument("server_args", nargs="*", help="more `shadowkv serve` flags (after --)")
    args = parser.parse_args(argv)
    if args.client_processes < 1:
        parser.error("--client-processes must be at least 1")
    if args.concurrency is None and not args.request_rate:
        args.concurrency = 4
    if args.prompt_ids is not None:
        if args.prompt_ids < 1:
            parser.error("--prompt-ids must be at least 1")
        if args.endpoint == "chat":
            parser.error("--prompt-ids sends token ids, which only /v1/completions takes")
        if args.prompts_file or args.workload != "random":
            parser.error("--prompt-ids is its own workload: drop --prompts-file and --workload")
        args.endpoint = "completions"
        if args.shared_prompt:
            if args.prompt_ids < 2:
                parser.error("--shared-prompt needs --prompt-ids of at least 2")
            args.kv_reuse = True
    elif args.shared_prompt:
        parser.error("--shared-prompt goes with --prompt-ids")
    elif args.vocab_size is not None:
        parser.error("--vocab-size goes with --prompt-ids")
    if args.vocab_size is not None and args.vocab_size < 1:
        parser.error("--vocab-size must be at least 1")
    args.endpoint = args.endpoint or "chat"
    if args.synthetic and args.base_url:
        parser.error("--synthetic starts a server: drop --base-url")
    for name in ("num_requests", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.request_rate is not None and not (args.request_rate > 0 and
                                              math.isfinite(args.request_rate)):
        parser.error("--request-rate must be a positive number")
    if args.base_url and (args.server_args or args.server_per_kv):
        parser.error("extra serve flags and --server-per-kv need a server to start: drop "
                     "--base-url")
    if args.server_per_kv and not args.kv:
        parser.error("--server-per-kv needs --kv")
    if args.base_url:
        args.base_url = re.sub(r"/v1/?$", "", args.base_url.rstrip("/"))
    if args.prompts_file:
        args.workload = "file"
    elif args.prompt_ids:
        args.workload = "ids"
        args.prompt_tokens = args.prompt_ids  # exact, for the report and the plot
    args.png = args.png or os.path.splitext(args.json)[0] + ".png"
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import openai  # noqa: F401
    except ImportError:
        sys.exit("serve_bench: needs the openai package (scripts/setup.sh makes "
                 "~/.cache/shadowkv/venv-e2e with it)")
    # SIGTERM unwinds like Ctrl-C, so that a started server is stopped too.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    # Read before a server starts, so that a bad file costs nothing.
    file_prompts = read_prompts_file(args.prompts_file) if args.prompts_file else []
    result = bench_servers(args, file_prompts)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if result["model_label"]:
        print(f"serve_bench: *** {result['model_label']} ***")
    print(f"serve_bench: wrote {args.json}")
    if not write_plot(args.json, args.png, args.plot_python):
        sys.exit(f"serve_bench: no Python with matplotlib drew {args.png} (--plot-python); the "
                 f"JSON is in {args.json}, plot it with bench/serve_bench_plot.py")
    print(f"serve_bench: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
