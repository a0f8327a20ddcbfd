#!/usr/bin/env python3
"""Writes tiny random-weight models of each supported family, and transformers' logits for them.

For each family a model is built from that family's transformers configuration class with a few
layers and a small hidden size but its real structural features (GQA, a head dimension that is
not hidden/heads, QK norm, sliding-window layers with a window shorter than the test prompt),
with weights drawn from a seeded generator. The model is written to GGUF with gguf-py in
llama.cpp's tensor names and metadata keys for the architecture (including the converter's own
transformations: Gemma's norm weights stored as 1 + w, llama's Q/K rows permuted for paired
rotation), as float32. The goldens are transformers' float32 logits (eager attention, CPU) for
a seeded token-id prompt, and 32 greedy tokens computed by re-running the whole sequence at
every step (no KV cache in the reference).

Usage (the /opt/hf venv: torch, transformers, gguf, numpy; versions in the README):
  /opt/hf/bin/python scripts/goldens/tiny_family_goldens.py [--only FAMILY ...]
Writes tests/data/goldens/tiny_FAMILY.{gguf,json,f32}.
"""
import argparse
import hashlib
import math
import json
import pathlib
import platform

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "goldens"

VOCAB = 272  # 256 byte tokens, 2 merges, special and unused tokens
PROMPT_TOKENS = 40
CONTINUATION_TOKENS = 32
WINDOW = 8  # sliding window, well under the prompt length
SEED = 2024


def Sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def ByteTokens():
    """GPT-2's byte-to-printable-character map, as the byte-level BPE vocabulary stores bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(
        range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def Vocabulary():
    tokens = ByteTokens()
    merges = ["\u0120 t", "h e"]
    tokens += ["\u0120t", "he"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    while len(tokens) < VOCAB:
        tokens.append(f"<unused{len(tokens)}>")
    types = [1] * (256 + len(merges)) + [3] * (VOCAB - 256 - len(merges))
    return tokens, types, merges


# family -> how to build it. `arch`: the GGUF architecture; `pre`: tokenizer.ggml.pre.
FAMILIES = {
    "qwen3": {"arch": "qwen3", "pre": "qwen2"},
    "gemma3": {"arch": "gemma3", "pre": "default"},
    "mistral": {"arch": "llama", "pre": "default"},
    "phi3": {"arch": "phi3", "pre": "default"},
    "glm4": {"arch": "glm4", "pre": "default"},
    "chatglm": {"arch": "chatglm", "pre": "chatglm-bpe"},
}

PHI3_ORIGINAL_CONTEXT = 16  # LongRoPE's pretraining length, under the prompt's 40 tokens


def BuildModel(family, torch, transformers):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, attn_implementation="eager")
    if family == "qwen3":
        # head_dim 64 (not hidden / heads = 16), one the CUDA attention kernels take too.
        config = transformers.Qwen3Config(num_hidden_layers=3, head_dim=64,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0},
                                          tie_word_embeddings=True, **common)
        model = transformers.Qwen3ForCausalLM(config)
    elif family == "gemma3":
        layer_types = ["sliding_attention", "sliding_attention", "full_attention",
                       "sliding_attention"]
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
            layer_types=layer_types, final_logit_softcapping=8.0, attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default",
                                                "rope_theta": 1000000.0}},
            tie_word_embeddings=True, **common)
        model = transformers.Gemma3ForCausalLM(config)
    elif family == "mistral":
        config = transformers.MistralConfig(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                            rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0},
                                            tie_word_embeddings=False, **common)
        model = transformers.MistralForCausalLM(config)
    elif family == "phi3":
        # Fused qkv_proj and gate_up_proj; LongRoPE with factors away from 1, max positions
        # 256 over an original 16: the prompt is past 16 tokens, so transformers rotates every
        # position with the long factors and scales cos/sin by sqrt(1 + ln 16 / ln 16).
        rotary_pairs = 8  # head_dim 16
        config = transformers.Phi3Config(
            num_hidden_layers=2, sliding_window=None, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
                             "long_factor": [1.0 + 0.75 * i for i in range(rotary_pairs)],
                             "short_factor": [1.0 + 0.1 * i for i in range(rotary_pairs)]},
            tie_word_embeddings=False, **common)
        model = transformers.Phi3ForCausalLM(config)
    elif family == "glm4":
        # Q/K/V biases, rotation of the first half of each head in interleaved pairs, norms
        # after attention and after the MLP too, fused gate_up_proj.
        config = transformers.Glm4Config(
            num_hidden_layers=2, head_dim=16, attention_bias=True, pad_token_id=None,
            eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5},
            tie_word_embeddings=False, **common)
        model = transformers.Glm4ForCausalLM(config)
    elif family == "chatglm":
        # GLM-4-9B-chat's form: Q/K/V biases, rotation of the first half of each head in
        # interleaved pairs, fused gate_up_proj, no norms after attention or MLP; head_dim 32
        # (not hidden / heads = 16).
        config = transformers.GlmConfig(
            num_hidden_layers=2, head_dim=32, attention_bias=True, pad_token_id=None,
            eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5},
            tie_word_embeddings=False, **common)
        model = transformers.GlmForCausalLM(config)
    else:
        raise ValueError(family)
    # Seeded weights of a scale that keeps activations in a useful range; norm weights away
    # from 1 so that a wrong norm convention shows.
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                base = 0.0 if family == "gemma3" else 1.0  # Gemma scales by (1 + w)
                parameter.copy_(base + 0.2 * torch.randn(parameter.shape, generator=generator))
            else:
                scale = 0.15
                if "embed_tokens" in name:  # Gemma multiplies embeddings by sqrt(hidden)
                    scale = 0.1 if family == "gemma3" else 0.5
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))
    model.eval()
    return model, config


def PermuteForPairs(weights, heads):
    """llama.cpp's converter reorders Q/K rows so that rotation pairs are adjacent."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def FuseQkv(state, num_layers):
    """Q, K and V (weights and biases) as one q|k|v tensor per layer, as ChatGLM checkpoints hold
    query_key_value and llama.cpp's converter writes it to attn_qkv."""
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.self_attn."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{prefix}{p}_proj.{kind}") for p in ("q", "k", "v")]
            state[f"{prefix}qkv_proj.{kind}"] = np.concatenate(parts, axis=0)
    return state


def HeadDim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def WriteGguf(path, family, model, config, gguf):
    spec = FAMILIES[family]
    arch = spec["arch"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(HeadDim(config))
    writer.add_value_length(HeadDim(config))
    if family == "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern(
            [t == "sliding_attention" for t in config.layer_types])
        writer.add_float32(f"{arch}.final_logit_softcapping", config.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if family == "phi3":  # as llama.cpp's Phi-3 converter writes LongRoPE
        rope = config.rope_parameters
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_dimension_count(HeadDim(config))
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if family == "mistral":
        writer.add_sliding_window(config.sliding_window)
    if family in ("glm4", "chatglm"):
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(HeadDim(config) * rope["partial_rotary_factor"]))
    tokens, types, merges = Vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)

    state = {k: v.detach().to(dtype=__import__("torch").float32).numpy()
             for k, v in model.state_dict().items()}
    if family == "chatglm":
        state = FuseQkv(state, config.num_hidden_layers)
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        # phi3's fused projections, stored fused (q|k|v rows; gate rows then up rows)
        "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    }
    if family == "glm4":  # GLM-4's four norms per block, as llama.cpp names them
        names.update({"post_self_attn_layernorm": "post_attention_norm",
                      "post_attention_layernorm": "ffn_norm",
                      "post_mlp_layernorm": "post_ffw_norm"})
    if family == "gemma3":  # Gemma's four norms per block
        names.update({"post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    for key, value in state.items():
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            parts = key.split(".")  # model.layers.L.<module...>.weight
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            name = f"blk.{layer}.{names[module]}.{kind}"
            if family == "mistral" and module == "self_attn.q_proj":
                value = PermuteForPairs(value, config.num_attention_heads)
            if family == "mistral" and module == "self_attn.k_proj":
                value = PermuteForPairs(value, config.num_key_value_heads)
        if family == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0  # as llama.cpp's Gemma converter stores them
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def Run(family, torch, transformers, gguf):
    model, config = BuildModel(family, torch, transformers)
    gguf_path = GOLDEN_DIR / f"tiny_{family}.gguf"
    WriteGguf(gguf_path, family, model, config, gguf)

    rng = np.random.default_rng(SEED)
    prompt = rng.integers(0, 256, size=PROMPT_TOKENS).tolist()  # byte tokens only
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].to(torch.float32).numpy()
        sequence = list(prompt)
        for _ in range(CONTINUATION_TOKENS):
            row = model(torch.tensor([sequence])).logits[0, -1].to(torch.float32).numpy()
            sequence.append(int(np.argmax(row)))  # numpy: first maximum, the smaller id
    n = len(prompt)
    positions = sorted({0, 1, n // 4, n // 2, n - 2, n - 1})
    rows = np.ascontiguousarray(logits[positions], dtype="<f4")
    f32_path = GOLDEN_DIR / f"tiny_{family}.f32"
    rows.tofile(f32_path)
    golden = {
        "format_version": 1,
        "name": f"tiny_{family}",
        "family": family,
        "architecture": FAMILIES[family]["arch"],
        "model": {"file": gguf_path.name, "sha256": Sha256(gguf_path)},
        "reference": {"transformers": transformers.__version__, "torch": torch.__version__,
                      "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "",
                      "python": platform.python_version(), "class": type(model).__name__,
                      "dtype": "float32", "attention": "eager"},
        "config": json.loads(config.to_json_string()),
        "num_vocab": VOCAB,
        "num_tokens": n,
        "tokens": prompt,
        "full_logits": {"file": f32_path.name, "dtype": "float32", "byte_order": "little",
                        "positions": positions, "shape": list(rows.shape)},
        "prompt_top_ids": [int(np.argmax(logits[p])) for p in range(n)],
        "continuation": {"num_tokens": CONTINUATION_TOKENS, "tokens": sequence[n:]},
    }
    (GOLDEN_DIR / f"tiny_{family}.json").write_text(json.dumps(golden, sort_keys=True) + "\n")
    print(f"{family}: {gguf_path.stat().st_size} bytes of GGUF, continuation {sequence[n:][:8]}...")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    args = parser.parse_args()
    import torch
    import transformers
    import gguf
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    for family in args.only:
        Run(family, torch, transformers, gguf)


if __name__ == "__main__":
    main()
