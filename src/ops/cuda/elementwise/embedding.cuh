// Token embedding lookup on the GPU: rows of the bf16 table into the fp32 residual stream, times
// the model's embedding scale.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

struct EmbeddingParams {
  const int32_t* tokens = nullptr;       // [rows], each in [0, vocab) (checked by the caller)
  const __nv_bfloat16* table = nullptr;  // [vocab, hidden]
  float* out = nullptr;                  // [rows, hidden]
  int rows = 0;
  int hidden = 0;
  float scale = 1.0f;  // every value is multiplied by it in fp32 (gemma3: sqrt(hidden))
};

cudaError_t LaunchEmbedding(const EmbeddingParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
