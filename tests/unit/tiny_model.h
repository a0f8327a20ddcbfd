// A tiny llama/qwen2-shaped GGUF model with random weights and a byte-level vocabulary, for tests
// (also phi3: fused QKV and gate|up, LongRoPE; glm4: biases, half rotation, post norms; chatglm:
// glm4's form without the post norms, as llama.cpp converts GlmForCausalLM).
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "format/gguf_writer.h"

namespace shadowkv::testing {

struct TinyModelSpec {
  std::string architecture = "llama";
  int layers = 2;
  int hidden = 64;
  int heads = 4;
  int kv_heads = 2;
  int ffn = 96;
  int context = 512;
  gguf::GgmlType weight_type = gguf::GgmlType::kQ8_0;
  bool tied = true;
  uint32_t seed = 1;
  bool skip_ffn_down = false;  // leave a tensor out (error tests)
  // llama only (Mistral-style): a sliding window of this many tokens, in the layers `windowed`
  // names (one flag per layer, written as the per-layer pattern; empty: every layer slides).
  int sliding_window = 0;
  std::vector<bool> windowed;
};

// GPT-2's printable stand-in for a byte, as UTF-8.
inline std::string ByteToken(int byte) {
  int code = byte;
  if (!((byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || (byte >= 174))) {
    int n = 0;
    for (int b = 0; b < byte; ++b) {
      if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174))) ++n;
    }
    code = 256 + n;
  }
  std::string out;
  if (code < 0x80) {
    out += static_cast<char>(code);
  } else {
    out += static_cast<char>(0xC0 | (code >> 6));
    out += static_cast<char>(0x80 | (code & 0x3F));
  }
  return out;
}

inline std::vector<uint8_t> MakeTinyModel(const TinyModelSpec& s) {
  gguf::GgufWriter w;
  const std::string a = s.architecture;
  w.AddString("general.architecture", a);
  w.AddString("general.name", "tiny-test");
  w.AddUint32(a + ".block_count", s.layers);
  w.AddUint32(a + ".embedding_length", s.hidden);
  w.AddUint32(a + ".attention.head_count", s.heads);
  w.AddUint32(a + ".attention.head_count_kv", s.kv_heads);
  w.AddUint32(a + ".feed_forward_length", s.ffn);
  w.AddUint32(a + ".context_length", s.context);
  w.AddFloat32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.AddFloat32(a + ".rope.freq_base", 10000.0f);
  if (s.sliding_window > 0) {
    w.AddUint32(a + ".attention.sliding_window", s.sliding_window);
    if (!s.windowed.empty()) {
      gguf::Value pattern;
      pattern.type = gguf::ValueType::kArray;
      pattern.element_type = gguf::ValueType::kBool;
      std::vector<gguf::Value> flags;
      for (bool slides : s.windowed) {
        gguf::Value flag;
        flag.type = gguf::ValueType::kBool;
        flag.data.emplace<bool>(slides);
        flags.push_back(flag);
      }
      pattern.data = std::move(flags);
      (void)w.AddValue(a + ".attention.sliding_window_pattern", std::move(pattern));
    }
  }
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteToken(b));
  tokens.push_back("<|endoftext|>");
  tokens.push_back("<|im_start|>");
  tokens.push_back("<|im_end|>");
  std::vector<int32_t> types(tokens.size(), 1);
  types[256] = types[257] = types[258] = 3;
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddString("tokenizer.ggml.pre", "smollm");
  w.AddStringArray("tokenizer.ggml.tokens", tokens);
  w.AddInt32Array("tokenizer.ggml.token_type", types);
  w.AddStringArray("tokenizer.ggml.merges", {});
  w.AddUint32("tokenizer.ggml.bos_token_id", 256);
  w.AddUint32("tokenizer.ggml.eos_token_id", 258);
  w.AddBool("tokenizer.ggml.add_bos_token", false);

  const int vocab = static_cast<int>(tokens.size());
  const int head_dim = s.hidden / s.heads;
  const bool glm = a == "glm4" || a == "chatglm";
  const bool fused_gate_up = a == "phi3" || glm;
  if (glm) w.AddUint32(a + ".rope.dimension_count", head_dim / 2);
  if (a == "phi3") {
    // LongRoPE over half the context: the long factors and an attention factor apply.
    w.AddUint32(a + ".rope.scaling.original_context_length", s.context / 2);
    std::vector<float> long_factors(head_dim / 2), short_factors(head_dim / 2);
    for (int i = 0; i < head_dim / 2; ++i) {
      long_factors[i] = 1.0f + 0.25f * i;
      short_factors[i] = 1.0f + 0.05f * i;
    }
    (void)w.AddTensorFromFloats("rope_factors_long.weight", {head_dim / 2}, gguf::GgmlType::kF32,
                                long_factors);
    (void)w.AddTensorFromFloats("rope_factors_short.weight", {head_dim / 2}, gguf::GgmlType::kF32,
                                short_factors);
  }
  std::mt19937 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto add = [&](const std::string& name, std::vector<int64_t> shape, gguf::GgmlType type,
                 float scale, float offset = 0.0f) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    std::vector<float> values(count);
    for (auto& v : values) v = offset + scale * normal(rng);
    (void)w.AddTensorFromFloats(name, shape, type, values);
  };
  const float proj = 1.0f / std::sqrt(static_cast<float>(s.hidden));
  add("token_embd.weight", {s.hidden, vocab}, s.weight_type, 1.0f);
  if (!s.tied) add("output.weight", {s.hidden, vocab}, s.weight_type, proj);
  add("output_norm.weight", {s.hidden}, gguf::GgmlType::kF32, 0.1f, 1.0f);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {s.hidden}, gguf::GgmlType::kF32, 0.1f, 1.0f);
    add(p + "ffn_norm.weight", {s.hidden}, gguf::GgmlType::kF32, 0.1f, 1.0f);
    if (a == "phi3") {
      add(p + "attn_qkv.weight", {s.hidden, (s.heads + 2 * s.kv_heads) * head_dim}, s.weight_type,
          proj * 2.0f);
    } else {
      add(p + "attn_q.weight", {s.hidden, s.heads * head_dim}, s.weight_type, proj * 2.0f);
      add(p + "attn_k.weight", {s.hidden, s.kv_heads * head_dim}, s.weight_type, proj * 2.0f);
      add(p + "attn_v.weight", {s.hidden, s.kv_heads * head_dim}, s.weight_type, proj);
    }
    if (a == "glm4") {
      add(p + "post_attention_norm.weight", {s.hidden}, gguf::GgmlType::kF32, 0.1f, 1.0f);
      add(p + "post_ffw_norm.weight", {s.hidden}, gguf::GgmlType::kF32, 0.1f, 1.0f);
    }
    if (a == "qwen2" || glm) {
      add(p + "attn_q.bias", {s.heads * head_dim}, gguf::GgmlType::kF32, 0.1f);
      add(p + "attn_k.bias", {s.kv_heads * head_dim}, gguf::GgmlType::kF32, 0.1f);
      add(p + "attn_v.bias", {s.kv_heads * head_dim}, gguf::GgmlType::kF32, 0.1f);
    }
    add(p + "attn_output.weight", {s.heads * head_dim, s.hidden}, s.weight_type, proj);
    if (fused_gate_up) {
      add(p + "ffn_up.weight", {s.hidden, 2 * s.ffn}, s.weight_type, proj);
    } else {
      add(p + "ffn_gate.weight", {s.hidden, s.ffn}, s.weight_type, proj);
      add(p + "ffn_up.weight", {s.hidden, s.ffn}, s.weight_type, proj);
    }
    if (!s.skip_ffn_down) add(p + "ffn_down.weight", {s.ffn, s.hidden}, s.weight_type, proj);
  }
  return w.Finish();
}

// Writes the model to a unique temporary file and returns its path.
inline std::string WriteTinyModel(const TinyModelSpec& spec, const std::string& tag) {
  // The process id keeps parallel test processes off each other's (memory-mapped) files.
  const std::string path = ::testing::TempDir() + "/tiny_" + tag + "_" +
                           std::to_string(static_cast<long>(getpid())) + ".gguf";
  std::vector<uint8_t> bytes = MakeTinyModel(spec);
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return path;
}

// The small models of the whole-model GPU tests: 2 layers, FFN twice the hidden size,
// context 1024.
inline TinyModelSpec SmallSpec(const char* architecture, int hidden, int heads, int kv_heads,
                               gguf::GgmlType type, bool tied, uint32_t seed) {
  TinyModelSpec s;
  s.architecture = architecture;
  s.hidden = hidden;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.ffn = 2 * hidden;
  s.layers = 2;
  s.context = 1024;
  s.weight_type = type;
  s.tied = tied;
  s.seed = seed;
  return s;
}

// `count` tokens below 256 (every tiny vocabulary has them).
inline std::vector<int32_t> SomeTokens(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(count);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 256);
  return tokens;
}

}  // namespace shadowkv::testing
