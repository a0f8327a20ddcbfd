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
  // A window of a larger matrix (a tensor-parallel shard of a synthetic weight): with
  // row_length > 0, `out` is [count / row_length, row_length] and its element (r, c) gets the
  // value element (first_row + r, first_col + c) of the [*, full_row_length] matrix drawn with
  // the same seed has. 0: `out` is the whole (contiguous) matrix.
  int64_t row_length = 0;
  int64_t full_row_length = 0;
  int64_t first_row = 0;
  int64_t first_col = 0;
};

cudaError_t LaunchFillRandom(const FillRandomParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
