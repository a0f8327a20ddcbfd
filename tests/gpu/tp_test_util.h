// Helpers of the tensor-parallel GPU tests: tiny model specs, options, prompts, and a model
// group made from a tiny GGUF.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ops/cuda/cuda_model.h"
#include "ops/cuda/tp/cuda_model_group.h"
#include "tiny_model.h"

namespace shadowkv::cuda::tp_testing {

using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::WriteTinyModel;

// `count` tokens below 256 (every tiny vocabulary has them).
inline std::vector<int32_t> SomeTokens(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(count);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 256);
  return tokens;
}

inline int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// A tiny model with fp32 weights, 2 layers, FFN twice the hidden size.
inline TinyModelSpec TpSpec(const char* architecture, int hidden, int heads, int kv_heads,
                            bool tied, uint32_t seed) {
  TinyModelSpec s;
  s.architecture = architecture;
  s.hidden = hidden;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.ffn = 2 * hidden;
  s.layers = 2;
  s.context = 1024;
  s.weight_type = gguf::GgmlType::kF32;
  s.tied = tied;
  s.seed = seed;
  return s;
}

inline CudaModelOptions SmallOptions() {
  CudaModelOptions options;
  options.max_batch = 4;
  options.max_step_tokens = 512;
  return options;
}

// A GGUF written from `spec`, loaded split.
inline auto FromFile(const TinyModelSpec& spec, const std::string& tag) {
  const std::string path = WriteTinyModel(spec, tag);
  return [path](const TensorParallelOptions& tp) {
    return CudaModelGroup::Load(path, SmallOptions(), tp);
  };
}


}  // namespace shadowkv::cuda::tp_testing
