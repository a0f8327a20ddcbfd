// ModelConfig: the hyper-parameters of a supported architecture, read from GGUF metadata.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/rope.h"
#include "core/status.h"
#include "format/gguf.h"

namespace shadowkv {

// What FromGguf accepts. The bounds are far above any released model yet keep every product the
// engine forms from them (KV bytes = context x KV width x layers, activations = tokens x FFN)
// well inside int64, and every count inside the int it is held in.
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxHidden = int64_t{1} << 18;  // embedding length, head and rope dims
inline constexpr int64_t kMaxHeads = 4096;               // query heads (KV heads: at most these)
inline constexpr int64_t kMaxFfn = int64_t{1} << 20;
inline constexpr int64_t kMaxContext = int64_t{1} << 24;
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;  // token ids are int32
// rms_norm_eps must be a positive normal float (so 1/sqrt(eps) stays finite) and at most 1.
inline constexpr double kMinNormEps = std::numeric_limits<float>::min();
// rope.freq_base must exceed 1 and be a finite float.
inline constexpr double kMinFreqBase = 1.0;
inline constexpr double kMaxFreqBase = std::numeric_limits<float>::max();
// Linear rope scaling factors lie in [1, kMaxRopeFactor], llama3 frequency divisors in
// [1 / kMaxRopeFactor, kMaxRopeFactor].
inline constexpr double kMaxRopeFactor = 1e6;

// The FFN's gate nonlinearity: SiLU (llama, qwen) or GELU with the tanh approximation (gemma).
enum class FfnActivation { kSilu, kGeluTanh };

struct ModelConfig {
  std::string architecture;  // one of SupportedArchitectures()
  std::string name;          // general.name, for display
  int num_layers = 0;
  int hidden_size = 0;
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // attention.key_length where given (qwen3, gemma3), else hidden / heads
  int ffn_size = 0;
  int64_t vocab_size = 0;
  int64_t context_length = 0;
  float rms_norm_eps = 1e-5f;
  bool qkv_bias = false;         // qwen2 adds a bias to Q, K and V
  bool tied_embeddings = false;  // no output.weight: logits use token_embd
  bool qk_norm = false;          // qwen3, gemma3: per-head RMSNorm of Q and K before RoPE
  bool fused_qkv = false;        // phi3, chatglm: one attn_qkv tensor (q rows, k rows, v rows)
  bool fused_gate_up = false;    // phi3, glm4, chatglm: ffn_up holds gate rows, then up rows
  bool post_norms = false;       // gemma3, glm4: RMSNorm of the attention and FFN outputs too
  FfnActivation activation = FfnActivation::kSilu;
  float embedding_scale = 1.0f;      // gemma3: token embeddings are multiplied by sqrt(hidden)
  float attention_scale = 0.0f;      // softmax scale of q·k (1 / sqrt(head_dim))
  float final_logit_softcap = 0.0f;  // > 0: logits = cap * tanh(logits / cap)
  RopeConfig rope;
  // Sliding-window attention: a query at position p of a windowed layer sees only the keys at
  // positions p - sliding_window + 1 .. p. layer_windowed is [num_layers] where any layer is
  // windowed (empty otherwise); those layers rotate with rope_windowed (gemma3's local base).
  int64_t sliding_window = 0;
  std::vector<bool> layer_windowed;
  RopeConfig rope_windowed;

  bool IsWindowed(int layer) const { return !layer_windowed.empty() && layer_windowed[layer]; }
  const RopeConfig& RopeOf(int layer) const { return IsWindowed(layer) ? rope_windowed : rope; }

  // Reads and checks the metadata (and, for llama3 rope scaling, the rope_freqs tensor): every
  // integer within the bounds above before it is narrowed, every float finite and in range
  // (non-finite floats anywhere under the architecture's prefix are refused too); errors name
  // the key and the range.
  static Result<ModelConfig> FromGguf(const gguf::GgufFile& file);
  std::string Summary() const;

 private:
  static Status ReadSlidingWindow(const gguf::GgufFile& file, ModelConfig* c);
  static Status ReadLongRope(const gguf::GgufFile& file, ModelConfig* c);
};

// Architectures FromGguf accepts, for error messages.
const char* SupportedArchitectures();

}  // namespace shadowkv
