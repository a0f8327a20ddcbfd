// Helpers of the tensor-parallel GPU tests: tiny model specs, options, prompts, and a model
// group made from a tiny GGUF.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu/tp/cuda_model_group.h"
#include "tiny_model.h"

namespace shadowkv::cuda::tp_testing {

using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::WriteTinyModel;

using shadowkv::testing::SomeTokens;

// A tiny model with fp32 weights (tiny_model.h's SmallSpec).
inline TinyModelSpec TpSpec(const char* architecture, int hidden, int heads, int kv_heads,
                            bool tied, uint32_t seed) {
  return shadowkv::testing::SmallSpec(architecture, hidden, heads, kv_heads,
                                      gguf::GgmlType::kF32, tied, seed);
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
