// ModelConfig::FromGguf: metadata keys per architecture, each range-checked in the type it is
// stored in, and checked for consistency with each other and the token embedding.
#include "model/config.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace shadowkv {

const char* SupportedArchitectures() { return "llama, qwen2"; }

namespace {

// An integer key as an int within [min, max]; a value outside is refused before it is narrowed.
Result<int> IntIn(const gguf::GgufFile& file, const std::string& key, int64_t min, int64_t max) {
  SKV_ASSIGN_OR_RETURN(int64_t value, file.GetInt(key));
  if (value < min || value > max) {
    return Error(ErrorCode::kCorrupt, "metadata '{}' = {} is outside the supported range [{}, {}]",
                 key, value, min, max);
  }
  return static_cast<int>(value);
}

// As IntIn, or `fallback` when the key is absent (a key of the wrong type is still an error).
Result<int> OptionalIntIn(const gguf::GgufFile& file, const std::string& key, int64_t min,
                          int64_t max, int fallback) {
  if (file.Find(key) == nullptr) return fallback;
  return IntIn(file, key, min, max);
}

// A float key within [min, max] (NaN and infinities never are).
Result<float> FloatIn(const gguf::GgufFile& file, const std::string& key, double min, double max) {
  SKV_ASSIGN_OR_RETURN(double value, file.GetFloat(key));
  if (!std::isfinite(value) || value < min || value > max) {
    return Error(ErrorCode::kCorrupt, "metadata '{}' = {} is outside the supported range [{}, {}]",
                 key, value, min, max);
  }
  return static_cast<float>(value);
}

Result<std::string> OptionalString(const gguf::GgufFile& file, const std::string& key) {
  if (file.Find(key) == nullptr) return std::string();
  return file.GetString(key);
}

bool IsFloatType(gguf::ValueType type) {
  return type == gguf::ValueType::kFloat32 || type == gguf::ValueType::kFloat64;
}

// Hyper-parameters this engine does not read (logit scales, yarn factors...) still describe the
// model; a non-finite one means the file is broken, so every float under the architecture's
// prefix, arrays included, must be finite.
Status CheckArchitectureFloatsFinite(const gguf::GgufFile& file, const std::string& prefix) {
  for (const auto& [key, value] : file.metadata()) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    if (IsFloatType(value.type)) {
      const double number = std::get<double>(value.data);
      if (!std::isfinite(number)) {
        return Error(ErrorCode::kCorrupt, "metadata '{}' = {} is not a finite number", key, number);
      }
    } else if (value.type == gguf::ValueType::kArray && IsFloatType(value.element_type)) {
      const auto& elements = std::get<std::vector<gguf::Value>>(value.data);
      for (size_t i = 0; i < elements.size(); ++i) {
        const double number = std::get<double>(elements[i].data);
        if (!std::isfinite(number)) {
          return Error(ErrorCode::kCorrupt,
                       "metadata '{}' element [{}] = {} is not a finite number", key, i, number);
        }
      }
    }
  }
  return Status::Ok();
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
  SKV_ASSIGN_OR_RETURN(c.name, OptionalString(file, "general.name"));
  SKV_RETURN_IF_ERROR(CheckArchitectureFloatsFinite(file, a + "."));
  SKV_ASSIGN_OR_RETURN(c.num_layers, IntIn(file, a + ".block_count", 1, kMaxLayers));
  SKV_ASSIGN_OR_RETURN(c.hidden_size, IntIn(file, a + ".embedding_length", 1, kMaxHidden));
  SKV_ASSIGN_OR_RETURN(c.num_query_heads, IntIn(file, a + ".attention.head_count", 1, kMaxHeads));
  SKV_ASSIGN_OR_RETURN(c.num_kv_heads, OptionalIntIn(file, a + ".attention.head_count_kv", 1,
                                                     c.num_query_heads, c.num_query_heads));
  SKV_ASSIGN_OR_RETURN(c.ffn_size, IntIn(file, a + ".feed_forward_length", 1, kMaxFfn));
  SKV_ASSIGN_OR_RETURN(c.context_length, IntIn(file, a + ".context_length", 1, kMaxContext));
  SKV_ASSIGN_OR_RETURN(c.rms_norm_eps,
                       FloatIn(file, a + ".attention.layer_norm_rms_epsilon", kMinNormEps, 1.0));
  SKV_ASSIGN_OR_RETURN(const int experts,
                       OptionalIntIn(file, a + ".expert_count", 0, kMaxHeads, 0));
  if (experts > 0) {
    return Error(ErrorCode::kUnsupported,
                 "mixture-of-experts models are not supported ('{}.expert_count' = {})", a,
                 experts);
  }
  if (c.hidden_size % c.num_query_heads != 0) {
    return Error(ErrorCode::kCorrupt, "embedding length {} is not a multiple of {} heads",
                 c.hidden_size, c.num_query_heads);
  }
  c.head_dim = c.hidden_size / c.num_query_heads;
  for (const char* length_key : {".attention.key_length", ".attention.value_length"}) {
    SKV_ASSIGN_OR_RETURN(const int length,
                         OptionalIntIn(file, a + length_key, 1, kMaxHidden, c.head_dim));
    if (length != c.head_dim) {
      return Error(ErrorCode::kUnsupported, "metadata '{}{}' = {} differs from hidden/heads = {}",
                   a, length_key, length, c.head_dim);
    }
  }
  if (c.num_query_heads % c.num_kv_heads != 0) {
    return Error(ErrorCode::kCorrupt, "{} query heads are not a multiple of {} KV heads",
                 c.num_query_heads, c.num_kv_heads);
  }

  const gguf::TensorInfo* embd = file.FindTensor("token_embd.weight");
  if (!embd) return Error(ErrorCode::kNotFound, "tensor 'token_embd.weight' is missing");
  if (embd->shape.size() != 2 || embd->shape[0] != c.hidden_size) {
    return Error(ErrorCode::kCorrupt,
                 "tensor 'token_embd.weight' has shape [{}], expected [{}, vocab]",
                 fmt::join(embd->shape, ", "), c.hidden_size);
  }
  c.vocab_size = embd->shape[1];
  if (c.vocab_size > kMaxVocab) {
    return Error(ErrorCode::kCorrupt,
                 "tensor 'token_embd.weight' has {} rows, more than the {} tokens supported",
                 c.vocab_size, kMaxVocab);
  }
  if (file.Find(a + ".vocab_size") != nullptr) {
    SKV_ASSIGN_OR_RETURN(const int vocab, IntIn(file, a + ".vocab_size", 1, kMaxVocab));
    if (vocab != c.vocab_size) {
      return Error(ErrorCode::kCorrupt, "vocab_size {} differs from token_embd rows {}", vocab,
                   c.vocab_size);
    }
  }
  c.tied_embeddings = file.FindTensor("output.weight") == nullptr;
  c.qkv_bias = file.FindTensor("blk.0.attn_q.bias") != nullptr;

  // RoPE.
  SKV_ASSIGN_OR_RETURN(c.rope.rotary_dim,
                       OptionalIntIn(file, a + ".rope.dimension_count", 1, kMaxHidden, c.head_dim));
  if (c.rope.rotary_dim > c.head_dim || c.rope.rotary_dim % 2 != 0) {
    return Error(ErrorCode::kCorrupt,
                 "rope dimension count {} is invalid for head dim {} (it must be even and at "
                 "most the head dim)",
                 c.rope.rotary_dim, c.head_dim);
  }
  c.rope.theta_base = 10000.0f;
  if (file.Find(a + ".rope.freq_base")) {
    SKV_ASSIGN_OR_RETURN(c.rope.theta_base,
                         FloatIn(file, a + ".rope.freq_base", kMinFreqBase, kMaxFreqBase));
    if (!(c.rope.theta_base > 1.0f)) {
      return Error(ErrorCode::kCorrupt, "metadata '{}.rope.freq_base' = {} must exceed 1", a,
                   c.rope.theta_base);
    }
  }
  c.rope.style = a == "qwen2" ? RopeConfig::Style::kHalves : RopeConfig::Style::kPairs;
  SKV_ASSIGN_OR_RETURN(const std::string scaling, OptionalString(file, a + ".rope.scaling.type"));
  if (!scaling.empty() && scaling != "none") {
    if (scaling != "linear") {
      return Error(ErrorCode::kUnsupported,
                   "rope scaling '{}' is not supported (supported: none, linear, llama3 via "
                   "rope_freqs)",
                   scaling);
    }
    SKV_ASSIGN_OR_RETURN(c.rope.linear_scale,
                         FloatIn(file, a + ".rope.scaling.factor", 1.0, kMaxRopeFactor));
  }
  if (const gguf::TensorInfo* freqs = file.FindTensor("rope_freqs.weight")) {
    // Llama 3.1-style scaling is stored as per-frequency divisors.
    if (freqs->type != gguf::GgmlType::kF32 || freqs->num_elements != c.rope.rotary_dim / 2) {
      return Error(ErrorCode::kCorrupt, "tensor 'rope_freqs.weight' must be F32 [{}]",
                   c.rope.rotary_dim / 2);
    }
    // The mapping aligns tensors only as general.alignment says, so copy rather than cast.
    c.rope.freq_factors.resize(static_cast<size_t>(freqs->num_elements));
    std::memcpy(c.rope.freq_factors.data(), freqs->data, freqs->size_bytes);
    for (size_t i = 0; i < c.rope.freq_factors.size(); ++i) {
      const float f = c.rope.freq_factors[i];
      if (!std::isfinite(f) || f < 1.0f / kMaxRopeFactor || f > kMaxRopeFactor) {
        return Error(ErrorCode::kCorrupt,
                     "tensor 'rope_freqs.weight' element [{}] = {} is outside the supported range "
                     "[{}, {}]",
                     i, f, 1.0f / kMaxRopeFactor, kMaxRopeFactor);
      }
    }
  }
  return c;
}

std::string ModelConfig::Summary() const {
  return fmt::format(
      "{} ({}): {} layers, hidden {}, {} heads / {} KV heads x {}, FFN {}, vocab {}, "
      "context {}",
      name.empty() ? "model" : name, architecture, num_layers, hidden_size, num_query_heads,
      num_kv_heads, head_dim, ffn_size, vocab_size, context_length);
}

}  // namespace shadowkv
