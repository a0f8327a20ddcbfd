#!/usr/bin/env python3
"""Full-attention anchor in PyTorch (SDPA, GQA, bf16) with Llama-3-8B shapes and random weights.

Measures, on the GPU it runs on:
  decode:  tokens/s of a whole-model decode step at the largest batch whose KV cache fits, per
           context (all sequences of that length; SDPA over a preallocated cache);
  prefill: one sequence of each prefill length through the whole model at once, with the time
           spent inside causal SDPA reported separately.
Weights are random (SYNTHETIC: throughput only, outputs are meaningless). Prints one JSON object
last (and writes it to --json). Needs torch >= 2.5 (enable_gqa) and a CUDA GPU.

    python3 bench/pytorch_sdpa_anchor.py --contexts 61440,124928 --prefill 32768,124928
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                 vocab=128256, theta=500000.0)
FLOOR_BYTES_PER_S = 4.27e12  # the H200's measured device-to-device rate (docs/DESIGN.md)
LABEL = "SYNTHETIC WEIGHTS (random values, real shapes): throughput only, outputs are meaningless"


class Model:
    """Llama-style decoder with random bf16 weights; fused QKV and gate|up projections."""

    def __init__(self, s, device):
        self.s = s
        g = torch.Generator(device=device).manual_seed(1)
        h, q, kv, f = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["ffn"]

        def weight(rows, cols):
            w = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
            return w.uniform_(-math.sqrt(3.0 / cols), math.sqrt(3.0 / cols), generator=g)

        self.embed = weight(s["vocab"], h)
        self.head = weight(s["vocab"], h)
        self.layers = [dict(qkv=weight(q + 2 * kv, h), o=weight(h, q), gate_up=weight(2 * f, h),
                            down=weight(h, f)) for _ in range(s["layers"])]
        self.norm = torch.ones(h, dtype=torch.bfloat16, device=device)
        d = s["head_dim"]
        self.inv_freq = 1.0 / (s["theta"] ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))

    def weight_bytes(self):
        n = self.embed.numel() + self.head.numel()
        for l in self.layers:
            n += sum(t.numel() for t in l.values())
        return 2 * n

    def rope(self, x, positions):
        # x [B, H, T, D]; positions [T] (the same for every sequence of the batch)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(self, tokens, k_cache, v_cache, start, attention_events=None):
        """tokens [B, T] at positions [start, start + T); caches per layer [B, kv, cap, D]."""
        s = self.s
        b, t = tokens.shape
        h, nq, nkv, d = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]
        positions = torch.arange(start, start + t, device=tokens.device)
        x = self.embed[tokens]
        for i, l in enumerate(self.layers):
            y = F.rms_norm(x, (h,), self.norm, 1e-5)
            qkv = y @ l["qkv"].T
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q = self.rope(q.view(b, t, nq, d).transpose(1, 2), positions)
            k = self.rope(k.view(b, t, nkv, d).transpose(1, 2), positions)
            k_cache[i][:, :, start:start + t] = k
            v_cache[i][:, :, start:start + t] = v.view(b, t, nkv, d).transpose(1, 2)
            keys, values = k_cache[i][:, :, :start + t], v_cache[i][:, :, :start + t]
            if attention_events is not None:
                attention_events.append(torch.cuda.Event(enable_timing=True))
                attention_events[-1].record()
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1 and start == 0,
                                               enable_gqa=True)
            if attention_events is not None:
                attention_events.append(torch.cuda.Event(enable_timing=True))
                attention_events[-1].record()
            x = x + o.transpose(1, 2).reshape(b, t, nq * d) @ l["o"].T
            y = F.rms_norm(x, (h,), self.norm, 1e-5)
            gate, up = (y @ l["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ l["down"].T
        last = F.rms_norm(x[:, -1], (h,), self.norm, 1e-5)
        return (last @ self.head.T).float().argmax(-1)


def kv_caches(s, batch, capacity, device):
    shape = (batch, s["kv_heads"], capacity, s["head_dim"])
    k = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(s["layers"])]
    v = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(s["layers"])]
    return k, v


def kv_bytes_per_token(s):
    return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2


def measure_prefill(model, length, device):
    s = model.s
    k, v = kv_caches(s, 1, length, device)
    tokens = torch.randint(0, s["vocab"], (1, length), device=device)
    model.forward(tokens[:, :min(length, 1024)], k, v, 0)  # warm-up
    torch.cuda.synchronize()
    seconds, attention_ms = math.inf, math.inf
    for _ in range(2 if length <= 32768 else 1):  # best of two where that is cheap
        events = []
        start = time.perf_counter()
        model.forward(tokens, k, v, 0, attention_events=events)
        torch.cuda.synchronize()
        run_seconds = time.perf_counter() - start
        if run_seconds < seconds:
            seconds = run_seconds
            attention_ms = sum(events[i].elapsed_time(events[i + 1])
                               for i in range(0, len(events), 2))
    # Causal attention: QK^T and PV over the lower triangle, 2 FLOP per multiply-add.
    flops = 2 * 2 * (length * (length + 1) / 2) * s["head_dim"] * s["heads"] * s["layers"]
    del k, v
    torch.cuda.empty_cache()
    return dict(tokens=length, seconds=seconds, tokens_per_s=length / seconds,
                attention_seconds=attention_ms / 1e3,
                attention_tflops=flops / (attention_ms / 1e3) / 1e12)


def decode_batch(model, batch, context, steps, warmup, device):
    """Times `steps` decode steps of `batch` sequences at `context`; raises OutOfMemoryError."""
    s = model.s
    capacity = context + warmup + steps
    k, v = kv_caches(s, batch, capacity, device)
    try:
        for t in k + v:  # any finite values: decode time does not depend on them
            t[:, :, :context].normal_()
        tokens = torch.randint(0, s["vocab"], (batch, 1), device=device)
        position = context
        for _ in range(warmup):
            tokens = model.forward(tokens, k, v, position)[:, None]
            position += 1
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            tokens = model.forward(tokens, k, v, position)[:, None]
            position += 1
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        free, total = torch.cuda.mem_get_info()
        events = []  # one more step, timing SDPA alone
        model.forward(tokens, k, v, position, attention_events=events)
        torch.cuda.synchronize()
        attention_ms = sum(events[i].elapsed_time(events[i + 1]) for i in range(0, len(events), 2))
        return seconds, total - free, attention_ms
    finally:
        del k, v
        torch.cuda.empty_cache()


def measure_decode(model, context, steps, warmup, max_batch, reserve_gib, device):
    """The largest batch that fits: sized from the free memory, then one fewer per OOM."""
    s = model.s
    capacity = context + warmup + steps
    free, _ = torch.cuda.mem_get_info()
    per_sequence = kv_bytes_per_token(s) * capacity
    batch = int(min(max_batch, (free - reserve_gib * 2**30) // per_sequence))
    sized = batch
    while batch >= 1:
        try:
            seconds, used, attention_ms = decode_batch(model, batch, context, steps, warmup, device)
            break
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"decode {context}: batch {batch} ran out of memory, trying {batch - 1}",
                  file=sys.stderr)
            batch -= 1
    if batch < 1:
        return dict(context=context, error="not even one sequence fits")
    mean_length = context + warmup + steps / 2
    floor_bytes = model.weight_bytes() - model.embed.numel() * 2 + batch * mean_length * kv_bytes_per_token(s)
    floor_step = floor_bytes / FLOOR_BYTES_PER_S
    return dict(context=context, batch=batch, batch_from_free_memory=sized, steps=steps,
                step_ms=1e3 * seconds / steps, tokens_per_s=batch * steps / seconds,
                sdpa_ms_per_step=attention_ms,
                gpu_bytes_used=used, floor_step_ms=1e3 * floor_step,
                floor_tokens_per_s=batch / floor_step,
                percent_of_floor=100.0 * (batch * steps / seconds) / (batch / floor_step))


def sdpa_backends(device):
    """Which SDPA backends accept the decode and prefill calls (GQA, bf16): the flash kernel is
    the one expected; the math fallback would expand K/V per query head."""
    import warnings
    from torch.nn.attention import SDPBackend, sdpa_kernel
    warnings.filterwarnings("ignore", category=UserWarning)  # each refusal explains itself
    found = {}
    q1 = torch.randn(2, 32, 1, 128, dtype=torch.bfloat16, device=device)
    q = torch.randn(1, 32, 256, 128, dtype=torch.bfloat16, device=device)
    kv = torch.randn(2, 8, 256, 128, dtype=torch.bfloat16, device=device)
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        ok = []
        for label, query, keys, causal in (("decode", q1, kv, False), ("prefill", q, kv[:1], True)):
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(query, keys, keys, is_causal=causal,
                                                   enable_gqa=True)
                ok.append(label)
            except RuntimeError:
                pass
        found[name] = ok
    torch.cuda.synchronize()
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="61440,124928", help="decode contexts, comma-separated")
    p.add_argument("--prefill", default="32768,124928", help="prefill lengths, comma-separated")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--reserve-gib", type=float, default=1.0,
                   help="device memory left free for activations when sizing the batch (a batch "
                        "that still runs out of memory is retried one smaller)")
    p.add_argument("--json", default="", help="also write the JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pytorch_sdpa_anchor: no CUDA device")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    s = LLAMA3_8B
    with torch.inference_mode():
        model = Model(s, device)
        print(f"*** {LABEL} ***", file=sys.stderr)
        report = dict(label=LABEL, torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                      shapes=s, weight_bytes=model.weight_bytes(),
                      sdpa_backends_accepting_gqa=sdpa_backends(device), prefill=[], decode=[])
        print(f"SDPA backends accepting GQA: {report['sdpa_backends_accepting_gqa']}",
              file=sys.stderr)
        for length in [int(x) for x in args.prefill.split(",") if x]:
            try:
                r = measure_prefill(model, length, device)
            except torch.OutOfMemoryError as error:
                r = dict(tokens=length, error=f"out of memory: {error}")
            torch.cuda.empty_cache()
            print(f"prefill {length}: {r}", file=sys.stderr)
            report["prefill"].append(r)
        for context in [int(x) for x in args.contexts.split(",") if x]:
            try:
                r = measure_decode(model, context, args.steps, args.warmup, args.max_batch,
                                   args.reserve_gib, device)
            except torch.OutOfMemoryError as error:
                r = dict(context=context, error=f"out of memory: {error}")
            torch.cuda.empty_cache()
            print(f"decode {context}: {r}", file=sys.stderr)
            report["decode"].append(r)
    text = json.dumps(report, indent=2)
    for r in report["prefill"]:
        if "error" not in r:
            print(f"anchor prefill {r['tokens']}: {r['tokens_per_s']:.0f} tok/s "
                  f"({r['seconds']:.2f} s, attention {r['attention_seconds']:.2f} s = "
                  f"{r['attention_tflops']:.0f} TFLOP/s)", file=sys.stderr)
    for r in report["decode"]:
        if "error" not in r:
            print(f"anchor decode {r['context']}: batch {r['batch']}: {r['tokens_per_s']:.1f} tok/s, "
                  f"step {r['step_ms']:.2f} ms (SDPA {r['sdpa_ms_per_step']:.2f} ms), floor {r['floor_tokens_per_s']:.1f} tok/s "
                  f"({r['percent_of_floor']:.1f}%)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
