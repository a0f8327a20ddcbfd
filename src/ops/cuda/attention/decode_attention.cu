// Decode attention: one block per (split, KV head, row), each K/V load serving the whole GQA
// group (a group of more than 8 query heads is served 8 heads a block, each block reading the KV
// head once: GLM-4's 16 read it twice); 4 warps stream 16-token tiles into mma.sync fragments
// and merge in shared memory; the combine kernel (one block per query head and row) merges the
// splits. A sliding window only moves the first key a row reads; the splits divide the keys it
// sees. Keys with log weights (ShadowKV's drawn chunks) are a second form of the kernel.
#include "ops/cuda/attention/decode_attention.cuh"

#include <algorithm>
#include <cmath>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/mma_utils.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kWarps = 4;  // 166 registers: 3 blocks per SM
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ int SplitTokens(int length, int num_splits) {
  const int even = (length + num_splits - 1) / num_splits;
  return max(kDecodeMinSplitTokens, (even + 15) / 16 * 16);
}

// Keys a query at position length - 1 sees: [length - visible, length).
__device__ __forceinline__ int VisibleKeys(int length, int window) {
  return window > 0 ? min(length, window) : length;
}

// A warp takes 16 tokens at a time straight from global memory into registers laid out as
// mma.sync fragments (no shared memory, no barriers in the loop):
//   S[heads x 16 tokens] = Q[16 x D] · Kᵀ: the GQA heads are rows 0..group-1 of A (the other
//     rows zero), K is the B operand. Dot products do not care about the order of the summed
//     dims, so lane (g, c) = (lane/4, lane%4) holds 16-byte chunks 4i + c of tokens g and g + 8
//     (a quad reads 64 contiguous bytes per load), and Q is loaded with the same permutation.
//   O[heads x D] += P[heads x 16 tokens] · V: the score fragments are the A operand; lane (g, c)
//     holds chunks g + 8m of tokens 2c, 2c+1, 2c+8, 2c+9 (8 lanes read 128 contiguous bytes per
//     load) and pairs the two tokens of each B register with a byte permute. Output column n of
//     n-tile 8m + e is dim 64m + 8n + e.
// Head dims 16, 32 and 96 have fewer 16-byte chunks per token than the lanes that read them: the
// lanes past the last chunk load zeros (which add nothing to the dot products) and their output
// columns are never stored. Head dims 64, 128 and 256 have no such lanes.
// Rows past the split's end are clamped to its last token (never the unwritten rows past the
// sequence) and get probability 0 exactly.

__device__ __forceinline__ uint4 LoadStream(const __nv_bfloat16* address) {
  return __ldg(reinterpret_cast<const uint4*>(address));
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// d0, d1 (row g of the 16x8 tile) = A · B + (d0, d1), where A's rows g + 8 are zero and the
// results of rows g + 8 are dropped.
__device__ __forceinline__ void MmaLowRows(float& d0, float& d1, uint32_t a0, uint32_t a2,
                                           uint32_t b0, uint32_t b1) {
  asm("{\n.reg .f32 unused2, unused3;\n"  // rows g + 8: zero inputs, results dropped
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, unused2, unused3}, "
      "{%2, %3, %4, %5}, {%6, %7}, {%8, %9, %10, %11};\n}\n"
      : "=f"(d0), "=f"(d1)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(d0), "f"(d1), "f"(0.0f),
        "f"(0.0f));
}

template <int kHeadDim>
struct KvTile {
  static constexpr int kChunks = kHeadDim / 8;              // 16-byte chunks per token
  static constexpr int kKeyChunks = (kChunks + 3) / 4;      // per token per lane
  static constexpr int kValueChunks = (kChunks + 7) / 8;    // per token per lane
  static constexpr bool kPartialKeys = kChunks % 4 != 0;    // lanes c >= kChunks read none
  static constexpr bool kPartialValues = kChunks % 8 != 0;  // lanes g >= kChunks read none
  static_assert(kHeadDim % 16 == 0 && kHeadDim >= 16);
  uint4 keys[2][kKeyChunks];      // tokens g, g + 8
  uint4 values[4][kValueChunks];  // tokens 2c, 2c + 1, 2c + 8, 2c + 9
};

template <int kHeadDim>
__device__ __forceinline__ void LoadKvTile(KvTile<kHeadDim>& tile, const __nv_bfloat16* keys,
                                           const __nv_bfloat16* values, int base, int last,
                                           int g, int c) {
  using Tile = KvTile<kHeadDim>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int token = min(base + 8 * h + g, last);
#pragma unroll
    for (int i = 0; i < Tile::kKeyChunks; ++i) {
      const int chunk = 4 * i + c;
      tile.keys[h][i] = !Tile::kPartialKeys || chunk < Tile::kChunks
                            ? LoadStream(keys + token * kHeadDim + chunk * 8)
                            : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int token = min(base + 2 * c + (j & 1) + (j >> 1) * 8, last);
#pragma unroll
    for (int m = 0; m < Tile::kValueChunks; ++m) {
      const int chunk = g + 8 * m;
      tile.values[j][m] = !Tile::kPartialValues || chunk < Tile::kChunks
                              ? LoadStream(values + token * kHeadDim + chunk * 8)
                              : make_uint4(0, 0, 0, 0);
    }
  }
}

template <int kHeadDim>
struct MmaState {
  float max = -INFINITY;  // row g's running maximum (the same in the 4 lanes of a quad)
  float sum = 0.0f;       // this lane's share of row g's sum of probabilities
  float acc[8 * KvTile<kHeadDim>::kValueChunks][2] = {};  // [n-tile][row g's two columns]
};

// `bias`: what each of this lane's four tokens (2c, 2c + 1, 2c + 8, 2c + 9) adds to its scaled
// score, in log2 units (weighted keys), or null.
template <int kHeadDim>
__device__ __forceinline__ void ProcessKvTile(const KvTile<kHeadDim>& tile,
                                              const uint32_t (&q)[KvTile<kHeadDim>::kKeyChunks][4],
                                              float q_scale, int base, int end, int c,
                                              MmaState<kHeadDim>& state,
                                              const float* bias = nullptr) {
  constexpr int kKeyChunks = KvTile<kHeadDim>::kKeyChunks;
  constexpr int kValueChunks = KvTile<kHeadDim>::kValueChunks;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;  // tokens 2c, 2c+1 | 2c+8, 2c+9
#pragma unroll
  for (int i = 0; i < kKeyChunks; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      MmaLowRows(s0, s1, q[i][2 * h], q[i][2 * h + 1], Word(tile.keys[0][i], 2 * h),
                 Word(tile.keys[0][i], 2 * h + 1));
      MmaLowRows(s2, s3, q[i][2 * h], q[i][2 * h + 1], Word(tile.keys[1][i], 2 * h),
                 Word(tile.keys[1][i], 2 * h + 1));
    }
  }
  const int token = base + 2 * c;
  float x[4] = {s0 * q_scale, s1 * q_scale, s2 * q_scale, s3 * q_scale};
  if (bias) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] += bias[i];
  }
  if (token + 9 >= end) {
    if (token >= end) x[0] = -INFINITY;
    if (token + 1 >= end) x[1] = -INFINITY;
    if (token + 8 >= end) x[2] = -INFINITY;
    if (token + 9 >= end) x[3] = -INFINITY;
  }
  float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  // Token `base` is always visible, so new_max is finite.
  const float new_max = fmaxf(state.max, tile_max);
  const float correction = exp2f(state.max - new_max);
  state.max = new_max;
  const uint32_t p_low = PackBf16(exp2f(x[0] - new_max), exp2f(x[1] - new_max));
  const uint32_t p_high = PackBf16(exp2f(x[2] - new_max), exp2f(x[3] - new_max));
  // The sum uses the bf16-rounded probabilities that weight V, so the weights sum to exactly 1.
  const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p_low));
  const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p_high));
  state.sum = state.sum * correction + ((low.x + low.y) + (high.x + high.y));
#pragma unroll
  for (int m = 0; m < kValueChunks; ++m) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int w = e / 2;
      const uint32_t selector = (e & 1) ? 0x7632u : 0x5410u;
      const uint32_t b0 =
          __byte_perm(Word(tile.values[0][m], w), Word(tile.values[1][m], w), selector);
      const uint32_t b1 =
          __byte_perm(Word(tile.values[2][m], w), Word(tile.values[3][m], w), selector);
      float& d0 = state.acc[8 * m + e][0];
      float& d1 = state.acc[8 * m + e][1];
      d0 *= correction;
      d1 *= correction;
      MmaLowRows(d0, d1, p_low, p_high, b0, b1);
    }
  }
}

// kWeighted: the keys' log weights (DecodeAttentionParams::key_log_weight) are read.
template <int kHeadDim, bool kWeighted>
__global__ void __launch_bounds__(kThreads) DecodeMmaKernel(DecodeAttentionParams p) {
  constexpr int kKeyChunks = KvTile<kHeadDim>::kKeyChunks;
  constexpr int kValueChunks = KvTile<kHeadDim>::kValueChunks;
  __shared__ float shared_max[kWarps][kDecodeHeadsPerBlock];
  __shared__ float shared_sum[kWarps][kDecodeHeadsPerBlock];
  __shared__ float shared_acc[kWarps][kDecodeHeadsPerBlock][kHeadDim];

  const int group = p.num_query_heads / p.num_kv_heads, blocks = DecodeGroupBlocks(group);
  const int split_index = blockIdx.x, kv_head = blockIdx.y / blocks, row = blockIdx.z;
  // This block's query heads of the group: [first_head, first_head + heads).
  const int first_head = blockIdx.y % blocks * kDecodeHeadsPerBlock;
  const int heads = min(kDecodeHeadsPerBlock, group - first_head);
  const int length = p.positions[row] + 1;
  const int visible = VisibleKeys(length, p.window);
  const int split = SplitTokens(visible, p.num_splits);
  const int begin = length - visible + split_index * split;
  if (begin >= length) return;  // the combine kernel counts only the splits that hold keys
  const int end = min(length, begin + split);
  const int64_t head_offset = p.cache.HeadOffset(p.slots[row], p.layer, kv_head);
  const __nv_bfloat16* keys = p.cache.keys + head_offset;
  const __nv_bfloat16* values = p.cache.values + head_offset;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

  uint32_t q[kKeyChunks][4];
  const __nv_bfloat16* q_row =
      p.queries + static_cast<int64_t>(row) * p.num_query_heads * kHeadDim +
      static_cast<int64_t>(kv_head * group + first_head + g) * kHeadDim;
#pragma unroll
  for (int i = 0; i < kKeyChunks; ++i) {
    const bool present = !KvTile<kHeadDim>::kPartialKeys || 4 * i + c < KvTile<kHeadDim>::kChunks;
    const uint4 chunk = g < heads && present
                            ? *reinterpret_cast<const uint4*>(q_row + (4 * i + c) * 8)
                            : make_uint4(0, 0, 0, 0);
    q[i][0] = chunk.x;
    q[i][1] = chunk.y;
    q[i][2] = chunk.z;
    q[i][3] = chunk.w;
  }
  const float q_scale = p.scale * kLog2e;

  MmaState<kHeadDim> state;
  const int num_tiles = (end - begin + 15) / 16, last = end - 1;
  // Weighted keys: the runs' first key and count, and this KV head's weights.
  int weight_first = 0, weight_keys = 0;
  const float* weights = nullptr;
  if constexpr (kWeighted) {
    weight_first = p.weight_first[row];
    weight_keys = p.weight_runs * p.weight_run;
    weights = p.key_log_weight +
              ((static_cast<int64_t>(p.slots[row]) * p.cache.num_layers + p.layer) *
                   p.num_kv_heads + kv_head) * p.weight_runs;
  }
  for (int t = warp; t < num_tiles; t += kWarps) {
    const int base = begin + 16 * t;
    KvTile<kHeadDim> tile;
    LoadKvTile<kHeadDim>(tile, keys, values, base, last, g, c);
    if constexpr (kWeighted) {
      float bias[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = base + 2 * c + (i & 1) + (i >> 1) * 8 - weight_first;
        bias[i] = key >= 0 && key < weight_keys ? weights[key / p.weight_run] * kLog2e : 0.0f;
      }
      ProcessKvTile<kHeadDim>(tile, q, q_scale, base, end, c, state, bias);
    } else {
      ProcessKvTile<kHeadDim>(tile, q, q_scale, base, end, c, state);
    }
  }

  // Merge the warps: row g's sum over its quad, then every warp's share through shared memory.
  state.sum += __shfl_xor_sync(0xffffffffu, state.sum, 1);
  state.sum += __shfl_xor_sync(0xffffffffu, state.sum, 2);
  if (c == 0) {
    shared_max[warp][g] = state.max;
    shared_sum[warp][g] = state.sum;
  }
#pragma unroll
  for (int m = 0; m < kValueChunks; ++m) {
    // Columns 2c and 2c + 1 of n-tile 8m + e: dims 64m + 16c + e and 64m + 16c + 8 + e.
    if (KvTile<kHeadDim>::kPartialValues && 64 * m + 16 * c >= kHeadDim) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      shared_acc[warp][g][64 * m + 16 * c + e] = state.acc[8 * m + e][0];
      shared_acc[warp][g][64 * m + 16 * c + 8 + e] = state.acc[8 * m + e][1];
    }
  }
  __syncthreads();
  for (int index = threadIdx.x; index < heads * kHeadDim; index += kThreads) {
    const int head = index / kHeadDim, d = index % kHeadDim;
    float block_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, shared_max[w][head]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(shared_max[w][head] - block_max);  // 0 for idle warps
      sum += shared_sum[w][head] * weight;
      out += shared_acc[w][head][d] * weight;
    }
    const int64_t head_split =
        (static_cast<int64_t>(row) * p.num_query_heads + kv_head * group + first_head + head) *
            p.num_splits +
        split_index;
    p.partial_out[head_split * kHeadDim + d] = out / sum;
    if (d == 0) p.partial_lse[head_split] = block_max + log2f(sum);
  }
}

__global__ void DecodeCombineKernel(DecodeAttentionParams p) {
  const int head = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
  const int visible = VisibleKeys(p.positions[row] + 1, p.window);
  const int used =
      (visible + SplitTokens(visible, p.num_splits) - 1) / SplitTokens(visible, p.num_splits);
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
cudaError_t LaunchForHeadDim(const DecodeAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_splits, DecodeHeadBlocks(p.num_query_heads, p.num_kv_heads), p.rows);
  if (p.key_log_weight) {
    DecodeMmaKernel<kHeadDim, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    DecodeMmaKernel<kHeadDim, false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

bool DecodeAttentionSupports(int head_dim, int group_size) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 ||
          head_dim == 256) &&
         group_size >= 1 && group_size <= kDecodeMaxGroup;
}

int DecodeNumSplits(int rows, int num_kv_heads, int target_blocks) {
  const int64_t pairs = std::max<int64_t>(1, static_cast<int64_t>(rows) * num_kv_heads);
  const int64_t two_waves = 2 * (static_cast<int64_t>(target_blocks) * 3 / 8);
  return static_cast<int>(std::clamp<int64_t>(two_waves / pairs, 1, kDecodeMaxSplits));
}

cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows < 0 || p.num_kv_heads <= 0 || p.num_query_heads % p.num_kv_heads != 0 ||
      p.num_splits < 1 || p.num_splits > kDecodeMaxSplits || p.window < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.key_log_weight && (!p.weight_first || p.weight_runs < 0 || p.weight_run < 1)) {
    return cudaErrorInvalidValue;
  }
  const int group = p.num_query_heads / p.num_kv_heads;
  if (!DecodeAttentionSupports(p.head_dim, group)) return cudaErrorInvalidValue;
  cudaError_t error = cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 16:
      error = LaunchForHeadDim<16>(p, stream);
      break;
    case 32:
      error = LaunchForHeadDim<32>(p, stream);
      break;
    case 64:
      error = LaunchForHeadDim<64>(p, stream);
      break;
    case 96:
      error = LaunchForHeadDim<96>(p, stream);
      break;
    case 128:
      error = LaunchForHeadDim<128>(p, stream);
      break;
    case 256:
      error = LaunchForHeadDim<256>(p, stream);
      break;
  }
  if (error != cudaSuccess) return error;
  DecodeCombineKernel<<<dim3(p.num_query_heads, p.rows), p.head_dim, 0, stream>>>(p);
  return cudaGetLastError();
}


}  // namespace shadowkv::cuda
