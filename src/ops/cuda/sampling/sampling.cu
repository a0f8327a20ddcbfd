// Sampling kernel: one block per row scans the vocabulary, then a block-wide (value, id) max.
#include "ops/cuda/sampling/sampling.cuh"

#include <cfloat>
#include <cmath>
#include <climits>

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint64_t Mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// True when (value, id) beats (best, best_id): larger value, or equal value and lower id.
__device__ __forceinline__ bool Better(float value, int id, float best, int best_id) {
  return value > best || (value == best && id < best_id);
}

__global__ void __launch_bounds__(kThreads) SamplingKernel(SamplingParams p) {
  __shared__ float best_values[kThreads / 32];
  __shared__ int best_ids[kThreads / 32];
  const int row = blockIdx.x;
  const float* logits = p.logits + static_cast<int64_t>(row) * p.vocab;
  const SamplingControl control = *p.control;
  const bool sample = control.temperature > 0.0f;
  const float inv_temperature = sample ? 1.0f / control.temperature : 1.0f;
  const uint64_t stream = Mix64(control.seed ^ Mix64(control.step ^ Mix64(row)));

  float best = -FLT_MAX;
  int best_id = INT_MAX;
  // kBatch logits loaded before any is compared, so their loads overlap.
  constexpr int kBatch = 4;
  for (int base = threadIdx.x; base < p.vocab; base += kThreads * kBatch) {
    float loaded[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = base + i * kThreads;
      loaded[i] = v < p.vocab ? logits[v] : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = base + i * kThreads;
      if (v >= p.vocab) break;
      float key = loaded[i];
      if (sample) {
        // 23 random bits + 1/2: u in (0, 1) exactly representable, so -log(-log(u)) is finite.
        const uint64_t bits = Mix64(stream + static_cast<uint64_t>(v)) >> 41;
        const float u = (static_cast<float>(bits) + 0.5f) * (1.0f / 8388608.0f);
        key = key * inv_temperature - logf(-logf(u));
      }
      if (Better(key, v, best, best_id)) {  // NaN compares false: never chosen
        best = key;
        best_id = v;
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
    if (Better(other, other_id, best, best_id)) {
      best = other;
      best_id = other_id;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    best_values[warp] = best;
    best_ids[warp] = best_id;
  }
  __syncthreads();
  if (warp == 0) {
    best = best_values[lane];
    best_id = best_ids[lane];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (Better(other, other_id, best, best_id)) {
        best = other;
        best_id = other_id;
      }
    }
    if (lane == 0) p.tokens[row] = best_id == INT_MAX ? 0 : best_id;
  }
}

}  // namespace

cudaError_t LaunchSampling(const SamplingParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.rows < 0 || params.vocab <= 0 || !params.control) return cudaErrorInvalidValue;
  SamplingKernel<<<params.rows, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
