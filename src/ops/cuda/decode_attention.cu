// Decode attention kernels. Split kernel: one block per (split, KV head, row); its 128 threads
// form token groups of kLanes lanes, each group streaming its own keys with an online softmax
// for all kGroup query heads at once (one K/V load serves the whole GQA group); the groups merge
// in shared memory at the end. Combine kernel: one block per (query head, row) merges the splits.
#include "ops/cuda/decode_attention.cuh"

#include <algorithm>
#include <cmath>

#include "ops/cuda/device_utils.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ int SplitTokens(int length, int num_splits) {
  const int even = (length + num_splits - 1) / num_splits;
  return max(kDecodeMinSplitTokens, (even + 15) / 16 * 16);
}

template <int kHeadDim, int kGroup>
struct DecodeShape {
  // Lanes per token: enough that the accumulators (kGroup x dims per lane) stay in registers.
  static constexpr int kDimsPerLane = (kHeadDim == 128 && kGroup <= 2) ? 16 : 8;
  static constexpr int kLanes = kHeadDim / kDimsPerLane;  // 8 or 16
  static constexpr int kVecs = kDimsPerLane / 8;          // 16-byte loads per lane per row
  static constexpr int kGroups = kThreads / kLanes;       // token groups per block
  static constexpr int kUnroll = kVecs == 1 ? 4 : 2;      // rows in flight per group
};

template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads) DecodeSplitKernel(DecodeAttentionParams p) {
  using Shape = DecodeShape<kHeadDim, kGroup>;
  constexpr int kDims = Shape::kDimsPerLane, kLanes = Shape::kLanes, kVecs = Shape::kVecs;
  constexpr int kGroups = Shape::kGroups, kUnroll = Shape::kUnroll;
  __shared__ float shared_max[kGroups][kGroup];
  __shared__ float shared_sum[kGroups][kGroup];
  __shared__ float shared_acc[kGroups][kGroup][kHeadDim];

  const int split_index = blockIdx.x, kv_head = blockIdx.y, row = blockIdx.z;
  const int length = p.positions[row] + 1;
  const int split = SplitTokens(length, p.num_splits);
  const int begin = split_index * split;
  if (begin >= length) return;  // the combine kernel counts only the splits that hold keys
  const int end = min(length, begin + split);
  const int slot = p.slots[row];
  const int64_t head_offset = p.cache.HeadOffset(slot, p.layer, kv_head);
  const __nv_bfloat16* keys = p.cache.keys + head_offset;
  const __nv_bfloat16* values = p.cache.values + head_offset;
  const int group = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  // Lane `lane` owns dims (v * kLanes + lane) * 8 + [0, 8) of each vector: for every v the
  // kLanes lanes of a group read one contiguous run of kLanes * 16 bytes.
  auto dim_of = [&](int v) { return (v * kLanes + lane) * 8; };

  // Queries of the GQA group, scaled into the exp2 domain.
  float q[kGroup][kDims];
  const __nv_bfloat16* q_row =
      p.queries + static_cast<int64_t>(row) * p.num_query_heads * kHeadDim +
      static_cast<int64_t>(kv_head) * kGroup * kHeadDim;
  const float q_scale = p.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const uint4 packed = *reinterpret_cast<const uint4*>(q_row + g * kHeadDim + dim_of(v));
      Bf16x8ToFloat(packed, &q[g][v * 8]);
    }
#pragma unroll
    for (int i = 0; i < kDims; ++i) q[g][i] *= q_scale;
  }

  float running_max[kGroup], running_sum[kGroup], acc[kGroup][kDims];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    running_max[g] = -INFINITY;
    running_sum[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kDims; ++i) acc[g][i] = 0.0f;
  }

  // Every lane of a warp runs the same iterations (shuffles need the whole warp); rows past
  // `end` are loaded as nothing and skipped after the reductions.
  for (int base = begin; base < end; base += kUnroll * kGroups) {
    uint4 key_vecs[kUnroll][kVecs], value_vecs[kUnroll][kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * kGroups + group;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        if (t < end) {
          const int64_t offset = static_cast<int64_t>(t) * kHeadDim + dim_of(v);
          key_vecs[u][v] = *reinterpret_cast<const uint4*>(keys + offset);
          value_vecs[u][v] = *reinterpret_cast<const uint4*>(values + offset);
        } else {
          key_vecs[u][v] = make_uint4(0, 0, 0, 0);
          value_vecs[u][v] = make_uint4(0, 0, 0, 0);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * kGroups + group;
      float k[kDims];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) Bf16x8ToFloat(key_vecs[u][v], &k[v * 8]);
      float score[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kDims; ++i) dot = fmaf(q[g][i], k[i], dot);
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        score[g] = dot;
      }
      if (t < end) {
        float value[kDims];
#pragma unroll
        for (int v = 0; v < kVecs; ++v) Bf16x8ToFloat(value_vecs[u][v], &value[v * 8]);
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          if (score[g] > running_max[g]) {  // rescale only when the maximum grows
            const float correction = exp2f(running_max[g] - score[g]);
            running_sum[g] *= correction;
#pragma unroll
            for (int i = 0; i < kDims; ++i) acc[g][i] *= correction;
            running_max[g] = score[g];
          }
          const float weight = exp2f(score[g] - running_max[g]);
          running_sum[g] += weight;
#pragma unroll
          for (int i = 0; i < kDims; ++i) acc[g][i] = fmaf(weight, value[i], acc[g][i]);
        }
      }
    }
  }

  // Merge the token groups.
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (lane == 0) {
      shared_max[group][g] = running_max[g];
      shared_sum[group][g] = running_sum[g];
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int i = 0; i < 8; ++i) shared_acc[group][g][dim_of(v) + i] = acc[g][v * 8 + i];
    }
  }
  __syncthreads();
  for (int index = threadIdx.x; index < kGroup * kHeadDim; index += kThreads) {
    const int g = index / kHeadDim, d = index % kHeadDim;
    float block_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kGroups; ++j) block_max = fmaxf(block_max, shared_max[j][g]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const float weight = exp2f(shared_max[j][g] - block_max);  // 0 for groups with no keys
      sum += shared_sum[j][g] * weight;
      out += shared_acc[j][g][d] * weight;
    }
    const int64_t head_split =
        (static_cast<int64_t>(row) * p.num_query_heads + kv_head * kGroup + g) * p.num_splits +
        split_index;
    p.partial_out[head_split * kHeadDim + d] = out / sum;
    if (d == 0) p.partial_lse[head_split] = block_max + log2f(sum);
  }
}

__global__ void DecodeCombineKernel(DecodeAttentionParams p) {
  const int head = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
  const int length = p.positions[row] + 1;
  const int used = (length + SplitTokens(length, p.num_splits) - 1) /
                   SplitTokens(length, p.num_splits);
  const int64_t first = (static_cast<int64_t>(row) * p.num_query_heads + head) * p.num_splits;
  float max_lse = -INFINITY;
  for (int s = 0; s < used; ++s) max_lse = fmaxf(max_lse, p.partial_lse[first + s]);
  float sum = 0.0f, out = 0.0f;
  for (int s = 0; s < used; ++s) {
    const float weight = exp2f(p.partial_lse[first + s] - max_lse);
    sum += weight;
    out += weight * p.partial_out[(first + s) * p.head_dim + d];
  }
  p.out[(static_cast<int64_t>(row) * p.num_query_heads + head) * p.head_dim + d] =
      __float2bfloat16(out / sum);
}

template <int kHeadDim>
cudaError_t LaunchForHeadDim(const DecodeAttentionParams& p, int group, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.num_kv_heads, p.rows);
  switch (group) {
#define SKV_DECODE_CASE(G) \
  case G:                  \
    DecodeSplitKernel<kHeadDim, G><<<grid, kThreads, 0, stream>>>(p); \
    break;
    SKV_DECODE_CASE(1)
    SKV_DECODE_CASE(2)
    SKV_DECODE_CASE(3)
    SKV_DECODE_CASE(4)
    SKV_DECODE_CASE(5)
    SKV_DECODE_CASE(6)
    SKV_DECODE_CASE(7)
    SKV_DECODE_CASE(8)
#undef SKV_DECODE_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

bool DecodeAttentionSupports(int head_dim, int group_size) {
  return (head_dim == 64 || head_dim == 128) && group_size >= 1 && group_size <= 8;
}

int DecodeNumSplits(int rows, int num_kv_heads, int target_blocks) {
  const int64_t pairs = std::max<int64_t>(1, static_cast<int64_t>(rows) * num_kv_heads);
  const int64_t splits = (target_blocks + pairs - 1) / pairs;
  return static_cast<int>(std::clamp<int64_t>(splits, 1, kDecodeMaxSplits));
}

cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows < 0 || p.num_kv_heads <= 0 || p.num_query_heads % p.num_kv_heads != 0 ||
      p.num_splits < 1 || p.num_splits > kDecodeMaxSplits) {
    return cudaErrorInvalidValue;
  }
  const int group = p.num_query_heads / p.num_kv_heads;
  if (!DecodeAttentionSupports(p.head_dim, group)) return cudaErrorInvalidValue;
  const cudaError_t error = p.head_dim == 64 ? LaunchForHeadDim<64>(p, group, stream)
                                             : LaunchForHeadDim<128>(p, group, stream);
  if (error != cudaSuccess) return error;
  DecodeCombineKernel<<<dim3(p.num_query_heads, p.rows), p.head_dim, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
