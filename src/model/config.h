// ModelConfig: the hyper-parameters of a supported architecture, read from GGUF metadata.
#pragma once

#include <cstdint>
#include <string>

#include "core/rope.h"
#include "core/status.h"
#include "format/gguf.h"

namespace shadowkv {

struct ModelConfig {
  std::string architecture;  // "llama" or "qwen2"
  std::string name;          // general.name, for display
  int num_layers = 0;
  int hidden_size = 0;
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int ffn_size = 0;
  int64_t vocab_size = 0;
  int64_t context_length = 0;
  float rms_norm_eps = 1e-5f;
  bool qkv_bias = false;         // qwen2 adds a bias to Q, K and V
  bool tied_embeddings = false;  // no output.weight: logits use token_embd
  RopeConfig rope;

  // Reads and checks the metadata (and, for llama3 rope scaling, the rope_freqs tensor).
  static Result<ModelConfig> FromGguf(const gguf::GgufFile& file);
  std::string Summary() const;
};

// Architectures FromGguf accepts, for error messages.
const char* SupportedArchitectures();

}  // namespace shadowkv
