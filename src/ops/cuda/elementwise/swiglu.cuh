// SwiGLU on the GPU: out = silu(gate) * up, reading the fused gate|up projection.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

struct SwiGluParams {
  const __nv_bfloat16* gate_up = nullptr;  // [rows, 2 * ffn]: gate in [0, ffn), up in [ffn, 2ffn)
  __nv_bfloat16* out = nullptr;            // [rows, ffn]
  int64_t rows = 0;
  int ffn = 0;
};

cudaError_t LaunchSwiGlu(const SwiGluParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
