// Prefill flash attention (FlashAttention-2 style on mma.sync), the kernel wherever the wgmma one
// (prefill_attention_wgmma.cu) does not run. A block takes "packed" rows of one KV head: packed
// row R is query token R / group of query head kv_head * group + R % group, so the GQA heads of a
// KV head share every K/V tile. Scores, the running max and sum, and the output stay in
// registers; K/V tiles pass through shared memory (cp.async), and the score fragments are reused
// directly as the A operand of P·V. With a sliding window a block starts at the first tile its
// lowest row sees, and masks keys below each row's window as it masks keys above its position.
#include "ops/cuda/attention/prefill_attention.cuh"

#include <cmath>
#include <cstdlib>

#include "ops/cuda/attention/prefill_attention_wgmma.cuh"
#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/common/mma_utils.cuh"

namespace shadowkv::cuda {
namespace {

// kWarps warps of kMTiles x 16 packed rows each (with 2 m-tiles a warp
// reuses every K/V fragment it loads from shared memory twice, and a 128-row block halves the
// K/V traffic per FLOP), queries in shared memory, K/V tiles double-buffered: tile i + 1 is on
// its way (cp.async) while tile i is computed.

template <int kHeadDim, int kWarps, int kMTiles, int kTileKeys>
struct PipelinedShape {
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kRows = kWarps * 16 * kMTiles;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSharedBytes = (kRows + 4 * kTileKeys) * kStride * 2;
  static_assert(kTileKeys % 16 == 0);
};

template <int kHeadDim, int kWarps, int kMTiles, int kTileKeys>
__global__ void __launch_bounds__(kWarps * 32)
    PrefillPipelinedKernel(PrefillAttentionParams p) {
  using Shape = PipelinedShape<kHeadDim, kWarps, kMTiles, kTileKeys>;
  constexpr int kStride = Shape::kStride, kBlockRows = Shape::kRows;
  constexpr int kBlockThreads = Shape::kThreads;
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kKeyTiles = kTileKeys / 8;
  extern __shared__ uint4 shared_words[];
  __nv_bfloat16* query_tile = reinterpret_cast<__nv_bfloat16*>(shared_words);
  __nv_bfloat16* key_tiles = query_tile + kBlockRows * kStride;  // [2][kTileKeys][kStride]
  __nv_bfloat16* value_tiles = key_tiles + 2 * kTileKeys * kStride;  // [2][kTileKeys][kStride]

  const PrefillSequence seq = p.sequences[blockIdx.z];
  const int kv_head = blockIdx.y;
  const int group = p.num_query_heads / p.num_kv_heads;
  const int packed_rows = seq.num_queries * group;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;  // heaviest tiles start first
  if (row0 >= packed_rows) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q_width = static_cast<int64_t>(p.num_query_heads) * kHeadDim;
  const int64_t head_offset = p.cache.HeadOffset(seq.slot, p.layer, kv_head);
  const __nv_bfloat16* keys = p.cache.keys + head_offset;
  const __nv_bfloat16* values = p.cache.values + head_offset;

  const int last_packed = min(packed_rows, row0 + kBlockRows) - 1;
  const int num_keys = seq.first_position + last_packed / group + 1;
  const int num_tiles = (num_keys + kTileKeys - 1) / kTileKeys;
  const int min_position = seq.first_position + row0 / group;
  const int max_position = num_keys - 1;
  // Keys below the lowest row's window are seen by no row of the block.
  const int first_tile = p.window > 0 ? max(0, min_position - p.window + 1) / kTileKeys : 0;
  auto load_tile = [&](int tile) {
    const int stage = tile & 1, key0 = tile * kTileKeys;
    for (int index = threadIdx.x; index < kTileKeys * kChunks; index += kBlockThreads) {
      const int r = index / kChunks, column = index % kChunks * 8;
      const int key = key0 + r;
      const int64_t offset = static_cast<int64_t>(key < num_keys ? key : 0) * kHeadDim + column;
      const int bytes = key < num_keys ? 16 : 0;  // zeros past the last key, never garbage
      CpAsync16(&key_tiles[(stage * kTileKeys + r) * kStride + column], keys + offset, bytes);
      CpAsync16(&value_tiles[(stage * kTileKeys + r) * kStride + column], values + offset, bytes);
    }
    CpAsyncCommit();
  };
  load_tile(first_tile);

  for (int index = threadIdx.x; index < kBlockRows * kChunks; index += kBlockThreads) {
    const int r = index / kChunks, column = index % kChunks * 8;
    const int packed = row0 + r;
    uint4 chunk = make_uint4(0, 0, 0, 0);
    if (packed < packed_rows) {
      const int token = packed / group, head = kv_head * group + packed % group;
      chunk = *reinterpret_cast<const uint4*>(p.queries + (seq.first_row + token) * q_width +
                                              head * kHeadDim + column);
    }
    *reinterpret_cast<uint4*>(&query_tile[r * kStride + column]) = chunk;
  }

  // Rows of m-tile mt of this thread: warp_row + 16 mt + lane / 4 (+ 8).
  const int warp_row = warp * 16 * kMTiles;
  int position_low[kMTiles], position_high[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    position_low[mt] = seq.first_position + (row0 + warp_row + mt * 16 + lane / 4) / group;
    position_high[mt] = seq.first_position + (row0 + warp_row + mt * 16 + lane / 4 + 8) / group;
  }
  const float score_scale = p.scale * kLog2e;

  float out[kMTiles][kDimTiles][4];
  float max_low[kMTiles], max_high[kMTiles], sum_low[kMTiles], sum_high[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      out[mt][dt][0] = out[mt][dt][1] = out[mt][dt][2] = out[mt][dt][3] = 0.0f;
    }
    max_low[mt] = max_high[mt] = -INFINITY;
    sum_low[mt] = sum_high[mt] = 0.0f;
  }

  for (int tile = first_tile; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1);
    } else {
      CpAsyncCommit();  // an empty group keeps the wait below uniform
    }
    CpAsyncWait<1>();  // this thread's copies of `tile` landed
    __syncthreads();   // everyone's did (and the queries are stored)
    const int key0 = tile * kTileKeys;
    const __nv_bfloat16* key_tile = key_tiles + (tile & 1) * kTileKeys * kStride;
    const __nv_bfloat16* value_tile = value_tiles + (tile & 1) * kTileKeys * kStride;

    float score[kMTiles][kKeyTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
        score[mt][nt][0] = score[mt][nt][1] = score[mt][nt][2] = score[mt][nt][3] = 0.0f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        LdMatrixX4(a[mt], &query_tile[(warp_row + mt * 16 + lane % 16) * kStride + kk * 16 +
                                      lane / 16 * 8]);
      }
#pragma unroll
      for (int pair = 0; pair < kKeyTiles / 2; ++pair) {
        uint32_t b[4];
        LdMatrixX4(b, &key_tile[(pair * 16 + lane % 8 + lane / 16 * 8) * kStride + kk * 16 +
                                lane / 8 % 2 * 8]);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          MmaBf16(score[mt][2 * pair], a[mt], b[0], b[1]);
          MmaBf16(score[mt][2 * pair + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Causal: a key above some row's position; window: a key below some row's window.
    const bool needs_mask =
        key0 + kTileKeys - 1 > min_position || (p.window > 0 && key0 + p.window <= max_position);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      // The maximum is taken over raw scores and the scale is folded into one FMA per
      // probability (scale > 0 commutes with max), and exp2 is the bare ex2.approx.
      float tile_max_low = -INFINITY, tile_max_high = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + nt * 8 + lane % 4 * 2 + (e & 1);
          const int position = e < 2 ? position_low[mt] : position_high[mt];
          float s = score[mt][nt][e];
          if (needs_mask && (key > position || (p.window > 0 && key + p.window <= position))) {
            s = -INFINITY;
          }
          score[mt][nt][e] = s;
        }
        tile_max_low = fmaxf(tile_max_low, fmaxf(score[mt][nt][0], score[mt][nt][1]));
        tile_max_high = fmaxf(tile_max_high, fmaxf(score[mt][nt][2], score[mt][nt][3]));
      }
#pragma unroll
      for (int offset = 1; offset <= 2; offset <<= 1) {
        tile_max_low = fmaxf(tile_max_low, __shfl_xor_sync(0xffffffffu, tile_max_low, offset));
        tile_max_high = fmaxf(tile_max_high, __shfl_xor_sync(0xffffffffu, tile_max_high, offset));
      }
      const float new_max_low = fmaxf(max_low[mt], tile_max_low);
      const float new_max_high = fmaxf(max_high[mt], tile_max_high);
      // A row with nothing visible yet keeps -inf; subtracting 0 keeps exp2 at 0, not NaN.
      const float base_low = new_max_low == -INFINITY ? 0.0f : new_max_low;
      const float base_high = new_max_high == -INFINITY ? 0.0f : new_max_high;
      const float correction_low = FastExp2((max_low[mt] - base_low) * score_scale);
      const float correction_high = FastExp2((max_high[mt] - base_high) * score_scale);
      max_low[mt] = new_max_low;
      max_high[mt] = new_max_high;
      float tile_sum_low = 0.0f, tile_sum_high = 0.0f;
      const float offset_low = -base_low * score_scale, offset_high = -base_high * score_scale;
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
        score[mt][nt][0] = FastExp2(fmaf(score[mt][nt][0], score_scale, offset_low));
        score[mt][nt][1] = FastExp2(fmaf(score[mt][nt][1], score_scale, offset_low));
        score[mt][nt][2] = FastExp2(fmaf(score[mt][nt][2], score_scale, offset_high));
        score[mt][nt][3] = FastExp2(fmaf(score[mt][nt][3], score_scale, offset_high));
        tile_sum_low += score[mt][nt][0] + score[mt][nt][1];
        tile_sum_high += score[mt][nt][2] + score[mt][nt][3];
      }
      sum_low[mt] = sum_low[mt] * correction_low + tile_sum_low;
      sum_high[mt] = sum_high[mt] * correction_high + tile_sum_high;
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        out[mt][dt][0] *= correction_low;
        out[mt][dt][1] *= correction_low;
        out[mt][dt][2] *= correction_high;
        out[mt][dt][3] *= correction_high;
      }
    }

#pragma unroll
    for (int j = 0; j < kTileKeys / 16; ++j) {
      uint32_t p_frag[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        p_frag[mt][0] = PackBf16(score[mt][2 * j][0], score[mt][2 * j][1]);
        p_frag[mt][1] = PackBf16(score[mt][2 * j][2], score[mt][2 * j][3]);
        p_frag[mt][2] = PackBf16(score[mt][2 * j + 1][0], score[mt][2 * j + 1][1]);
        p_frag[mt][3] = PackBf16(score[mt][2 * j + 1][2], score[mt][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t b[4];
        LdMatrixX4Trans(b, &value_tile[(j * 16 + lane % 8 + lane / 8 % 2 * 8) * kStride +
                                       dp * 16 + lane / 16 * 8]);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          MmaBf16(out[mt][2 * dp], p_frag[mt], b[0], b[1]);
          MmaBf16(out[mt][2 * dp + 1], p_frag[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's copies overwrite this stage
  }

#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int offset = 1; offset <= 2; offset <<= 1) {
      sum_low[mt] += __shfl_xor_sync(0xffffffffu, sum_low[mt], offset);
      sum_high[mt] += __shfl_xor_sync(0xffffffffu, sum_high[mt], offset);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int packed = row0 + warp_row + mt * 16 + lane / 4 + 8 * half;
      if (packed >= packed_rows) continue;
      const float inv = 1.0f / (half == 0 ? sum_low[mt] : sum_high[mt]);
      const int token = packed / group, head = kv_head * group + packed % group;
      __nv_bfloat16* dest = p.out + (seq.first_row + token) * q_width + head * kHeadDim;
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        const int dim = dt * 8 + lane % 4 * 2;
        *reinterpret_cast<__nv_bfloat162*>(dest + dim) =
            __floats2bfloat162_rn(out[mt][dt][2 * half] * inv, out[mt][dt][2 * half + 1] * inv);
      }
    }
  }
}

template <int kHeadDim, int kWarps, int kMTiles, int kTileKeys>
cudaError_t LaunchPipelined(const PrefillAttentionParams& p, int group, cudaStream_t stream) {
  using Shape = PipelinedShape<kHeadDim, kWarps, kMTiles, kTileKeys>;
  auto kernel = PrefillPipelinedKernel<kHeadDim, kWarps, kMTiles, kTileKeys>;
  const cudaError_t configured =
      AllowDynamicSharedMemory(reinterpret_cast<const void*>(kernel), Shape::kSharedBytes);
  if (configured != cudaSuccess) return configured;
  const int64_t tiles = (static_cast<int64_t>(p.max_queries) * group + Shape::kRows - 1) / Shape::kRows;
  const dim3 grid(static_cast<unsigned>(tiles), p.num_kv_heads, p.num_sequences);
  kernel<<<grid, Shape::kThreads, Shape::kSharedBytes, stream>>>(p);
  return cudaGetLastError();
}

// Head dim 128 on a build with sm_90a code: wgmma; elsewhere (head dims 16 to 96, and 128
// without sm_90a code) 4 warps x 32 rows on mma.sync; head dim 256 4 warps x 16 rows and 32-key
// tiles (its output fragments alone take 128 registers a thread).
template <int kHeadDim>
cudaError_t LaunchForHeadDim(const PrefillAttentionParams& p, int group, cudaStream_t stream) {
  if constexpr (kHeadDim == 256) {
    return LaunchPipelined<256, 4, 1, 32>(p, group, stream);
  } else {
    if (kHeadDim != 128 || !PrefillWgmmaAvailable()) {
      return LaunchPipelined<kHeadDim, 4, 2, 64>(p, group, stream);
    }
    return LaunchPrefillWgmma(p, group, stream);
  }
}

}  // namespace

bool PrefillAttentionSupports(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 ||
         head_dim == 256;
}

cudaError_t LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream) {
  if (p.num_sequences == 0 || p.max_queries == 0) return cudaSuccess;
  if (p.num_sequences < 0 || p.max_queries < 0 || p.num_kv_heads <= 0 ||
      p.num_query_heads % p.num_kv_heads != 0 || !PrefillAttentionSupports(p.head_dim) ||
      p.window < 0) {
    return cudaErrorInvalidValue;
  }
  const int group = p.num_query_heads / p.num_kv_heads;
  switch (p.head_dim) {
    case 16:
      return LaunchForHeadDim<16>(p, group, stream);
    case 32:
      return LaunchForHeadDim<32>(p, group, stream);
    case 64:
      return LaunchForHeadDim<64>(p, group, stream);
    case 96:
      return LaunchForHeadDim<96>(p, group, stream);
    case 256:
      return LaunchForHeadDim<256>(p, group, stream);
    default:
      return LaunchForHeadDim<128>(p, group, stream);
  }
}

}  // namespace shadowkv::cuda
