// ModelConfig::FromGguf: metadata keys per architecture, each range-checked in the type it is
// stored in, and checked for consistency with each other and the token embedding.
#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace shadowkv {

const char* SupportedArchitectures() { return "llama, qwen2, qwen3, gemma3, phi3, glm4, chatglm"; }

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

bool IsKnownArchitecture(const std::string& a) {
  return a == "llama" || a == "qwen2" || a == "qwen3" || a == "gemma3" || a == "phi3" ||
         a == "glm4" || a == "chatglm";
}

// Which layers slide, from '{arch}.attention.sliding_window_pattern': a period N (layer l slides
// unless l % N == N - 1, llama.cpp's reading) or one bool per layer (true: sliding). Absent, a
// gemma3 model has llama.cpp's period of 6 and any other model slides in every layer.
Result<std::vector<bool>> WindowedLayers(const gguf::GgufFile& file, const std::string& a,
                                         int num_layers) {
  const std::string key = a + ".attention.sliding_window_pattern";
  const gguf::Value* pattern = file.Find(key);
  std::vector<bool> windowed(num_layers, true);
  if (pattern == nullptr && a != "gemma3") return windowed;
  if (pattern != nullptr && pattern->type == gguf::ValueType::kArray) {
    const auto& elements = std::get<std::vector<gguf::Value>>(pattern->data);
    if (pattern->element_type != gguf::ValueType::kBool ||
        elements.size() != static_cast<size_t>(num_layers)) {
      return Error(ErrorCode::kCorrupt,
                   "metadata '{}' must be a period or one bool per layer ({} layers)", key,
                   num_layers);
    }
    for (int l = 0; l < num_layers; ++l) windowed[l] = std::get<bool>(elements[l].data);
    return windowed;
  }
  int period = 6;
  if (pattern != nullptr) {
    SKV_ASSIGN_OR_RETURN(period, IntIn(file, key, 1, kMaxLayers));
  }
  for (int l = 0; l < num_layers; ++l) windowed[l] = l % period < period - 1;
  return windowed;
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
  if (!IsKnownArchitecture(c.architecture)) {
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
  // qwen3 and gemma3 heads are wider or narrower than hidden / heads and say so in key_length
  // (the GLM families may too); llama and qwen2 files must keep the two equal, as the engine
  // always assumed for them.
  const bool free_head_dim = a == "qwen3" || a == "gemma3" || a == "glm4" || a == "chatglm";
  if (!free_head_dim || file.Find(a + ".attention.key_length") == nullptr) {
    if (c.hidden_size % c.num_query_heads != 0) {
      return Error(ErrorCode::kCorrupt, "embedding length {} is not a multiple of {} heads",
                   c.hidden_size, c.num_query_heads);
    }
    c.head_dim = c.hidden_size / c.num_query_heads;
  } else {
    SKV_ASSIGN_OR_RETURN(c.head_dim, IntIn(file, a + ".attention.key_length", 1, kMaxHidden));
    if (static_cast<int64_t>(c.head_dim) * c.num_query_heads > kMaxHidden) {
      return Error(ErrorCode::kCorrupt, "{} heads of {} exceed the supported width {}",
                   c.num_query_heads, c.head_dim, kMaxHidden);
    }
  }
  for (const char* length_key : {".attention.key_length", ".attention.value_length"}) {
    SKV_ASSIGN_OR_RETURN(const int length,
                         OptionalIntIn(file, a + length_key, 1, kMaxHidden, c.head_dim));
    if (length != c.head_dim) {
      return Error(ErrorCode::kUnsupported, "metadata '{}{}' = {} differs from the head dim {}", a,
                   length_key, length, c.head_dim);
    }
  }
  c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (a == "gemma3" && c.num_layers == 62) {
    // Gemma 3 27B scales by its query_pre_attn_scalar, hidden / heads (llama.cpp does the same).
    c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.hidden_size / c.num_query_heads));
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
  c.qk_norm = a == "qwen3" || a == "gemma3";
  c.fused_qkv = file.FindTensor("blk.0.attn_qkv.weight") != nullptr;
  // phi3 and the GLM families store ffn_up as the gate rows, then the up rows.
  c.fused_gate_up = (a == "phi3" || a == "glm4" || a == "chatglm") &&
                    file.FindTensor("blk.0.ffn_gate.weight") == nullptr;
  c.post_norms = a == "glm4";  // GLM-4-0414's norms after attention and MLP (plain weights)
  if (c.fused_qkv) c.qkv_bias = file.FindTensor("blk.0.attn_qkv.bias") != nullptr;
  if (a == "gemma3") {
    c.post_norms = true;
    c.activation = FfnActivation::kGeluTanh;
    c.embedding_scale = std::sqrt(static_cast<float>(c.hidden_size));
    if (file.Find(a + ".final_logit_softcapping") != nullptr) {
      SKV_ASSIGN_OR_RETURN(c.final_logit_softcap,
                           FloatIn(file, a + ".final_logit_softcapping", 1e-3, 1e6));
    }
  }

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
  // llama.cpp's converter permutes llama's Q/K rows for paired rotation, the GLM families
  // rotate pairs as trained; the others rotate halves.
  c.rope.style = a == "llama" || a == "glm4" || a == "chatglm" ? RopeConfig::Style::kPairs
                                                               : RopeConfig::Style::kHalves;
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
  SKV_RETURN_IF_ERROR(ReadLongRope(file, &c));
  SKV_RETURN_IF_ERROR(ReadSlidingWindow(file, &c));
  return c;
}

Status ModelConfig::ReadLongRope(const gguf::GgufFile& file, ModelConfig* c) {
  const gguf::TensorInfo* long_factors = file.FindTensor("rope_factors_long.weight");
  const gguf::TensorInfo* short_factors = file.FindTensor("rope_factors_short.weight");
  if (long_factors == nullptr && short_factors == nullptr) return Status::Ok();
  const std::string& a = c->architecture;
  if (long_factors == nullptr || short_factors == nullptr || !c->rope.freq_factors.empty()) {
    return Error(ErrorCode::kCorrupt,
                 "LongRoPE needs both rope_factors_long and rope_factors_short, and no "
                 "rope_freqs beside them");
  }
  SKV_ASSIGN_OR_RETURN(const int original,
                       IntIn(file, a + ".rope.scaling.original_context_length", 1, kMaxContext));
  // Like llama.cpp (by the context it serves), the factors follow the context the model runs
  // at, here its whole context: the long ones once it exceeds the pretraining length. Within a
  // sequence transformers switches at that length, re-rotating what it caches as it goes; a KV
  // cache cannot, so the two agree for contexts on one side of it.
  const gguf::TensorInfo* chosen = c->context_length > original ? long_factors : short_factors;
  if (chosen->type != gguf::GgmlType::kF32 || chosen->num_elements != c->rope.rotary_dim / 2) {
    return Error(ErrorCode::kCorrupt, "tensor '{}' must be F32 [{}]", chosen->name,
                 c->rope.rotary_dim / 2);
  }
  c->rope.freq_factors.resize(static_cast<size_t>(chosen->num_elements));
  std::memcpy(c->rope.freq_factors.data(), chosen->data, chosen->size_bytes);
  for (size_t i = 0; i < c->rope.freq_factors.size(); ++i) {
    const float f = c->rope.freq_factors[i];
    if (!std::isfinite(f) || f < 1.0f / kMaxRopeFactor || f > kMaxRopeFactor) {
      return Error(ErrorCode::kCorrupt,
                   "tensor '{}' element [{}] = {} is outside the supported range [{}, {}]",
                   chosen->name, i, f, 1.0f / kMaxRopeFactor, kMaxRopeFactor);
    }
  }
  // cos and sin are scaled by this factor, so every q·k of a fully rotated head by its square.
  const double scale = static_cast<double>(c->context_length) / original;
  float factor = scale <= 1.0 || original <= 1
                     ? 1.0f
                     : static_cast<float>(std::sqrt(1.0 + std::log(scale) / std::log(original)));
  if (file.Find(a + ".rope.scaling.attn_factor") != nullptr) {
    SKV_ASSIGN_OR_RETURN(factor, FloatIn(file, a + ".rope.scaling.attn_factor", 1e-3, 1e3));
  }
  if (factor != 1.0f && c->rope.rotary_dim != c->head_dim) {
    return Error(ErrorCode::kUnsupported,
                 "LongRoPE's attention factor {} with partial rotation ({} of {} dims) is not "
                 "supported",
                 factor, c->rope.rotary_dim, c->head_dim);
  }
  c->attention_scale *= factor * factor;
  return Status::Ok();
}

Status ModelConfig::ReadSlidingWindow(const gguf::GgufFile& file, ModelConfig* c) {
  const std::string& a = c->architecture;
  // Qwen configurations carry a sliding_window they do not use (use_sliding_window is false),
  // so only llama (Mistral-style) and gemma3 files are read for one.
  const std::string key = a + ".attention.sliding_window";
  if (a != "llama" && a != "gemma3") return Status::Ok();
  if (file.Find(key) == nullptr) {
    if (a == "gemma3") return Error(ErrorCode::kNotFound, "gemma3 metadata '{}' is missing", key);
    return Status::Ok();
  }
  SKV_ASSIGN_OR_RETURN(const int window, IntIn(file, key, 1, kMaxContext));
  c->sliding_window = window;
  SKV_ASSIGN_OR_RETURN(c->layer_windowed, WindowedLayers(file, a, c->num_layers));
  c->rope_windowed = c->rope;
  if (a == "gemma3") {
    // Local layers rotate with their own base (10000 unless the file says) and no scaling.
    c->rope_windowed.theta_base = 10000.0f;
    if (file.Find(a + ".rope.freq_base_swa") != nullptr) {
      SKV_ASSIGN_OR_RETURN(c->rope_windowed.theta_base,
                           FloatIn(file, a + ".rope.freq_base_swa", kMinFreqBase, kMaxFreqBase));
      if (!(c->rope_windowed.theta_base > 1.0f)) {
        return Error(ErrorCode::kCorrupt, "metadata '{}.rope.freq_base_swa' must exceed 1", a);
      }
    }
    c->rope_windowed.linear_scale = 1.0f;
    c->rope_windowed.freq_factors.clear();
  }
  return Status::Ok();
}

std::string ModelConfig::Summary() const {
  return fmt::format(
      "{} ({}): {} layers, hidden {}, {} heads / {} KV heads x {}, FFN {}, vocab {}, "
      "context {}{}",
      name.empty() ? "model" : name, architecture, num_layers, hidden_size, num_query_heads,
      num_kv_heads, head_dim, ffn_size, vocab_size, context_length,
      sliding_window > 0
          ? fmt::format(", sliding window {} in {} of {} layers", sliding_window,
                        std::count(layer_windowed.begin(), layer_windowed.end(), true), num_layers)
          : std::string());
}

}  // namespace shadowkv
