// GELU-tanh GLU on the GPU: out = gelu_tanh(gate) * up, reading the fused gate|up projection
// (Gemma's FFN; SwiGLU's counterpart).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

struct GeluTanhGluParams {
  const __nv_bfloat16* gate_up = nullptr;  // [rows, 2 * ffn]: gate in [0, ffn), up in [ffn, 2ffn)
  __nv_bfloat16* out = nullptr;            // [rows, ffn]
  int64_t rows = 0;
  int ffn = 0;
};

cudaError_t LaunchGeluTanhGlu(const GeluTanhGluParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
