// GELU-tanh GLU kernel: element-wise, fp32 math (the CPU op's formula), a grid-stride loop over
// every (row, column).
#include "ops/cuda/elementwise/gelu_tanh_glu.cuh"

#include <algorithm>

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GeluTanhGluKernel(GeluTanhGluParams p) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  const int64_t count = p.rows * p.ffn;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / p.ffn;
    const int64_t column = i - row * p.ffn;
    const __nv_bfloat16* in = p.gate_up + row * 2 * p.ffn;
    const float gate = __bfloat162float(in[column]);
    const float up = __bfloat162float(in[p.ffn + column]);
    const float gelu = 0.5f * gate * (1.0f + tanhf(k * (gate + 0.044715f * gate * gate * gate)));
    p.out[i] = __float2bfloat16(gelu * up);
  }
}

}  // namespace

cudaError_t LaunchGeluTanhGlu(const GeluTanhGluParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.rows < 0 || params.ffn <= 0) return cudaErrorInvalidValue;
  const int64_t blocks =
      std::min<int64_t>((params.rows * params.ffn + kThreads - 1) / kThreads, 65536);
  GeluTanhGluKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
