// ShadowKV compression kernels: B's rows from the batched eigensolver's eigenvectors and the
// outlier chunks picked from the minimum cosines (every layer of a sequence at once); per layer,
// the landmarks and minimum cosines, the outlier chunks' copy into the attention buffer and the
// FP8 runs of the store (values, exact keys); and the one decompression kernel, RoPE of rebuilt
// pre-RoPE keys into a full cache.
#include <algorithm>
#include <climits>
#include <cmath>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"
#include "ops/cuda/shadowkv/shadowkv_fp8.cuh"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {

namespace {

__global__ void SkvBasisFromEigenvectorsKernel(SkvBasisParams p) {
  const SkvLayout& l = p.layout;
  const int row = blockIdx.x, layer = blockIdx.y;
  const int width = l.num_kv_heads * l.head_dim;
  const int keep = p.ranks ? p.ranks[layer] : l.rank;
  __nv_bfloat16* out =
      l.basis + ((static_cast<int64_t>(p.seq) * l.num_layers + layer) * l.rank + row) * width;
  const float* column = p.eigenvectors + (static_cast<int64_t>(layer) * width + width - 1 - row) *
                                             width;
  for (int k = threadIdx.x; k < width; k += blockDim.x) {
    out[k] = __float2bfloat16(row < keep ? column[k] : 0.0f);
  }
}

}  // namespace

cudaError_t LaunchSkvBasisFromEigenvectors(const SkvBasisParams& p, cudaStream_t stream) {
  const int width = p.layout.num_kv_heads * p.layout.head_dim;
  if (p.layout.rank < 1 || p.layout.rank > width || !p.eigenvectors) return cudaErrorInvalidValue;
  SkvBasisFromEigenvectorsKernel<<<dim3(p.layout.rank, p.layout.num_layers), std::min(width, 256),
                                   0, stream>>>(p);
  return cudaGetLastError();
}

namespace {

// (value, index) pairs in kv::PickOutlierChunks's order: lower value first, then lower index.
__device__ __forceinline__ bool SkvPairBefore(float a, int ai, float b, int bi) {
  return a < b || (a == b && ai < bi);
}

// One block per (layer, KV head): `count` rounds, each taking the least pair after the last one
// taken (a block-wide minimum), so no chunk needs marking; then the picks in index order.
__global__ void SkvPickOutliersKernel(SkvPickOutliersParams p) {
  extern __shared__ int32_t picked[];  // [count]
  __shared__ float warp_value[32];
  __shared__ int warp_index[32];
  __shared__ float last_value;
  __shared__ int last_index;
  const float* values = p.min_cosine + static_cast<int64_t>(blockIdx.x) * p.num_chunks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x == 0) {
    last_value = -INFINITY;
    last_index = -1;
  }
  __syncthreads();
  for (int round = 0; round < p.count; ++round) {
    float best = INFINITY;
    int best_index = INT_MAX;
    const float after_value = last_value;
    const int after_index = last_index;
    for (int i = threadIdx.x; i < p.num_chunks; i += blockDim.x) {
      const float v = values[i];
      if (SkvPairBefore(after_value, after_index, v, i) && SkvPairBefore(v, i, best, best_index)) {
        best = v;
        best_index = i;
      }
    }
    WarpArgBest(best, best_index, SkvPairBefore);
    if (lane == 0) {
      warp_value[warp] = best;
      warp_index[warp] = best_index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < warps; ++w) {
        if (SkvPairBefore(warp_value[w], warp_index[w], best, best_index)) {
          best = warp_value[w];
          best_index = warp_index[w];
        }
      }
      picked[round] = best_index;
      last_value = best;
      last_index = best_index;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {  // count is small (tens): insertion sort
    for (int i = 1; i < p.count; ++i) {
      const int v = picked[i];
      int j = i - 1;
      while (j >= 0 && picked[j] > v) {
        picked[j + 1] = picked[j];
        --j;
      }
      picked[j + 1] = v;
    }
  }
  __syncthreads();
  int32_t* out = p.outliers + static_cast<int64_t>(blockIdx.x) * p.count;
  for (int i = threadIdx.x; i < p.count; i += blockDim.x) out[i] = picked[i];
}

}  // namespace

cudaError_t LaunchSkvPickOutliers(const SkvPickOutliersParams& p, cudaStream_t stream) {
  if (p.count == 0 || p.pairs == 0) return cudaSuccess;
  if (p.count < 0 || p.count > p.num_chunks || p.count > 4096 || !p.min_cosine || !p.outliers) {
    return cudaErrorInvalidValue;
  }
  SkvPickOutliersKernel<<<p.pairs, 256, p.count * sizeof(int32_t), stream>>>(p);
  return cudaGetLastError();
}

namespace {

// One thread per (token, KV head, rotary pair): the pair's two dims rotated at the token's
// position as the QKV kernel and the rebuild rotate them (fp32 angle, sincosf), dims past the
// rotary ones copied.
__global__ void SkvRopeRowsKernel(SkvRopeRowsParams p) {
  const int heads = p.cache.num_kv_heads, d = p.cache.head_dim, pairs = d / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.rows * heads * pairs) return;
  const int pair = static_cast<int>(i % pairs);
  const int h = static_cast<int>(i / pairs % heads);
  const int64_t token = i / pairs / heads;
  int a, b;
  SkvRopePairDims(pair, p.rotary_dim, p.halves, &a, &b);
  const __nv_bfloat16* in = p.keys_pre + (token * heads + h) * d;
  float x0 = __bfloat162float(in[a]), x1 = __bfloat162float(in[b]);
  if (pair < p.rotary_dim / 2) SkvRotatePair(token, p.inv_freq[pair], &x0, &x1);
  __nv_bfloat16* out = p.cache.keys + p.cache.HeadOffset(p.cache_slot, p.cache_layer, h) + token * d;
  out[a] = __float2bfloat16(x0);
  out[b] = __float2bfloat16(x1);
}

}  // namespace

cudaError_t LaunchSkvRopeRows(const SkvRopeRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows < 0 || p.rows > p.cache.capacity || !p.keys_pre || !p.inv_freq ||
      p.cache.head_dim % 2 != 0 || p.rotary_dim > p.cache.head_dim) {
    return cudaErrorInvalidValue;
  }
  const int64_t threads = p.rows * p.cache.num_kv_heads * (p.cache.head_dim / 2);
  SkvRopeRowsKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

namespace {

using Bf16 = __nv_bfloat16;

// ---- compression ------------------------------------------------------------------------------

constexpr int kLandmarkWarps = 8;

// One warp per (chunk, KV head): mean of the chunk's post-RoPE keys, then the smallest cosine
// between that mean and each key (fp32 here; the CPU reference sums in fp64).
__global__ void __launch_bounds__(kLandmarkWarps * 32) SkvLandmarkKernel(SkvLandmarkParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = blockIdx.x * kLandmarkWarps + warp, h = blockIdx.y;
  if (c >= p.num_chunks) return;
  const SkvLayout& l = p.layout;
  const int d = l.head_dim, chunk = l.chunk_size;
  const Bf16* keys = p.cache.keys + p.cache.HeadOffset(p.cache_slot, p.cache_layer, h) +
                     static_cast<int64_t>(c) * chunk * d;
  constexpr int kMaxPerLane = 8;  // head_dim <= 256
  float mean[kMaxPerLane] = {};
  for (int t = 0; t < chunk; ++t) {
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < d) mean[j] += __bfloat162float(keys[t * d + e]);
    }
  }
  float mean_norm = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    mean[j] /= static_cast<float>(chunk);
    mean_norm += mean[j] * mean[j];
  }
  mean_norm = WarpSum(mean_norm);
  float lowest = INFINITY;
  for (int t = 0; t < chunk; ++t) {
    float dot = 0.0f, norm = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int e = lane + 32 * j;
      const float k = e < d ? __bfloat162float(keys[t * d + e]) : 0.0f;
      dot += k * mean[j];
      norm += k * k;
    }
    dot = WarpSum(dot);
    norm = WarpSum(norm);
    const float denominator = sqrtf(mean_norm * norm);
    lowest = fminf(lowest, denominator > 0.0f ? dot / denominator : 0.0f);
  }
  const int64_t head_index = l.HeadIndex(p.seq, p.layer, h);
  const int64_t landmark = head_index * l.capacity_chunks + c;
  if (l.fp8_landmarks) {
    // The run's rule (WarpQuantizeFp8Run) with the mean already in registers.
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      if (lane + 32 * j < d) amax = fmaxf(amax, fabsf(mean[j]));
    }
    amax = WarpMax(amax);
    const float inverse = Fp8RunInverseScale(amax);
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < d) l.landmark_codes[landmark * d + e] = Fp32ToFp8E4m3(mean[j] * inverse);
    }
    if (lane == 0) l.landmark_scales[landmark] = Fp8RunScale(amax);
  } else {
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < d) l.landmarks[landmark * d + e] = __float2bfloat16(mean[j]);
    }
  }
  if (lane == 0) {
    l.outlier[head_index * l.capacity_chunks + c] = 0;
    p.min_cosine[static_cast<int64_t>(h) * p.num_chunks + c] = lowest;
  }
}

// One block per (outlier, KV head).
__global__ void SkvPlaceOutliersKernel(SkvOutlierParams p) {
  const int i = blockIdx.x, h = blockIdx.y;
  const SkvLayout& l = p.layout;
  const int chunk = p.outliers[h * p.num_outliers + i];
  const int run = l.chunk_size * l.head_dim;
  const int64_t head_index = l.HeadIndex(p.seq, p.layer, h);
  if (threadIdx.x == 0) l.outlier[head_index * l.capacity_chunks + chunk] = 1;
  const int64_t source = p.cache.HeadOffset(p.cache_slot, p.cache_layer, h) + static_cast<int64_t>(chunk) * run;
  const int64_t target = l.attn.HeadOffset(p.seq, p.layer, h) + static_cast<int64_t>(i) * run;
  for (int e = threadIdx.x; e < run; e += blockDim.x) {
    l.attn.keys[target + e] = p.cache.keys[source + e];
    l.attn.values[target + e] = p.cache.values[source + e];
  }
}

// One warp per (chunk, KV head): the chunk's values (kKeys: its post-RoPE keys less its
// landmark, which SkvLandmarkKernel has stored), quantised into the FP8 store.
constexpr int kStoreWarps = 4;
template <bool kKeys>
__global__ void __launch_bounds__(kStoreWarps * 32) SkvStoreRunsFp8Kernel(SkvLandmarkParams p) {
  const int c = blockIdx.x * kStoreWarps + threadIdx.x / 32, h = blockIdx.y;
  if (c >= p.num_chunks) return;
  const SkvLayout& l = p.layout;
  const int run = l.chunk_size * l.head_dim;
  const Bf16* source = (kKeys ? p.cache.keys : p.cache.values) +
                       p.cache.HeadOffset(p.cache_slot, p.cache_layer, h) +
                       static_cast<int64_t>(c) * run;
  const int64_t landmark = l.ChunkIndex(p.seq, p.layer, h, c);
  const int d = l.head_dim;
  WarpQuantizeFp8Run(
      [&](int i) {
        const float x = __bfloat162float(source[i]);
        return kKeys ? x - SkvLandmarkElement(l, landmark, i % d) : x;
      },
      run, kKeys ? l.KeyCodes(p.seq, p.layer, h, c) : l.ValueCodes(p.seq, p.layer, h, c),
      kKeys ? l.KeyScale(p.seq, p.layer, h, c) : l.ValueScale(p.seq, p.layer, h, c));
}

template <bool kKeys>
cudaError_t LaunchStoreRunsFp8(const SkvLandmarkParams& p, cudaStream_t stream) {
  if (p.num_chunks == 0) return cudaSuccess;
  if (!(kKeys ? p.layout.fp8_keys : p.layout.fp8_values)) return cudaErrorInvalidValue;
  const dim3 grid((p.num_chunks + kStoreWarps - 1) / kStoreWarps, p.layout.num_kv_heads);
  SkvStoreRunsFp8Kernel<kKeys><<<grid, kStoreWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}
}  // namespace

cudaError_t LaunchSkvStoreValuesFp8(const SkvLandmarkParams& p, cudaStream_t stream) {
  return LaunchStoreRunsFp8<false>(p, stream);
}

cudaError_t LaunchSkvStoreKeysFp8(const SkvLandmarkParams& p, cudaStream_t stream) {
  return LaunchStoreRunsFp8<true>(p, stream);
}

cudaError_t LaunchSkvLandmarks(const SkvLandmarkParams& p, cudaStream_t stream) {
  if (p.num_chunks == 0) return cudaSuccess;
  if (p.layout.head_dim > 256) return cudaErrorInvalidValue;
  const dim3 grid((p.num_chunks + kLandmarkWarps - 1) / kLandmarkWarps, p.layout.num_kv_heads);
  SkvLandmarkKernel<<<grid, kLandmarkWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSkvPlaceOutliers(const SkvOutlierParams& p, cudaStream_t stream) {
  if (p.num_outliers == 0) return cudaSuccess;
  SkvPlaceOutliersKernel<<<dim3(p.num_outliers, p.layout.num_kv_heads), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
