// RMSNorm kernel: one block per row; the sum of squares in fp32, the scaling in fp32, bf16 out.
#include "ops/cuda/device_utils.cuh"
#include "ops/cuda/rmsnorm.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[32];
  const int out_row = blockIdx.x;
  const int64_t row = p.row_index ? p.row_index[out_row] : out_row;
  float* x = p.x + row * p.width;
  const float* delta = p.delta ? p.delta + row * p.width : nullptr;
  float sum_squares = 0.0f;
  for (int c = threadIdx.x; c < p.width; c += kThreads) {
    float value = x[c];
    if (delta) {
      value += delta[c];
      x[c] = value;  // each element is read and written by the same thread: no barrier needed
    }
    sum_squares += value * value;
  }
  sum_squares = BlockSum(sum_squares, scratch);
  const float scale = rsqrtf(sum_squares / p.width + p.eps);
  __nv_bfloat16* out = p.out + static_cast<int64_t>(out_row) * p.width;
  for (int c = threadIdx.x; c < p.width; c += kThreads) {
    out[c] = __float2bfloat16(x[c] * scale * p.weight[c]);
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
