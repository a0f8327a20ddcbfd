#!/usr/bin/env python3
"""Writes reference logits of the exact default model, computed by Hugging Face transformers.

The GGUF's Q4_1/Q8_0 weights are dequantised to float32 by transformers' GGUF loader (through
gguf-py) and the model runs with float32 arithmetic only: eager attention, float32 KV cache, on
the CPU. Unlike llama.cpp (logits_goldens.py), which rounds activations to 8 bits inside its
quantised matmuls, this is the model's exact arithmetic up to float32 rounding.

The prompt token ids are those of the llama.cpp goldens (tests/data/goldens/logits_NAME.json),
not re-tokenised, so both goldens describe the same inputs; whether transformers' own tokenizer
gives the same ids is recorded as `reference.hf_tokenizer_matches`. The output layout is that of
the llama.cpp goldens, see scripts/goldens/README.md.

Usage (a venv with torch, transformers, gguf, numpy, sentencepiece; versions in the README):
  /opt/hf/bin/python scripts/goldens/hf_goldens.py [--model PATH] [--only NAME ...]
      [--fp64-check]    # also runs the prompt in float64 and records the largest difference
  /opt/hf/bin/python scripts/goldens/hf_goldens.py compare   # HF vs llama.cpp, per prompt
"""
import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT_DIR = REPO_ROOT / "tests" / "data" / "prompts"
GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "goldens"

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# name -> parse special tokens (as in logits_goldens.py; only the chat prompt has them).
PROMPTS = {
    "short_question": False,
    "jargon_1k": False,
    "code_unicode_1k": False,
    "jargon_4k": False,
    "chat_capital": True,
}

NUM_THREADS = 2
TOP_K = 5
NUM_CONTINUATION_TOKENS = 64
# Token texts counted as end of generation besides the GGUF's eos id, so that eog_steps means
# what it means in the llama.cpp goldens: llama.cpp's llama_vocab_is_eog holds for exactly ids
# {0, 2, 4} of this model, <reponame> (4) because it takes it for a fill-in-the-middle token.
EOG_TOKEN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<reponame>")


def Sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def Float32Json(value):
    """Shortest decimal that reads back (as double, then cast to float) to the same float32."""
    return float(str(np.float32(value)))


def TopK(row):
    """Top TOP_K (ids, logits) of one float32 logit row: logit descending, ties to smaller id."""
    threshold = np.partition(row, row.size - TOP_K)[row.size - TOP_K]
    candidates = np.flatnonzero(row >= threshold)
    order = sorted(candidates.tolist(), key=lambda token: (-float(row[token]), token))[:TOP_K]
    return order, [Float32Json(row[token]) for token in order]


def LogSumExp(row):
    row64 = row.astype(np.float64)
    peak = row64.max()
    return float(peak + np.log(np.exp(row64 - peak).sum()))


def LoadLlamaCppGolden(name):
    with open(GOLDEN_DIR / f"logits_{name}.json", encoding="utf-8") as handle:
        return json.load(handle)


def LoadModel(model_path, torch, transformers):
    """Model in float32 with eager attention, and the GGUF's tokenizer. transformers wants a
    directory and a file name; a temporary directory with a link to the model keeps the user's
    cache directory free of anything it might write."""
    work_dir = pathlib.Path(tempfile.mkdtemp(prefix="hf_goldens_"))
    os.symlink(model_path.resolve(), work_dir / MODEL_FILE)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(work_dir, gguf_file=MODEL_FILE)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            work_dir, gguf_file=MODEL_FILE, dtype=torch.float32, attn_implementation="eager")
    finally:
        shutil.rmtree(work_dir)
    model.eval()
    return model, tokenizer


def CheckModel(model, model_path, torch):
    """Everything float32, tied output head, and the Q projection undone from GGUF's RoPE row
    order: checked against gguf-py's own dequantisation of one layer."""
    import gguf
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            sys.exit(f"{name} is {tensor.dtype}, not float32")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        sys.exit("lm_head is not tied to the token embedding (the GGUF has no output.weight)")
    reader = gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in reader.tensors}
    q = tensors["blk.0.attn_q.weight"]
    q_gguf = gguf.dequantize(q.data, q.tensor_type)  # [num_heads * head_dim, hidden]
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    # GGUF stores each head's rows interleaved (pairs rotated together are adjacent); HF keeps the
    # first and second halves of a head apart.
    q_hf_order = (q_gguf.reshape(config.num_attention_heads, head_dim // 2, 2, -1)
                  .swapaxes(1, 2).reshape(q_gguf.shape))
    q_model = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    if not np.array_equal(q_model, q_hf_order):
        sys.exit("layer 0 q_proj differs from the de-interleaved GGUF tensor")


def Settings(config, num_tokens, parse_special):
    return {
        "n_ctx": int(config.max_position_embeddings),
        "n_threads": NUM_THREADS,
        # The whole prompt in one forward pass.
        "n_batch": num_tokens,
        "n_ubatch": num_tokens,
        "logits_all": True,
        "seed": None,
        "flash_attn": False,
        "kv_cache_type_k": "f32",
        "kv_cache_type_v": "f32",
        "add_bos": False,
        "parse_special": parse_special,
        "dtype": "float32",
        "attn_implementation": "eager",
        "weights": "GGUF dequantised to float32 by gguf-py",
        "rope_theta": float(getattr(config, "rope_theta", None) or
                            config.rope_parameters["rope_theta"]),
        "rms_norm_eps": Float32Json(config.rms_norm_eps),
    }


def ComputeGolden(model, tokenizer, torch, name, reference, model_info, options):
    parse_special = PROMPTS[name]
    cpp = LoadLlamaCppGolden(name)
    prompt_file = cpp["prompt_file"]
    prompt_bytes = (PROMPT_DIR / prompt_file).read_bytes()
    if prompt_bytes.decode("utf-8") != cpp["prompt_text"]:
        sys.exit(f"{prompt_file} changed since logits_{name}.json was written")
    tokens = [int(t) for t in cpp["tokens"]]
    num_tokens = len(tokens)
    num_vocab = int(model.config.vocab_size)

    # Extra evidence only: the ids above are used whatever this gives. The GGUF adds no BOS.
    hf_tokens = tokenizer(cpp["prompt_text"], add_special_tokens=False,
                          split_special_tokens=not parse_special)["input_ids"]
    reference = dict(reference)
    reference["hf_tokenizer_matches"] = hf_tokens == tokens
    if hf_tokens != tokens:
        first = next((i for i, (a, b) in enumerate(zip(hf_tokens, tokens)) if a != b),
                     min(len(hf_tokens), len(tokens)))
        reference["hf_tokenizer_first_mismatch"] = first
        reference["hf_tokenizer_num_tokens"] = len(hf_tokens)

    input_ids = torch.tensor([tokens], dtype=torch.long)
    with torch.inference_mode():
        output = model(input_ids=input_ids, use_cache=True)
        scores = output.logits[0].numpy().astype(np.float32, copy=True)  # [num_tokens, vocab]
        cache = output.cache
        if options.fp64_check:
            model64 = options.model64
            scores64 = model64(input_ids=input_ids, use_cache=False).logits[0].numpy()
            reference["fp64_max_abs_diff_prompt"] = float(
                np.max(np.abs(scores.astype(np.float64) - scores64)))
            del scores64
    for layer in cache.layers:
        if layer.keys.dtype != torch.float32 or layer.values.dtype != torch.float32:
            sys.exit("KV cache is not float32")

    prompt_top_ids, prompt_top_logits, prompt_logsumexp = [], [], []
    for row in scores:
        ids, values = TopK(row)
        prompt_top_ids.append(ids)
        prompt_top_logits.append(values)
        prompt_logsumexp.append(LogSumExp(row))

    positions = cpp["full_logits"]["positions"]
    logits_file = f"hf_{name}.f32"
    scores[positions, :].astype("<f4").tofile(GOLDEN_DIR / logits_file)

    # Greedy continuation, one token at a time through the float32 KV cache.
    generated, step_top_ids, step_top_logits, step_margins = [], [], [], []
    last_logits = scores[num_tokens - 1]
    with torch.inference_mode():
        for step in range(NUM_CONTINUATION_TOKENS):
            ids, values = TopK(last_logits)
            step_top_ids.append(ids)
            step_top_logits.append(values)
            step_margins.append(values[0] - values[1])
            token = int(np.flatnonzero(last_logits == last_logits.max())[0])
            generated.append(token)
            if step + 1 < NUM_CONTINUATION_TOKENS:
                output = model(input_ids=torch.tensor([[token]], dtype=torch.long),
                               cache=cache, use_cache=True)
                cache = output.cache
                last_logits = output.logits[0, -1].numpy().astype(np.float32, copy=True)

    eos_token_id = int(tokenizer.eos_token_id)
    eog_ids = {eos_token_id} | {tokenizer.convert_tokens_to_ids(t) for t in EOG_TOKEN_TEXTS}
    eog_steps = [i for i, token in enumerate(generated) if token in eog_ids]

    return {
        "format_version": 1,
        "name": name,
        "prompt_file": prompt_file,
        "prompt_text": cpp["prompt_text"],
        "model": model_info,
        "reference": reference,
        "settings": Settings(model.config, num_tokens, parse_special),
        "num_vocab": num_vocab,
        "num_tokens": num_tokens,
        "tokens": tokens,
        "full_logits": {
            "file": logits_file,
            "dtype": "float32",
            "byte_order": "little",
            "layout": "row-major [num_positions, num_vocab], row i is the logits at positions[i]",
            "positions": positions,
            "shape": [len(positions), num_vocab],
        },
        "top_k": TOP_K,
        "prompt_top_ids": prompt_top_ids,
        "prompt_top_logits": prompt_top_logits,
        "prompt_logsumexp": [round(v, 5) for v in prompt_logsumexp],
        "continuation": {
            "num_tokens": NUM_CONTINUATION_TOKENS,
            "rule": "argmax of logits (smallest id on ties), no penalties, no stop on EOS",
            "tokens": generated,
            "text": tokenizer.decode(generated, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False),
            "step_top_ids": step_top_ids,
            "step_top_logits": step_top_logits,
            # top-1 minus top-2 logit at each step, so a test can tell a near-tie.
            "step_top2_margin": [Float32Json(m) for m in step_margins],
            "eos_token_id": eos_token_id,
            "eog_token_ids": sorted(eog_ids),
            "eog_steps": eog_steps,
            "eos_occurred": bool(eog_steps),
        },
    }


def ReferenceInfo(torch, transformers):
    from importlib.metadata import version  # gguf has no __version__
    return {
        "implementation": (f"Hugging Face transformers {transformers.__version__} "
                           f"(LlamaForCausalLM, eager attention) on torch {torch.__version__}, "
                           "float32 on the CPU"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": version("gguf"),
        "numpy_version": np.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
        "prompt_tokens_from": "logits_NAME.json (llama.cpp goldens), not re-tokenised",
        "host": platform.machine(),
        "generated_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def WriteGoldens(options):
    import torch
    import transformers
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    # "highest" keeps float32 matmuls in float32 (no bf16 or TF32 inner products).
    torch.set_float32_matmul_precision("highest")

    model_sha = Sha256(options.model)
    if model_sha != MODEL_SHA256:
        sys.exit(f"model sha256 {model_sha} != expected {MODEL_SHA256}")
    model_info = {"file": MODEL_FILE, "sha256": model_sha}
    model, tokenizer = LoadModel(options.model, torch, transformers)
    CheckModel(model, options.model, torch)
    if options.fp64_check:
        import copy
        options.model64 = copy.deepcopy(model).to(torch.float64)
    reference = ReferenceInfo(torch, transformers)

    for name in options.only or PROMPTS:
        golden = ComputeGolden(model, tokenizer, torch, name, reference, model_info, options)
        out = GOLDEN_DIR / f"hf_{name}.json"
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(golden, handle, ensure_ascii=False, separators=(",", ":"))
            handle.write("\n")
        print(f"{name}: {golden['num_tokens']} tokens, tokenizer matches: "
              f"{golden['reference']['hf_tokenizer_matches']}, continuation: "
              f"{golden['continuation']['text'][:60]!r} -> {out.name}", flush=True)


def Compare(options):
    """HF goldens against the llama.cpp ones, per prompt: the largest |logit difference| over the
    shared full-logit rows and over the top-1 logits at every position, how often the top-1 ids
    agree, and for how many steps the greedy continuations stay identical."""
    for name in options.only or PROMPTS:
        with open(GOLDEN_DIR / f"hf_{name}.json", encoding="utf-8") as handle:
            hf = json.load(handle)
        cpp = LoadLlamaCppGolden(name)
        if hf["full_logits"]["positions"] != cpp["full_logits"]["positions"]:
            sys.exit(f"{name}: full-logit positions differ")
        shape = hf["full_logits"]["shape"]
        hf_rows = np.fromfile(GOLDEN_DIR / hf["full_logits"]["file"], "<f4").reshape(shape)
        cpp_rows = np.fromfile(GOLDEN_DIR / cpp["full_logits"]["file"], "<f4").reshape(shape)
        row_diff = np.abs(hf_rows.astype(np.float64) - cpp_rows)
        agree = [a[0] == b[0] for a, b in zip(hf["prompt_top_ids"], cpp["prompt_top_ids"])]
        top1_diff = max(abs(a[0] - b[0]) for a, b, same in
                        zip(hf["prompt_top_logits"], cpp["prompt_top_logits"], agree) if same)
        hf_gen, cpp_gen = hf["continuation"]["tokens"], cpp["continuation"]["tokens"]
        same_steps = next((i for i, (a, b) in enumerate(zip(hf_gen, cpp_gen)) if a != b),
                          len(hf_gen))
        print(f"{name}: {hf['num_tokens']} tokens; full rows {hf['full_logits']['positions']}: "
              f"max |diff| {row_diff.max():.4f}, mean {row_diff.mean():.4f}; top-1 id agrees at "
              f"{sum(agree)}/{len(agree)} positions ({100.0 * sum(agree) / len(agree):.1f}%), "
              f"max |top-1 logit diff| there {top1_diff:.4f}; continuations identical for "
              f"{same_steps}/{len(hf_gen)} steps (HF margin at step {min(same_steps, len(hf_gen) - 1)}: "
              f"{hf['continuation']['step_top2_margin'][min(same_steps, len(hf_gen) - 1)]})")


def Main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["goldens", "compare"], default="goldens")
    parser.add_argument("--model", type=pathlib.Path, default=pathlib.Path(
        os.environ.get("SHADOWKV_MODEL", pathlib.Path.home() / ".cache/shadowkv" / MODEL_FILE)))
    parser.add_argument("--only", nargs="*", choices=list(PROMPTS), default=None)
    parser.add_argument("--fp64-check", action="store_true",
                        help="also run each prompt in float64; records the largest difference")
    options = parser.parse_args()
    if options.command == "compare":
        Compare(options)
    else:
        WriteGoldens(options)


if __name__ == "__main__":
    Main()
