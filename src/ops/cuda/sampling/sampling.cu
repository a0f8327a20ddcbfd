// Sampling kernel: one block per row; a truncated row first searches its cut's threshold bit by
// bit, then every row scans the vocabulary once for a block-wide (value, id) max.
#include <cfloat>
#include <climits>
#include <cmath>

#include "core/draw_noise.h"
#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/sampling/sampling.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// True when (value, id) beats (best, best_id): larger value, or equal value and lower id.
__device__ __forceinline__ bool Better(float value, int id, float best, int best_id) {
  return value > best || (value == best && id < best_id);
}

// A uint32 whose unsigned order is the float order (-inf lowest, +inf highest; NaNs fall at the
// ends and are filtered apart).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The block's sum or max of `value`, the same in every thread: each thread folds the warps'
// results in the same order, so a float sum is bit-identical across threads and decisions taken
// on it are block-uniform. `shared` holds kWarps values.
template <typename T, typename Op>
__device__ T BlockReduce(T value, Op op, T* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = value;
  __syncthreads();
  T total = shared[0];
  for (int w = 1; w < kWarps; ++w) total = op(total, shared[w]);
  __syncthreads();  // `shared` is free again
  return total;
}

struct Sum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// The largest key K with holds(K), holds being true at 0 and monotone decreasing: set bit by
// bit from the top, one block-wide evaluation per bit.
template <typename Holds>
__device__ uint32_t LargestKey(Holds holds) {
  uint32_t key = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = key | (1u << bit);
    if (holds(candidate)) key = candidate;
  }
  return key;
}

__global__ void __launch_bounds__(kThreads) SamplingKernel(SamplingParams p) {
  __shared__ float float_scratch[kWarps];
  __shared__ int int_scratch[kWarps];
  __shared__ int best_ids[kWarps];
  const int row = blockIdx.x;
  const int vocab = p.vocab;
  const float* logits = p.logits + static_cast<int64_t>(row) * vocab;
  const SamplingControl control = p.controls[row];
  const bool sample = control.temperature > 0.0f;
  const float inv_temperature = sample ? 1.0f / control.temperature : 1.0f;
  const bool cut_k = sample && control.top_k > 0 && control.top_k < vocab;
  const bool cut_p = sample && control.top_p < 1.0f;

  // Survivors: non-NaN logits whose key is >= floor_key (0: all of them).
  uint32_t floor_key = 0;
  if (cut_k) {
    floor_key = LargestKey([&](uint32_t key) {
      int count = 0;
      for (int v = threadIdx.x; v < vocab; v += kThreads) {
        const float x = logits[v];
        count += !isnan(x) && OrderedKey(x) >= key;
      }
      return BlockReduce(count, Sum{}, int_scratch) >= control.top_k;
    });
  }
  if (cut_p) {
    float local_max = -INFINITY;
    for (int v = threadIdx.x; v < vocab; v += kThreads) {
      const float x = logits[v];
      if (!isnan(x)) local_max = fmaxf(local_max, x);
    }
    const float max_logit = BlockReduce(local_max, Max{}, float_scratch);
    if (isfinite(max_logit)) {
      // Softmax mass at T (unnormalised, the largest logit weighing 1) of the survivors >= key.
      auto mass_from = [&](uint32_t key) {
        const uint32_t from = max(key, floor_key);
        float mass = 0.0f;
        for (int v = threadIdx.x; v < vocab; v += kThreads) {
          const float x = logits[v];
          if (!isnan(x) && OrderedKey(x) >= from) mass += __expf((x - max_logit) * inv_temperature);
        }
        return BlockReduce(mass, Sum{}, float_scratch);
      };
      // mass_from(0) is the whole top-k set's mass, computed exactly as every later pass sums a
      // set it contains, so the search's condition holds at 0.
      const float target = control.top_p * mass_from(0);
      floor_key =
          max(floor_key, LargestKey([&](uint32_t key) { return mass_from(key) >= target; }));
    }
  }

  const uint64_t stream = DrawStream(control.seed, control.draw);
  float best = -FLT_MAX;
  int best_id = INT_MAX;
  // kBatch logits loaded before any is compared, so their loads overlap.
  constexpr int kBatch = 4;
  for (int base = threadIdx.x; base < vocab; base += kThreads * kBatch) {
    float loaded[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = base + i * kThreads;
      loaded[i] = v < vocab ? logits[v] : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = base + i * kThreads;
      if (v >= vocab) break;
      float key = loaded[i];
      if (floor_key != 0 && OrderedKey(key) < floor_key) continue;
      // Rounded as the CPU's SampleAt rounds (no fused multiply-add).
      if (sample) key = __fadd_rn(__fmul_rn(key, inv_temperature), GumbelNoise(stream, v));
      if (Better(key, v, best, best_id)) {  // NaN compares false: never chosen
        best = key;
        best_id = v;
      }
    }
  }
  WarpArgBest(best, best_id, Better);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    float_scratch[warp] = best;
    best_ids[warp] = best_id;
  }
  __syncthreads();
  if (warp == 0) {
    best = float_scratch[lane];
    best_id = best_ids[lane];
    WarpArgBest(best, best_id, Better);
    if (lane == 0) p.tokens[row] = best_id == INT_MAX ? 0 : best_id;
  }
}

}  // namespace

cudaError_t LaunchSampling(const SamplingParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.rows < 0 || params.vocab <= 0 || !params.controls) return cudaErrorInvalidValue;
  SamplingKernel<<<params.rows, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
