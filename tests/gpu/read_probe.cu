// The read probe of read_probe.h: a grid-stride loop of four 16-byte loads in flight per thread.
#include "read_probe.h"

namespace shadowkv::cuda {
namespace {

__global__ void ReadProbeKernel(const uint4* data, int64_t count, uint32_t* sink) {
  uint32_t x = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldg(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < count; i += stride) {
    const uint4 v = __ldg(data + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;  // keeps the loads; practically never taken
}

}  // namespace

cudaError_t LaunchReadProbe(const void* data, int64_t bytes, uint32_t* sink, cudaStream_t stream) {
  if (bytes <= 0 || bytes % 64 != 0) return cudaErrorInvalidValue;
  int device = 0, multiprocessors = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  }
  if (error != cudaSuccess) return error;
  ReadProbeKernel<<<multiprocessors * 8, 256, 0, stream>>>(static_cast<const uint4*>(data),
                                                           bytes / 16, sink);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
