// Embedding kernel: one block per row, a plain strided copy (the op moves a few KiB per row).
#include "ops/cuda/elementwise/embedding.cuh"

namespace shadowkv::cuda {
namespace {

__global__ void EmbeddingKernel(EmbeddingParams p) {
  const int row = blockIdx.x;
  const __nv_bfloat16* source = p.table + static_cast<int64_t>(p.tokens[row]) * p.hidden;
  float* dest = p.out + static_cast<int64_t>(row) * p.hidden;
  for (int c = threadIdx.x; c < p.hidden; c += blockDim.x) {
    dest[c] = __bfloat162float(source[c]) * p.scale;
  }
}

}  // namespace

cudaError_t LaunchEmbedding(const EmbeddingParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.rows < 0 || params.hidden <= 0) return cudaErrorInvalidValue;
  EmbeddingKernel<<<params.rows, 256, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
