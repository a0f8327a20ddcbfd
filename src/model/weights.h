// ModelWeights: every tensor of a supported model, bound to the memory-mapped GGUF file.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "format/gguf.h"
#include "model/config.h"
#include "ops/cpu/quant_matmul.h"

namespace shadowkv {

// A linear layer y = x·Wᵀ (+ bias). `matrix` points into the file, or into `repacked` when the
// file's type has no decode kernel (K-quants, BF16 are requantised to Q8_0 at load).
struct LinearWeight {
  QuantMatrix matrix;             // [out_features, in_features]
  std::vector<uint8_t> repacked;  // owns matrix.data when non-empty
  std::vector<float> bias;        // [out_features] or empty
  int64_t out_features() const { return matrix.rows; }
  int64_t in_features() const { return matrix.cols; }
};

struct LayerWeights {
  std::vector<float> attn_norm;       // [hidden]
  std::vector<float> ffn_norm;        // [hidden] (gemma3: its pre-FFN norm)
  std::vector<float> q_norm;          // [head_dim] per-head norm of Q (qk_norm models), else empty
  std::vector<float> k_norm;          // [head_dim]
  std::vector<float> post_attn_norm;  // [hidden] of the attention output (post_norms), else empty
  std::vector<float> post_ffn_norm;   // [hidden] of the FFN output
  LinearWeight q;                     // [num_query_heads*head_dim, hidden]
  LinearWeight k;                     // [num_kv_heads*head_dim, hidden]
  LinearWeight v;                     // [num_kv_heads*head_dim, hidden]
  LinearWeight o;                     // [hidden, num_query_heads*head_dim]
  LinearWeight gate;                  // [ffn, hidden]
  LinearWeight up;                    // [ffn, hidden]
  LinearWeight down;                  // [hidden, ffn]
};

struct ModelWeights {
  QuantMatrix token_embd;          // [vocab, hidden], rows looked up by token id
  LinearWeight output;             // [vocab, hidden] (token_embd itself when tied)
  std::vector<float> output_norm;  // [hidden]
  std::vector<LayerWeights> layers;

  // Binds and checks every tensor (presence, type, shape, and that every value is finite). The
  // file must outlive the weights.
  static Result<ModelWeights> Load(const gguf::GgufFile& file, const ModelConfig& config);
  // Bytes of weights as stored (what one decode step reads).
  int64_t ByteSize() const;
};

}  // namespace shadowkv
