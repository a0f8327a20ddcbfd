// Fill kernel: a counter-based hash per element, so any grid shape gives the same values.
#include "ops/cuda/elementwise/fill_random.cuh"

#include <algorithm>

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) FillRandomKernel(FillRandomParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    int64_t index = i;  // in the whole matrix
    if (p.row_length > 0) {
      index = (p.first_row + i / p.row_length) * p.full_row_length + p.first_col +
              i % p.row_length;
    }
    uint64_t x = p.seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(index + 1);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    const float unit = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p.out[i] = __float2bfloat16((2.0f * unit - 1.0f) * p.scale);
  }
}

}  // namespace

cudaError_t LaunchFillRandom(const FillRandomParams& params, cudaStream_t stream) {
  if (params.count == 0) return cudaSuccess;
  if (params.count < 0) return cudaErrorInvalidValue;
  if (params.row_length < 0 || (params.row_length > 0 && params.count % params.row_length != 0)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = std::min<int64_t>((params.count + kThreads - 1) / kThreads, 65536);
  FillRandomKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
