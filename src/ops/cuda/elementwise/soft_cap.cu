// Soft-cap kernel: element-wise in fp32 (the CPU op's formula), a grid-stride loop.
#include "ops/cuda/elementwise/soft_cap.cuh"

#include <algorithm>

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) SoftCapKernel(SoftCapParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    p.logits[i] = p.cap * tanhf(p.logits[i] / p.cap);
  }
}

}  // namespace

cudaError_t LaunchSoftCap(const SoftCapParams& params, cudaStream_t stream) {
  if (params.count == 0) return cudaSuccess;
  if (params.count < 0 || !(params.cap > 0.0f)) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((params.count + kThreads - 1) / kThreads, 65536);
  SoftCapKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
