// RMSNorm on the GPU, fused with the residual add that precedes it: x += delta; out = norm(x)·w,
// where the delta may itself be normalised first (x += norm(delta)·w_delta: the post-attention
// and post-FFN norms of Gemma 3 and GLM-4).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

struct RmsNormParams {
  float* x = nullptr;             // [*, width] fp32 residual stream; rows read (and updated) in place
  const float* delta = nullptr;   // [*, width] added to those rows of x first, or null
  // [width]: the delta row is RMS-normalised with these weights (and eps) before it is added;
  // null adds it as it is. Only with a delta.
  const float* delta_weight = nullptr;
  const float* weight = nullptr;  // [width]
  __nv_bfloat16* out = nullptr;   // [rows, width] normalised rows, the next GEMM's input
  // Row i of out normalises row row_index[i] of x ([rows]), or row i when null (the final norm
  // picks only the rows whose logits are wanted).
  const int32_t* row_index = nullptr;
  int rows = 0;
  int width = 0;
  float eps = 1e-5f;
};

cudaError_t LaunchRmsNorm(const RmsNormParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
