// ShadowKV decode kernels, second version (kSkvKernelsFast): landmark scoring with several
// landmark loads in flight per thread, or on the tensor cores, that also leaves each block's
// softmax statistics for the select. The select is in select.cu, the key rebuild in rebuild.cu.
#include <cmath>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/common/mma_utils.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"
#include "ops/cuda/shadowkv/shadowkv_fp8.cuh"

namespace shadowkv::cuda {
namespace {

using Bf16 = __nv_bfloat16;

// ---- scoring ----------------------------------------------------------------------------------

constexpr int kScoreThreads = 256;
constexpr int kScoreChunksPerBlock = kSkvScoreChunksPerBlock;
constexpr int kScoreUnroll = 4;

// Online softmax statistics: (max, sum of exp(x - max)) after adding logit x (−inf: nothing).
__device__ __forceinline__ void SoftmaxAdd(float x, float* top, float* sum) {
  if (x == -INFINITY) return;
  if (x > *top) {
    *sum = *sum * expf(*top - x) + 1.0f;
    *top = x;
  } else {
    *sum += expf(x - *top);
  }
}

// As the first scoring kernel, but each thread issues kScoreUnroll landmark loads before using
// any, and loads them whether or not the chunk is an outlier (the flag only masks the result),
// so no load waits on another. Each block also writes its chunks' softmax statistics per query
// head, so the select kernel needs one read of the logits, not three.
template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kScoreThreads) SkvScoreFastKernel(SkvDecodeParams p) {
  constexpr int kLanes = kHeadDim / 8;
  constexpr int kChunksPerPass = kScoreThreads / kLanes;
  static_assert(kGroup <= kLanes, "one lane per query head holds its logit");
  __shared__ float part_top[kChunksPerPass][kGroup], part_sum[kChunksPerPass][kGroup];
  const int row = blockIdx.z, h = blockIdx.y;
  const SkvRowMeta m = p.meta[row];
  const SkvLayout& l = p.layout;
  const int first = blockIdx.x * kScoreChunksPerBlock;
  // No selection at this step (reuse or drift).
  if (first >= m.num_chunks || SkvKeepsChunks(p, m, row, h)) return;
  const int lane = threadIdx.x % kLanes, sub = threadIdx.x / kLanes;
  float q[kGroup][8];
  const Bf16* q_row =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * kHeadDim;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    Bf16x8ToFloat(*reinterpret_cast<const uint4*>(q_row + g * kHeadDim + lane * 8), q[g]);
  }
  const int64_t head_index = l.HeadIndex(m.seq, p.layer, h);
  const Bf16* landmarks = l.landmarks + head_index * l.capacity_chunks * kHeadDim;
  const uint8_t* outlier = l.outlier + head_index * l.capacity_chunks;
  float* logits =
      p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * l.capacity_chunks;
  const int last = min(first + kScoreChunksPerBlock, m.num_chunks);
  float run_top = -INFINITY, run_sum = 0.0f;  // lane g < kGroup: query head g's statistics
  for (int base = first; base < last; base += kChunksPerPass * kScoreUnroll) {
    uint4 packed[kScoreUnroll];
    uint8_t flags[kScoreUnroll];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int c = base + u * kChunksPerPass + sub;
      packed[u] = make_uint4(0, 0, 0, 0);
      flags[u] = 1;
      if (c < last) {
        packed[u] = *reinterpret_cast<const uint4*>(landmarks + static_cast<int64_t>(c) * kHeadDim +
                                                    lane * 8);
        flags[u] = outlier[c];
      }
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int c = base + u * kChunksPerPass + sub;
      float k[8];
      Bf16x8ToFloat(packed[u], k);
      float mine = 0.0f;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(q[g][i], k[i], dot);
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        if (lane == g) mine = dot;
      }
      if (c < last && lane < kGroup) {
        const float x = flags[u] ? -INFINITY : mine * p.scale;
        logits[static_cast<int64_t>(lane) * l.capacity_chunks + c] = x;
        SoftmaxAdd(x, &run_top, &run_sum);
      }
    }
  }
  if (lane < kGroup) {
    part_top[sub][lane] = run_top;
    part_sum[sub][lane] = run_sum;
  }
  __syncthreads();
  if (threadIdx.x < kGroup) {
    const int g = threadIdx.x;
    float top = -INFINITY, sum = 0.0f;
    for (int i = 0; i < kChunksPerPass; ++i) top = fmaxf(top, part_top[i][g]);
    if (top != -INFINITY) {
      for (int i = 0; i < kChunksPerPass; ++i) {
        if (part_top[i][g] != -INFINITY) sum += part_sum[i][g] * expf(part_top[i][g] - top);
      }
    }
    float* partial =
        p.softmax_partials +
        ((static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup + g) *
            SkvScoreBlocks(l.capacity_chunks) * 2 +
        blockIdx.x * 2;
    partial[0] = top;
    partial[1] = sum;
  }
}

// Merges softmax statistics (top_b, sum_b) into (top, sum).
__device__ __forceinline__ void SoftmaxMerge(float top_b, float sum_b, float* top, float* sum) {
  if (top_b == -INFINITY) return;
  if (*top == -INFINITY) {
    *top = top_b;
    *sum = sum_b;
    return;
  }
  const float t = fmaxf(*top, top_b);
  *sum = *sum * expf(*top - t) + sum_b * expf(top_b - t);
  *top = t;
}

constexpr int kScoreTcWarps = 4;
constexpr int kScoreTcStages = 4;  // tiles in flight per warp (cp.async ring depth)
constexpr int kScoreTcTile = 16;   // chunks per tensor-core tile (the mma's M)

// Shared memory of the tensor-core scoring, per warp and ring stage: a tile of 16 landmarks
// (rows padded by 16 bytes so the fragment loads avoid bank conflicts), under FP8 their 16
// scales, and their outlier flags.
template <int kHeadDim, bool kFp8>
struct ScoreTcShared {
  static constexpr int kRowBytes = kFp8 ? kHeadDim + 16 : (kHeadDim + 8) * 2;
  static constexpr int kTileBytes = kScoreTcTile * kRowBytes;
  static constexpr int kScaleBytes = kFp8 ? kScoreTcTile * 4 : 0;
  static constexpr int kSlots = kScoreTcWarps * kScoreTcStages;
  static constexpr int kScalesAt = kSlots * kTileBytes;
  static constexpr int kFlagsAt = kScalesAt + kSlots * kScaleBytes;
  static constexpr int64_t kBytes = kFlagsAt + kSlots * kScoreTcTile;
};

int64_t ScoreTcSharedBytes(int head_dim, bool fp8) {
  if (head_dim == 256) return fp8 ? ScoreTcShared<256, true>::kBytes : ScoreTcShared<256, false>::kBytes;
  if (head_dim == 96) return fp8 ? ScoreTcShared<96, true>::kBytes : ScoreTcShared<96, false>::kBytes;
  if (head_dim == 128) return fp8 ? ScoreTcShared<128, true>::kBytes : ScoreTcShared<128, false>::kBytes;
  return fp8 ? ScoreTcShared<64, true>::kBytes : ScoreTcShared<64, false>::kBytes;
}

// Scoring on the tensor cores: each warp owns kSkvScoreChunksPerBlock chunks of one (row, KV
// head) and streams them in 16-chunk tiles through a cp.async ring; one m16n8k16 product per
// 16 dimensions and 8 query heads gives the tile's logits for those heads (the mma's N = 8
// columns hold them, the rest zero; a group of 16 takes two products on the same A fragment). No cross-lane reduction per chunk, and the
// warp's softmax statistics come out of the same pass. Needs capacity_chunks % 16 == 0 (the
// outlier flags of a tile are one aligned 16-byte copy).
// FP8 landmarks (kFp8): the codes convert exactly to fp16 in registers and the product runs in
// fp16 with the query rounded to fp16 (saturated; bf16 values from 2^-14 to 65504 convert
// exactly); each logit is then multiplied by its landmark's scale. A lane loads 4 consecutive
// codes per row and step, dims 4c..4c+3 of the 16, and takes them as the mma's k = 2c, 2c+1,
// 2c+8, 2c+9; the query fragment is permuted the same way (a dot product ignores the order).
template <int kHeadDim, int kGroup, bool kFp8>
__global__ void __launch_bounds__(kScoreTcWarps * 32) SkvScoreTcKernel(SkvDecodeParams p) {
  static_assert(kGroup <= 16, "two mma column tiles of 8 query heads at most");
  constexpr int kHeadTiles = (kGroup + 7) / 8;
  using Shape = ScoreTcShared<kHeadDim, kFp8>;
  constexpr int kSteps = kHeadDim / 16;
  constexpr int kPieceBytes = 16;
  constexpr int kPieces = kHeadDim * (kFp8 ? 1 : 2) / kPieceBytes;  // 16-byte pieces per landmark
  constexpr int kPitch = Shape::kRowBytes / 2;  // bf16 per shared row (bf16 tiles)
  extern __shared__ __align__(16) unsigned char score_shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto tile_of = [&](int stage) {
    return score_shared + (warp * kScoreTcStages + stage) * Shape::kTileBytes;
  };
  auto scales_of = [&](int stage) {
    return reinterpret_cast<float*>(score_shared + Shape::kScalesAt +
                                    (warp * kScoreTcStages + stage) * Shape::kScaleBytes);
  };
  auto flags_of = [&](int stage) {
    return score_shared + Shape::kFlagsAt + (warp * kScoreTcStages + stage) * kScoreTcTile;
  };
  const int h = blockIdx.y, row = blockIdx.z;
  const SkvRowMeta m = p.meta[row];
  const SkvLayout& l = p.layout;
  const int part = blockIdx.x * kScoreTcWarps + warp;
  const int first = part * kSkvScoreChunksPerBlock;
  // Whole warps only (the kernel has no block barrier); reuse: no selection at this step.
  if (first >= m.num_chunks || SkvKeepsChunks(p, m, row, h)) return;
  const int last = min(first + kSkvScoreChunksPerBlock, m.num_chunks);
  const int tiles = (last - first + kScoreTcTile - 1) / kScoreTcTile;
  const int gq = lane / 4, cq = lane % 4;

  // B fragments (16 dims x 8 heads per step and head tile): column gq of tile ht is query head
  // 8 * ht + gq.
  uint32_t qb[kHeadTiles][kSteps][2];
  const Bf16* q_row =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * kHeadDim;
#pragma unroll
  for (int ht = 0; ht < kHeadTiles; ++ht) {
    const int head = 8 * ht + gq;
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      qb[ht][st][0] = qb[ht][st][1] = 0u;
      if (head < kGroup) {
        if constexpr (kFp8) {
          const Bf16* q = q_row + head * kHeadDim + st * 16 + 4 * cq;
          const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(q));
          const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(q + 2));
          qb[ht][st][0] = PackHalf2Saturated(low.x, low.y);
          qb[ht][st][1] = PackHalf2Saturated(high.x, high.y);
        } else {
          const Bf16* q = q_row + head * kHeadDim + st * 16 + 2 * cq;
          qb[ht][st][0] = *reinterpret_cast<const uint32_t*>(q);
          qb[ht][st][1] = *reinterpret_cast<const uint32_t*>(q + 8);
        }
      }
    }
  }
  const int64_t head_index = l.HeadIndex(m.seq, p.layer, h);
  const uint8_t* landmarks =
      kFp8 ? l.landmark_codes + head_index * l.capacity_chunks * kHeadDim
           : reinterpret_cast<const uint8_t*>(l.landmarks + head_index * l.capacity_chunks * kHeadDim);
  constexpr int kLandmarkBytes = kHeadDim * (kFp8 ? 1 : 2);
  const float* landmark_scales = kFp8 ? l.landmark_scales + head_index * l.capacity_chunks : nullptr;
  const uint8_t* outlier = l.outlier + head_index * l.capacity_chunks;
  float* logits =
      p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * l.capacity_chunks;

  auto issue = [&](int tile) {
    if (tile < tiles) {
      const int stage = tile % kScoreTcStages, c0 = first + tile * kScoreTcTile;
      unsigned char* target = tile_of(stage);
#pragma unroll
      for (int i = lane; i < kScoreTcTile * kPieces; i += 32) {
        const int r = i / kPieces, v = i % kPieces;
        const bool inside = c0 + r < last;
        CpAsync16(target + r * Shape::kRowBytes + v * kPieceBytes,
                  inside ? landmarks + static_cast<int64_t>(c0 + r) * kLandmarkBytes +
                               v * kPieceBytes
                         : landmarks,
                  inside ? 16 : 0);
      }
      if constexpr (kFp8) {
        // c0 + 15 < capacity_chunks: the scales past `last` are read and never used.
        if (lane < kScoreTcTile / 4) CpAsync16(scales_of(stage) + 4 * lane, landmark_scales + c0 + 4 * lane, 16);
      }
      if (lane == 0) CpAsync16(flags_of(stage), outlier + c0, 16);
    }
    CpAsyncCommit();  // empty groups too: every iteration waits on the same count
  };
#pragma unroll
  for (int t = 0; t < kScoreTcStages - 1; ++t) issue(t);

  // Heads 8 * ht + 2cq and 8 * ht + 2cq + 1.
  float run_top[kHeadTiles][2], run_sum[kHeadTiles][2];
#pragma unroll
  for (int ht = 0; ht < kHeadTiles; ++ht) {
    run_top[ht][0] = run_top[ht][1] = -INFINITY;
    run_sum[ht][0] = run_sum[ht][1] = 0.0f;
  }
  for (int tile = 0; tile < tiles; ++tile) {
    issue(tile + kScoreTcStages - 1);
    CpAsyncWait<kScoreTcStages - 1>();
    __syncwarp();
    const int stage = tile % kScoreTcStages;
    const unsigned char* tile_rows = tile_of(stage);
    float acc[kHeadTiles][4] = {};
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t a[4];
      if constexpr (kFp8) {
        const unsigned char* codes = tile_rows + gq * Shape::kRowBytes + st * 16 + 4 * cq;
        const uint32_t upper = *reinterpret_cast<const uint32_t*>(codes);  // row gq
        const uint32_t lower = *reinterpret_cast<const uint32_t*>(codes + 8 * Shape::kRowBytes);
        a[0] = Fp8x2ToHalf2Bits(upper);
        a[1] = Fp8x2ToHalf2Bits(lower);
        a[2] = Fp8x2ToHalf2Bits(upper >> 16);
        a[3] = Fp8x2ToHalf2Bits(lower >> 16);
#pragma unroll
        for (int ht = 0; ht < kHeadTiles; ++ht) MmaF16(acc[ht], a, qb[ht][st][0], qb[ht][st][1]);
      } else {
        const Bf16* rows = reinterpret_cast<const Bf16*>(tile_rows);
        LdMatrixX4(a, rows + (lane & 15) * kPitch + st * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int ht = 0; ht < kHeadTiles; ++ht) MmaBf16(acc[ht], a, qb[ht][st][0], qb[ht][st][1]);
      }
    }
    // acc[ht]: (chunk gq, head 2cq), (gq, 2cq + 1), (gq + 8, 2cq), (gq + 8, 2cq + 1), heads
    // counted from 8 * ht.
    const int c0 = first + tile * kScoreTcTile;
    const unsigned char* flags = flags_of(stage);
#pragma unroll
    for (int ht = 0; ht < kHeadTiles; ++ht) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = 8 * ht + 2 * cq + (e & 1), r = gq + (e >> 1) * 8;
        if (head < kGroup && c0 + r < last) {
          const float scale = kFp8 ? scales_of(stage)[r] * p.scale : p.scale;
          const float x = flags[r] ? -INFINITY : acc[ht][e] * scale;
          logits[static_cast<int64_t>(head) * l.capacity_chunks + c0 + r] = x;
          SoftmaxAdd(x, &run_top[ht][e & 1], &run_sum[ht][e & 1]);
        }
      }
    }
    __syncwarp();  // this stage is refilled by the next iteration's issue
  }
  CpAsyncWait<0>();
  // The 8 lanes of one cq hold parts of the same heads' statistics.
#pragma unroll
  for (int ht = 0; ht < kHeadTiles; ++ht) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        const float top_b = __shfl_xor_sync(0xffffffffu, run_top[ht][j], offset);
        const float sum_b = __shfl_xor_sync(0xffffffffu, run_sum[ht][j], offset);
        SoftmaxMerge(top_b, sum_b, &run_top[ht][j], &run_sum[ht][j]);
      }
    }
  }
  if (gq == 0) {
#pragma unroll
    for (int ht = 0; ht < kHeadTiles; ++ht) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int head = 8 * ht + 2 * cq + j;
        if (head < kGroup) {
          float* partial = p.softmax_partials +
                           ((static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup + head) *
                               SkvScoreBlocks(l.capacity_chunks) * 2 +
                           part * 2;
          partial[0] = run_top[ht][j];
          partial[1] = run_sum[ht][j];
        }
      }
    }
  }
}

template <int kHeadDim, bool kFp8>
const void* ScoreTcKernelOf(int group) {
  switch (group) {
    case 1: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 1, kFp8>);
    case 2: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 2, kFp8>);
    case 3: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 3, kFp8>);
    case 4: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 4, kFp8>);
    case 5: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 5, kFp8>);
    case 6: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 6, kFp8>);
    case 7: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 7, kFp8>);
    case 8: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 8, kFp8>);
    case 16: return reinterpret_cast<const void*>(SkvScoreTcKernel<kHeadDim, 16, kFp8>);
    default: return nullptr;
  }
}

const void* ScoreTcKernel(int head_dim, int group, bool fp8) {
  if (head_dim == 256) return fp8 ? ScoreTcKernelOf<256, true>(group) : ScoreTcKernelOf<256, false>(group);
  if (head_dim == 96) return fp8 ? ScoreTcKernelOf<96, true>(group) : ScoreTcKernelOf<96, false>(group);
  if (head_dim == 128) return fp8 ? ScoreTcKernelOf<128, true>(group) : ScoreTcKernelOf<128, false>(group);
  if (head_dim == 64) return fp8 ? ScoreTcKernelOf<64, true>(group) : ScoreTcKernelOf<64, false>(group);
  return nullptr;
}

}  // namespace

cudaError_t SkvConfigureFastKernels(const SkvLayout& l, int64_t select_dynamic_bytes) {
  auto raise = [&](const void* kernel, int64_t bytes) {
    return AllowDynamicSharedMemory(kernel, static_cast<int>(bytes));
  };
  cudaError_t e = SkvConfigureSelectFast(l, select_dynamic_bytes);
  if (e != cudaSuccess) return e;
  const bool fp8 = l.fp8_landmarks != 0;
  // FP8 landmarks and groups above 8 query heads have the tensor-core scoring only.
  if ((fp8 || l.group > 8) && l.capacity_chunks % kScoreTcTile != 0) return cudaErrorInvalidValue;
  if (const void* score = ScoreTcKernel(l.head_dim, l.group, fp8)) {
    if ((e = raise(score, ScoreTcSharedBytes(l.head_dim, fp8))) != cudaSuccess) return e;
  }
  return SkvConfigureRebuildFast(l);
}

cudaError_t LaunchSkvScoreFast(const SkvDecodeParams& p, cudaStream_t stream) {
  const SkvLayout& l = p.layout;
  if (p.softmax_partials == nullptr) return cudaErrorInvalidValue;
  const bool fp8 = l.fp8_landmarks != 0;
  if (l.capacity_chunks % kScoreTcTile == 0) {
    const void* kernel = ScoreTcKernel(l.head_dim, l.group, fp8);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    const dim3 grid((SkvScoreBlocks(l.capacity_chunks) + kScoreTcWarps - 1) / kScoreTcWarps,
                    l.num_kv_heads, p.rows);
    SkvDecodeParams params = p;
    void* args[] = {&params};
    return cudaLaunchKernel(kernel, grid, dim3(kScoreTcWarps * 32), args,
                            static_cast<size_t>(ScoreTcSharedBytes(l.head_dim, fp8)), stream);
  }
  if (fp8) return cudaErrorInvalidValue;  // FP8 landmarks: the tensor-core scoring only
  const dim3 grid((l.capacity_chunks + kScoreChunksPerBlock - 1) / kScoreChunksPerBlock,
                  l.num_kv_heads, p.rows);
#define SKV_SCORE_CASE(D, G)                                         \
  if (l.head_dim == D && l.group == G) {                             \
    SkvScoreFastKernel<D, G><<<grid, kScoreThreads, 0, stream>>>(p); \
    return cudaGetLastError();                                       \
  }
  // clang-format off
  SKV_SCORE_CASE(128, 1) SKV_SCORE_CASE(128, 2) SKV_SCORE_CASE(128, 3) SKV_SCORE_CASE(128, 4)
  SKV_SCORE_CASE(128, 5) SKV_SCORE_CASE(128, 6) SKV_SCORE_CASE(128, 7) SKV_SCORE_CASE(128, 8)
  SKV_SCORE_CASE(64, 1) SKV_SCORE_CASE(64, 2) SKV_SCORE_CASE(64, 3) SKV_SCORE_CASE(64, 4)
  SKV_SCORE_CASE(64, 5) SKV_SCORE_CASE(64, 6) SKV_SCORE_CASE(64, 7) SKV_SCORE_CASE(64, 8)
#undef SKV_SCORE_CASE
  return cudaErrorInvalidValue;
  // clang-format on
}

}  // namespace shadowkv::cuda
