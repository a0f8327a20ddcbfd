// Random bf16 values generated on the device, for synthetic-weight models (no host copy of 16 GB).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

struct FillRandomParams {
  __nv_bfloat16* out = nullptr;  // [count]
  int64_t count = 0;
  float scale = 1.0f;  // values are uniform in [-scale, scale)
  uint64_t seed = 0;   // same seed, same values
};

cudaError_t LaunchFillRandom(const FillRandomParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
