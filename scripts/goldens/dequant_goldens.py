#!/usr/bin/env python3
"""Reference values for the GGUF dequantisation and fp16/bf16 tests, from the `gguf` package.

Run with the reference venv:
  /opt/ref/bin/python scripts/goldens/dequant_goldens.py \
      --model ~/.cache/shadowkv/SmolLM2-135M-Instruct.Q4_1.gguf

Writes into tests/data/goldens/ (all little-endian):
  dequant_<type>.bin          raw blocks, then the float32 values gguf.quants.dequantize gives
  dequant_quantize_<type>.bin float32 inputs, then the blocks gguf.quants.quantize makes of them
  dequant_half.bin            float32 inputs, then numpy's fp16 bits, then gguf's bf16 bits
  dequant_goldens.json        manifest: byte and element counts of each file above
  dequant_smollm2.json        a few dequantised rows of the real model (only with --model)
"""

import argparse
import json
import os
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf import quants

REPO = pathlib.Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "goldens"

# Byte offsets of the fp16 scale fields inside one block; random bytes elsewhere are all valid.
SCALE_OFFSETS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def random_blocks(rng, qtype, num_blocks):
    """Random bytes with finite, moderate fp16 scales, so every code pattern appears."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.uniform(1e-4, 0.2, num_blocks) * rng.choice([-1.0, 1.0], num_blocks))
        blocks[:, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def varied_floats(rng, num_blocks, block_size):
    """Normal values with a different magnitude per block, one all-zero block, one constant one."""
    values = rng.standard_normal((num_blocks, block_size)).astype(np.float32)
    magnitudes = np.float32(10.0) ** rng.uniform(-3, 2, (num_blocks, 1)).astype(np.float32)
    values *= magnitudes
    values[1] = 0.0
    values[2] = np.float32(0.75)
    return values.reshape(-1)


def dequant_goldens(rng, manifest):
    for qtype in [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                  T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        if qtype == T.F16:
            specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff,
                                 0x7c00, 0xfc00, 0x7e00, 0x3c00, 0x3555], dtype=np.uint16)
            normals = rng.standard_normal(256 - specials.size).astype(np.float16).view(np.uint16)
            raw = np.concatenate([specials, normals]).view(np.uint8)
        elif qtype == T.BF16:
            raw = rng.integers(0, 65536, 256, dtype=np.uint16).view(np.uint8)
        elif qtype in QUANTIZABLE:
            # Half of the blocks as the reference quantiser makes them, half random.
            quantized = quants.quantize(varied_floats(rng, 4, block_size), qtype).reshape(-1)
            raw = np.concatenate([quantized, random_blocks(rng, qtype, 4)])
        else:
            raw = random_blocks(rng, qtype, 4)
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        expected = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
        name = f"dequant_{qtype.name.lower()}.bin"
        (OUT / name).write_bytes(raw.tobytes() + expected.astype("<f4").tobytes())
        manifest["dequantize"].append({"type": qtype.name, "type_id": int(qtype), "file": name,
                                       "raw_bytes": int(raw.size),
                                       "num_elements": int(expected.size)})


def quantize_goldens(rng, manifest):
    for qtype in [T.Q8_0, T.Q4_0, T.Q4_1]:
        values = varied_floats(rng, 8, 32)
        blocks = np.asarray(quants.quantize(values, qtype), dtype=np.uint8).reshape(-1)
        name = f"dequant_quantize_{qtype.name.lower()}.bin"
        (OUT / name).write_bytes(values.astype("<f4").tobytes() + blocks.tobytes())
        manifest["quantize"].append({"type": qtype.name, "type_id": int(qtype), "file": name,
                                     "num_elements": int(values.size),
                                     "raw_bytes": int(blocks.size)})


def half_goldens(rng, manifest):
    f32 = np.float32
    bits = lambda b: np.array(b, dtype=np.uint32).view(np.float32)
    edge = np.concatenate([
        np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.996, 65520.0, 65536.0, -1e9, 1e-8,
                  2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.5 * 2.0 ** -24,
                  3.5 * 2.0 ** -24, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -11 + 2.0 ** -20,
                  np.inf, -np.inf, np.nan, 3.4e38, 1e-45], dtype=f32),
        bits([0x3f808000, 0x3f818000, 0x3f808001, 0x3f80ffff, 0x7f7fffff, 0xff800000]),
    ])
    magnitudes = f32(10.0) ** rng.uniform(-9, 6, 488).astype(f32)
    values = np.concatenate([edge, rng.standard_normal(488).astype(f32) * magnitudes])
    with np.errstate(over="ignore"):  # values past 65504 are meant to become infinity
        fp16 = values.astype(np.float16).view(np.uint16)
    bf16 = np.asarray(quants.quantize(values, T.BF16)).view(np.uint16)
    (OUT / "dequant_half.bin").write_bytes(values.astype("<f4").tobytes() +
                                           fp16.astype("<u2").tobytes() +
                                           bf16.astype("<u2").tobytes())
    manifest["half"] = {"file": "dequant_half.bin", "num_values": int(values.size)}


def model_goldens(model_path):
    reader = GGUFReader(model_path)
    wanted = {  # tensor: (rows, values per row)
        "token_embd.weight": ([0, 1, 49151], 96),
        "blk.0.attn_q.weight": ([0, 575], 96),
        "blk.29.ffn_down.weight": ([5], 96),
        "blk.0.attn_norm.weight": ([0], 64),
    }
    tensors = []
    for tensor in reader.tensors:
        if tensor.name not in wanted:
            continue
        rows, count = wanted[tensor.name]
        data = tensor.data.reshape(-1, tensor.data.shape[-1]) if tensor.data.ndim > 1 \
            else tensor.data.reshape(1, -1)
        entry = {"name": tensor.name, "type": tensor.tensor_type.name,
                 "shape": [int(d) for d in tensor.shape], "rows": {}}
        for row in rows:
            values = np.asarray(quants.dequantize(data[row], tensor.tensor_type), np.float32)
            entry["rows"][str(row)] = [float(v) for v in values.reshape(-1)[:count]]
        tensors.append(entry)
    return {"file_size": os.path.getsize(model_path), "tensors": tensors}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="SmolLM2-135M-Instruct.Q4_1.gguf, for dequant_smollm2.json")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240601)
    manifest = {"generator": "scripts/goldens/dequant_goldens.py", "dequantize": [],
                "quantize": []}
    dequant_goldens(rng, manifest)
    quantize_goldens(rng, manifest)
    half_goldens(rng, manifest)
    (OUT / "dequant_goldens.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if args.model:
        golden = model_goldens(os.path.expanduser(args.model))
        (OUT / "dequant_smollm2.json").write_text(json.dumps(golden) + "\n")


if __name__ == "__main__":
    main()
