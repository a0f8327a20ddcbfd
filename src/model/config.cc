// ModelConfig::FromGguf: metadata keys per architecture, checked for consistency.
#include "model/config.h"

#include <cmath>

namespace shadowkv {

const char* SupportedArchitectures() { return "llama, qwen2"; }

namespace {

Result<int64_t> PositiveInt(const gguf::GgufFile& file, const std::string& key) {
  SKV_ASSIGN_OR_RETURN(int64_t value, file.GetInt(key));
  if (value <= 0 || value > (int64_t{1} << 31)) {
    return Error(ErrorCode::kCorrupt, "metadata '{}' = {} is not a sensible positive size", key,
                 value);
  }
  return value;
}

}  // namespace

Result<ModelConfig> ModelConfig::FromGguf(const gguf::GgufFile& file) {
  ModelConfig c;
  SKV_ASSIGN_OR_RETURN(c.architecture, file.GetString("general.architecture"));
  if (c.architecture != "llama" && c.architecture != "qwen2") {
    return Error(ErrorCode::kUnsupported, "architecture '{}' is not supported (supported: {})",
                 c.architecture, SupportedArchitectures());
  }
  const std::string& a = c.architecture;
  if (auto name = file.GetString("general.name"); name.ok()) c.name = name.value();
  SKV_ASSIGN_OR_RETURN(int64_t layers, PositiveInt(file, a + ".block_count"));
  SKV_ASSIGN_OR_RETURN(int64_t hidden, PositiveInt(file, a + ".embedding_length"));
  SKV_ASSIGN_OR_RETURN(int64_t heads, PositiveInt(file, a + ".attention.head_count"));
  int64_t kv_heads = heads;
  if (file.Find(a + ".attention.head_count_kv")) {
    SKV_ASSIGN_OR_RETURN(kv_heads, PositiveInt(file, a + ".attention.head_count_kv"));
  }
  SKV_ASSIGN_OR_RETURN(int64_t ffn, PositiveInt(file, a + ".feed_forward_length"));
  SKV_ASSIGN_OR_RETURN(int64_t context, PositiveInt(file, a + ".context_length"));
  SKV_ASSIGN_OR_RETURN(double eps, file.GetFloat(a + ".attention.layer_norm_rms_epsilon"));
  c.num_layers = static_cast<int>(layers);
  c.hidden_size = static_cast<int>(hidden);
  c.num_query_heads = static_cast<int>(heads);
  c.num_kv_heads = static_cast<int>(kv_heads);
  c.ffn_size = static_cast<int>(ffn);
  c.context_length = context;
  c.rms_norm_eps = static_cast<float>(eps);
  if (hidden % heads != 0) {
    return Error(ErrorCode::kCorrupt, "embedding length {} is not a multiple of {} heads", hidden,
                 heads);
  }
  c.head_dim = static_cast<int>(hidden / heads);
  if (file.Find(a + ".attention.key_length")) {
    SKV_ASSIGN_OR_RETURN(int64_t key_length, PositiveInt(file, a + ".attention.key_length"));
    if (key_length != c.head_dim) {
      return Error(ErrorCode::kUnsupported, "key length {} differs from hidden/heads = {}",
                   key_length, c.head_dim);
    }
  }
  if (heads % kv_heads != 0) {
    return Error(ErrorCode::kCorrupt, "{} query heads are not a multiple of {} KV heads", heads,
                 kv_heads);
  }

  const gguf::TensorInfo* embd = file.FindTensor("token_embd.weight");
  if (!embd) return Error(ErrorCode::kNotFound, "tensor 'token_embd.weight' is missing");
  if (embd->shape.size() != 2 || embd->shape[0] != hidden) {
    return Error(ErrorCode::kCorrupt, "tensor 'token_embd.weight' has shape [{}], expected [{}, vocab]",
                 fmt::join(embd->shape, ", "), hidden);
  }
  c.vocab_size = embd->shape[1];
  if (auto v = file.GetInt(a + ".vocab_size"); v.ok() && v.value() != c.vocab_size) {
    return Error(ErrorCode::kCorrupt, "vocab_size {} differs from token_embd rows {}", v.value(),
                 c.vocab_size);
  }
  c.tied_embeddings = file.FindTensor("output.weight") == nullptr;
  c.qkv_bias = file.FindTensor("blk.0.attn_q.bias") != nullptr;

  // RoPE.
  c.rope.rotary_dim = c.head_dim;
  if (file.Find(a + ".rope.dimension_count")) {
    SKV_ASSIGN_OR_RETURN(int64_t dims, PositiveInt(file, a + ".rope.dimension_count"));
    if (dims > c.head_dim || dims % 2 != 0) {
      return Error(ErrorCode::kCorrupt, "rope dimension count {} is invalid for head dim {}", dims,
                   c.head_dim);
    }
    c.rope.rotary_dim = static_cast<int>(dims);
  }
  c.rope.theta_base = 10000.0f;
  if (file.Find(a + ".rope.freq_base")) {
    SKV_ASSIGN_OR_RETURN(double base, file.GetFloat(a + ".rope.freq_base"));
    if (!(base > 1.0)) return Error(ErrorCode::kCorrupt, "rope freq_base {} is invalid", base);
    c.rope.theta_base = static_cast<float>(base);
  }
  c.rope.style = a == "qwen2" ? RopeConfig::Style::kHalves : RopeConfig::Style::kPairs;
  if (auto type = file.GetString(a + ".rope.scaling.type"); type.ok() && type.value() != "none") {
    if (type.value() != "linear") {
      return Error(ErrorCode::kUnsupported, "rope scaling '{}' is not supported (supported: none, "
                   "linear, llama3 via rope_freqs)", type.value());
    }
    SKV_ASSIGN_OR_RETURN(double factor, file.GetFloat(a + ".rope.scaling.factor"));
    if (!(factor >= 1.0)) return Error(ErrorCode::kCorrupt, "rope scaling factor {}", factor);
    c.rope.linear_scale = static_cast<float>(factor);
  }
  if (const gguf::TensorInfo* freqs = file.FindTensor("rope_freqs.weight")) {
    // Llama 3.1-style scaling is stored as per-frequency divisors.
    if (freqs->type != gguf::GgmlType::kF32 || freqs->num_elements != c.rope.rotary_dim / 2) {
      return Error(ErrorCode::kCorrupt, "tensor 'rope_freqs.weight' must be F32 [{}]",
                   c.rope.rotary_dim / 2);
    }
    const float* data = reinterpret_cast<const float*>(freqs->data);
    c.rope.freq_factors.assign(data, data + freqs->num_elements);
    for (float f : c.rope.freq_factors) {
      if (!(f > 0.0f) || !std::isfinite(f)) {
        return Error(ErrorCode::kCorrupt, "tensor 'rope_freqs.weight' holds {}", f);
      }
    }
  }
  return c;
}

std::string ModelConfig::Summary() const {
  return fmt::format("{} ({}): {} layers, hidden {}, {} heads / {} KV heads x {}, FFN {}, vocab {}, "
                     "context {}",
                     name.empty() ? "model" : name, architecture, num_layers, hidden_size,
                     num_query_heads, num_kv_heads, head_dim, ffn_size, vocab_size,
                     context_length);
}

}  // namespace shadowkv
