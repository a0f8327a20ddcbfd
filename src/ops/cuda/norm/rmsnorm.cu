// RMSNorm kernel: one block per row; the sums of squares in fp32, the scaling in fp32, bf16 out.
#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/norm/rmsnorm.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

// Elements a thread loads before it stores any: x is written in place (and `out` may alias
// nothing the compiler can prove), so without this each element's loads would wait for the
// previous element's store, one memory latency per element.
constexpr int kBatch = 4;

__global__ void __launch_bounds__(kThreads) RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[32];
  const int out_row = blockIdx.x;
  const int64_t row = p.row_index ? p.row_index[out_row] : out_row;
  const int width = p.width;
  float* x = p.x + row * width;
  const float* delta = p.delta ? p.delta + row * width : nullptr;
  const float* delta_weight = delta ? p.delta_weight : nullptr;
  // A normalised delta: its own sum of squares first (the same for every thread of the block).
  float delta_scale = 1.0f;
  if (delta_weight) {
    float delta_squares = 0.0f;
    for (int c = threadIdx.x; c < width; c += kThreads) delta_squares += delta[c] * delta[c];
    delta_squares = BlockSum(delta_squares, scratch);
    delta_scale = rsqrtf(delta_squares / width + p.eps);
  }
  float sum_squares = 0.0f;
  for (int base = threadIdx.x; base < width; base += kThreads * kBatch) {
    float value[kBatch], add[kBatch], add_weight[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = base + u * kThreads;
      value[u] = c < width ? x[c] : 0.0f;
      add[u] = delta && c < width ? delta[c] : 0.0f;
      add_weight[u] = delta_weight && c < width ? delta_weight[c] : 1.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (delta_weight) add[u] = add[u] * delta_scale * add_weight[u];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = base + u * kThreads;
      if (delta) {
        value[u] += add[u];
        if (c < width) x[c] = value[u];  // read and written by this thread only: no barrier
      }
      sum_squares += value[u] * value[u];
    }
  }
  sum_squares = BlockSum(sum_squares, scratch);
  const float scale = rsqrtf(sum_squares / width + p.eps);
  __nv_bfloat16* out = p.out + static_cast<int64_t>(out_row) * width;
  for (int base = threadIdx.x; base < width; base += kThreads * kBatch) {
    float value[kBatch], weight[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = base + u * kThreads;
      value[u] = c < width ? x[c] : 0.0f;
      weight[u] = c < width ? p.weight[c] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = base + u * kThreads;
      if (c < width) out[c] = __float2bfloat16(value[u] * scale * weight[u]);
    }
  }
}

}  // namespace

cudaError_t LaunchRmsNorm(const RmsNormParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.rows < 0 || params.width <= 0) return cudaErrorInvalidValue;
  RmsNormKernel<<<params.rows, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
