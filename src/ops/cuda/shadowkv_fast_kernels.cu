// ShadowKV decode kernels, second version (kSkvKernelsFast): landmark scoring with several
// landmark loads in flight per thread that also leaves each block's softmax statistics, a select
// kernel that combines those, reads the logits once and builds its radix histograms with
// warp-aggregated atomics (512 or 1024 threads, so a batch's blocks fit one wave). The key
// rebuild is in shadowkv_rebuild_fast.cu.
#include <cmath>
#include <cstdlib>
#include <cub/block/block_scan.cuh>

#include "ops/cuda/device_utils.cuh"
#include "ops/cuda/mma_utils.cuh"
#include "ops/cuda/shadowkv_fast_kernels.cuh"
#include "ops/cuda/shadowkv_fp8.cuh"
#include "ops/cuda/shadowkv_select.cuh"

namespace shadowkv::cuda {
namespace {

using Bf16 = __nv_bfloat16;

__device__ __forceinline__ int64_t HeadIndex(const SkvLayout& l, int seq, int layer, int head) {
  return (static_cast<int64_t>(seq) * l.num_layers + layer) * l.num_kv_heads + head;
}

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
  if (first >= m.num_chunks) return;
  const int lane = threadIdx.x % kLanes, sub = threadIdx.x / kLanes;
  float q[kGroup][8];
  const Bf16* q_row =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * kHeadDim;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    Bf16x8ToFloat(*reinterpret_cast<const uint4*>(q_row + g * kHeadDim + lane * 8), q[g]);
  }
  const int64_t head_index = HeadIndex(l, m.seq, p.layer, h);
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
  if (head_dim == 128) return fp8 ? ScoreTcShared<128, true>::kBytes : ScoreTcShared<128, false>::kBytes;
  return fp8 ? ScoreTcShared<64, true>::kBytes : ScoreTcShared<64, false>::kBytes;
}

// Scoring on the tensor cores: each warp owns kSkvScoreChunksPerBlock chunks of one (row, KV
// head) and streams them in 16-chunk tiles through a cp.async ring; one m16n8k16 product per
// 16 dimensions gives the tile's logits for all query heads of the group at once (the mma's N =
// 8 columns hold the group's heads, the rest zero). No cross-lane reduction per chunk, and the
// warp's softmax statistics come out of the same pass. Needs capacity_chunks % 16 == 0 (the
// outlier flags of a tile are one aligned 16-byte copy).
// FP8 landmarks (kFp8): the codes convert exactly to fp16 in registers and the product runs in
// fp16 with the query rounded to fp16 (saturated; bf16 values from 2^-14 to 65504 convert
// exactly); each logit is then multiplied by its landmark's scale. A lane loads 4 consecutive
// codes per row and step, dims 4c..4c+3 of the 16, and takes them as the mma's k = 2c, 2c+1,
// 2c+8, 2c+9; the query fragment is permuted the same way (a dot product ignores the order).
template <int kHeadDim, int kGroup, bool kFp8>
__global__ void __launch_bounds__(kScoreTcWarps * 32) SkvScoreTcKernel(SkvDecodeParams p) {
  static_assert(kGroup <= 8, "the mma's 8 columns hold the group's query heads");
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
  if (first >= m.num_chunks) return;  // whole warps only; the kernel has no block barrier
  const int last = min(first + kSkvScoreChunksPerBlock, m.num_chunks);
  const int tiles = (last - first + kScoreTcTile - 1) / kScoreTcTile;
  const int gq = lane / 4, cq = lane % 4;

  // B fragments (16 dims x 8 heads per step): column gq is query head gq.
  uint32_t qb[kSteps][2];
  const Bf16* q_row =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * kHeadDim;
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    qb[st][0] = qb[st][1] = 0u;
    if (gq < kGroup) {
      if constexpr (kFp8) {
        const Bf16* q = q_row + gq * kHeadDim + st * 16 + 4 * cq;
        const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(q));
        const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(q + 2));
        qb[st][0] = PackHalf2Saturated(low.x, low.y);
        qb[st][1] = PackHalf2Saturated(high.x, high.y);
      } else {
        const Bf16* q = q_row + gq * kHeadDim + st * 16 + 2 * cq;
        qb[st][0] = *reinterpret_cast<const uint32_t*>(q);
        qb[st][1] = *reinterpret_cast<const uint32_t*>(q + 8);
      }
    }
  }
  const int64_t head_index = HeadIndex(l, m.seq, p.layer, h);
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

  float run_top[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // heads 2cq, 2cq + 1
  for (int tile = 0; tile < tiles; ++tile) {
    issue(tile + kScoreTcStages - 1);
    CpAsyncWait<kScoreTcStages - 1>();
    __syncwarp();
    const int stage = tile % kScoreTcStages;
    const unsigned char* tile_rows = tile_of(stage);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
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
        MmaF16(acc, a, qb[st][0], qb[st][1]);
      } else {
        const Bf16* rows = reinterpret_cast<const Bf16*>(tile_rows);
        LdMatrixX4(a, rows + (lane & 15) * kPitch + st * 16 + (lane >> 4) * 8);
        MmaBf16(acc, a, qb[st][0], qb[st][1]);
      }
    }
    // acc: (chunk gq, head 2cq), (gq, 2cq + 1), (gq + 8, 2cq), (gq + 8, 2cq + 1).
    const int c0 = first + tile * kScoreTcTile;
    const unsigned char* flags = flags_of(stage);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * cq + (e & 1), r = gq + (e >> 1) * 8;
      if (head < kGroup && c0 + r < last) {
        const float scale = kFp8 ? scales_of(stage)[r] * p.scale : p.scale;
        const float x = flags[r] ? -INFINITY : acc[e] * scale;
        logits[static_cast<int64_t>(head) * l.capacity_chunks + c0 + r] = x;
        SoftmaxAdd(x, &run_top[e & 1], &run_sum[e & 1]);
      }
    }
    __syncwarp();  // this stage is refilled by the next iteration's issue
  }
  CpAsyncWait<0>();
  // The 8 lanes of one cq hold parts of the same two heads' statistics.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
      const float top_b = __shfl_xor_sync(0xffffffffu, run_top[j], offset);
      const float sum_b = __shfl_xor_sync(0xffffffffu, run_sum[j], offset);
      SoftmaxMerge(top_b, sum_b, &run_top[j], &run_sum[j]);
    }
  }
  if (gq == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int head = 2 * cq + j;
      if (head < kGroup) {
        float* partial = p.softmax_partials +
                         ((static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup + head) *
                             SkvScoreBlocks(l.capacity_chunks) * 2 +
                         part * 2;
        partial[0] = run_top[j];
        partial[1] = run_sum[j];
      }
    }
  }
}

// ---- selection --------------------------------------------------------------------------------

// Logits in flight per select thread: 8 (kSelectUnroll chunks of all kGroup query heads), which
// the select's 32 registers (two or more blocks of 1024 or 512 threads per SM) hold unspilled.
template <int kGroup>
constexpr int kSelectUnroll = kGroup >= 8 ? 1 : 8 / kGroup;

// Max (or sum) over the block of kGroup values at once; every thread gets the results.
// `scratch` holds 32·kGroup floats; the call contains barriers. Blocks of fewer than 32 warps
// leave part of `scratch` unwritten: those entries count as the identity.
template <int kGroup, bool kMax>
__device__ __forceinline__ void BlockReduceGroup(float (&value)[kGroup], float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, value[g], offset);
      value[g] = kMax ? fmaxf(value[g], other) : value[g] + other;
    }
  }
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) scratch[g * 32 + warp] = value[g];
  }
  __syncthreads();
  const bool written = lane < static_cast<int>(blockDim.x >> 5);
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    value[g] = written ? scratch[g * 32 + lane] : (kMax ? -INFINITY : 0.0f);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, value[g], offset);
      value[g] = kMax ? fmaxf(value[g], other) : value[g] + other;
    }
  }
}

// The select kernels' first part, for the block's (row, KV head): the softmax of every query
// head from the scoring blocks' statistics, then each chunk's radix key into keys[0, n): 0 = not
// selectable, else the group max's bits + 1 (ordered like the score). Every thread of the block
// calls visit(key) for kSelectUnroll<kGroup> keys at a time, all lanes together (0 past n), as
// they are written. Returns the number of selectable chunks; ends with a barrier.
template <int kGroup, int kThreads, typename Visit>
__device__ __forceinline__ int WriteSelectKeys(const SkvDecodeParams& p, int row, int h, int n,
                                               uint32_t* keys, float* reduce, Visit&& visit) {
  const SkvLayout& l = p.layout;
  const int tid = threadIdx.x;
  const float* logits =
      p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * l.capacity_chunks;
  const int parts = SkvScoreBlocks(n), part_stride = SkvScoreBlocks(l.capacity_chunks);
  const float* partials = p.softmax_partials +
                          (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * part_stride * 2;
  float top[kGroup], sum[kGroup], part_top[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    part_top[g] = tid < parts ? partials[(g * part_stride + tid) * 2] : -INFINITY;
    top[g] = part_top[g];
  }
  BlockReduceGroup<kGroup, true>(top, reduce);
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    sum[g] = part_top[g] == -INFINITY
                 ? 0.0f
                 : partials[(g * part_stride + tid) * 2 + 1] * expf(part_top[g] - top[g]);
  }
  BlockReduceGroup<kGroup, false>(sum, reduce);
  float inv[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) inv[g] = 1.0f / sum[g];
  int selectable_local = 0;
  constexpr int kUnroll = kSelectUnroll<kGroup>;
  for (int base = 0; base < n; base += kThreads * kUnroll) {
    float x[kUnroll][kGroup];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * kThreads + tid;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) x[u][g] = c < n ? logits[g * l.capacity_chunks + c] : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * kThreads + tid;
      float score = 0.0f;
      const bool live = x[u][0] != -INFINITY;  // query head 0's logit marks outliers
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (x[u][g] != -INFINITY) score = fmaxf(score, expf(x[u][g] - top[g]) * inv[g]);
      }
      const uint32_t key = c < n && live ? __float_as_uint(score) + 1u : 0u;
      if (c < n) {
        keys[c] = key;
        selectable_local += live;
      }
      visit(key);
    }
  }
  return static_cast<int>(BlockSum(static_cast<float>(selectable_local), reduce));
}

// key[c] = max(key[c], key[c - 1]) where both chunks are selectable, in place: each thread owns
// a contiguous range and reads the key before it first. Needs the keys visible (a barrier after
// they were written); ends with a barrier.
template <int kThreads>
__device__ __forceinline__ void KeepSuccessors(uint32_t* keys, int n) {
  const int span = (n + kThreads - 1) / kThreads;
  const int begin = min(n, static_cast<int>(threadIdx.x) * span), end = min(n, begin + span);
  uint32_t before = begin > 0 && begin < end ? keys[begin - 1] : 0u;
  __syncthreads();
  for (int c = begin; c < end; ++c) {
    const uint32_t own = keys[c];
    if (own != 0u && before != 0u) keys[c] = max(own, before);
    before = own;
  }
  __syncthreads();
}

// One 8-bit radix digit at `shift` of the k-th largest key: counts the keys of source[0, count)
// that are non-zero and equal `*prefix_shared` under `mask`, then narrows `*prefix_shared` to the
// chosen bin and `*remaining_shared` to the rank within it. Scores share few exponents, so most
// keys fall in a handful of bins: lanes with the same bin add once per warp. Contains barriers;
// the last one makes the results visible.
template <int kThreads>
__device__ __forceinline__ void RadixDigit(const uint32_t* source, int count, int shift,
                                           uint32_t mask, int* histogram,
                                           uint32_t* prefix_shared, int* remaining_shared) {
  const int tid = threadIdx.x, lane = tid & 31;
  for (int b = tid; b < 256; b += kThreads) histogram[b] = 0;
  __syncthreads();
  const uint32_t prefix = *prefix_shared;
  for (int base = 0; base < count; base += kThreads) {
    const int c = base + tid;
    const uint32_t key = c < count ? source[c] : 0u;
    const bool counted = key != 0u && (key & mask) == prefix;
    const uint32_t bin = counted ? (key >> shift) & 255u : 256u;
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (counted && lane == __ffs(peers) - 1) atomicAdd(&histogram[bin], __popc(peers));
  }
  __syncthreads();
  if (tid < 32) {
    // Lane L owns bins [8L, 8L + 8); `above` = keys in higher lanes' bins. The chosen bin is the
    // highest whose count from the top reaches `remaining`.
    const int remaining = *remaining_shared;
    int own = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) own += histogram[lane * 8 + b];
    int from_here = own;  // keys in bins >= 8L
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_down_sync(0xffffffffu, from_here, offset);
      if (lane + offset < 32) from_here += other;
    }
    const unsigned reach = __ballot_sync(0xffffffffu, from_here >= remaining);
    const int chosen = reach ? 31 - __clz(reach) : 0;
    if (lane == chosen) {
      int above = from_here - own, bin = lane * 8 + 7;
      for (; bin > lane * 8; --bin) {
        if (above + histogram[bin] >= remaining) break;
        above += histogram[bin];
      }
      *remaining_shared = remaining - above;
      *prefix_shared = prefix | (static_cast<uint32_t>(bin) << shift);
    }
  }
  __syncthreads();
}

// The first digit of the coarse select: a key's top 12 bits (sign, exponent, 3 mantissa bits).
constexpr int kCoarseShift = 20;
constexpr int kCoarseBins = 1 << (32 - kCoarseShift);

// One block per (KV head, row), the same contract and shared layout as the first select kernel;
// kThreads >= max_budget (one thread per gather slot). The k-th largest key is found by radix
// select. kCoarse: the first digit is 12 bits wide, counted while the keys are written (or in
// one pass after the successor rule), and the later digits run over that digit's candidates
// only, gathered into the histogram's shared words (all keys when they are more); the selected
// chunks are then placed with warp ballots over warp-contiguous ranges (conflict-free). Else
// four 8-bit digits over every key and a thread-contiguous placement (kept to compare).
template <int kGroup, int kThreads, bool kCoarse, int kMinBlocks = 2048 / kThreads>
__global__ void __launch_bounds__(kThreads, kMinBlocks) SkvSelectFastKernel(SkvDecodeParams p) {
  using SelectScan = cub::BlockScan<int, kThreads>;
  constexpr int kWarps = kThreads / 32;
  constexpr int kCoarseWords = kCoarse ? kCoarseBins : 1;
  extern __shared__ uint32_t shared_words[];
  __shared__ typename SelectScan::TempStorage scan_storage;
  __shared__ float reduce[32 * kGroup];
  __shared__ int histogram[256];
  __shared__ uint32_t coarse_words[kCoarseWords];  // the first digit's bins, then its candidates
  __shared__ int warp_counts[2][kWarps];
  __shared__ uint32_t prefix_shared;
  __shared__ int remaining_shared, chosen_shared, gathered_shared;

  const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const SkvRowMeta m = p.meta[row];
  const SkvLayout& l = p.layout;
  const SkvSequenceInfo info = l.info[m.seq];
  const int n = m.num_chunks;
  const int words = (l.capacity_chunks + 31) / 32;
  uint32_t* keys = shared_words;
  uint32_t* wanted = keys + l.capacity_chunks;
  int* selected = reinterpret_cast<int*>(wanted + words);
  int* free_slots = selected + l.max_budget;
  int32_t* miss = p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  int32_t* slot_chunk = l.slot_chunk + HeadIndex(l, m.seq, p.layer, h) * l.max_budget;
  for (int w = tid; w < words; w += kThreads) wanted[w] = 0;
  for (int s = tid; s < l.max_budget; s += kThreads) miss[s] = -1;
  int* coarse = reinterpret_cast<int*>(coarse_words);
  if constexpr (kCoarse) {
    for (int b = tid; b < kCoarseBins; b += kThreads) coarse[b] = 0;  // WriteSelectKeys syncs first
  }
  // Adds a warp's keys to the first digit's bins (every lane calls it; 0 counts nowhere).
  auto count_coarse = [&](uint32_t key) {
    const uint32_t bin = key != 0u ? key >> kCoarseShift : kCoarseBins;
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (key != 0u && lane == __ffs(peers) - 1) atomicAdd(&coarse[bin], __popc(peers));
  };
  const bool count_while_writing = kCoarse && !p.select_successors;
  const int selectable = WriteSelectKeys<kGroup, kThreads>(p, row, h, n, keys, reduce, [&](uint32_t key) {
    if (count_while_writing) count_coarse(key);
  });
  const int k = min(info.budget_chunks, selectable);
  if (p.select_successors) KeepSuccessors<kThreads>(keys, n);
  if (tid == 0) {
    prefix_shared = 0;
    remaining_shared = k;
  }

  uint32_t mask = 0;
  if constexpr (kCoarse) {
    if (!count_while_writing) {
      for (int base = 0; base < n; base += kThreads) count_coarse(base + tid < n ? keys[base + tid] : 0u);
    }
    __syncthreads();
    // The first digit: thread t owns bins [t·B, t·B + B); the chosen bin has fewer than k keys
    // above it and at least k from it up.
    constexpr int kOwnBins = kCoarseBins / kThreads;
    int bins[kOwnBins], own = 0;
#pragma unroll
    for (int j = 0; j < kOwnBins; ++j) {
      bins[j] = coarse[tid * kOwnBins + j];
      own += bins[j];
    }
    int below = 0, total = 0;
    SelectScan(scan_storage).ExclusiveSum(own, below, total);
    int from_here = total - below;  // keys in bins >= the current one
#pragma unroll
    for (int j = 0; j < kOwnBins; ++j) {
      const int above = from_here - bins[j];
      if (k > 0 && above < k && k <= from_here) {
        prefix_shared = static_cast<uint32_t>(tid * kOwnBins + j) << kCoarseShift;
        remaining_shared = k - above;
        chosen_shared = bins[j];
      }
      from_here = above;
    }
    if (tid == 0) gathered_shared = 0;
    __syncthreads();  // every bin has been read: the words now take the candidates
    mask = ~0u << kCoarseShift;
    const uint32_t coarse_prefix = prefix_shared;
    const int chosen = k > 0 ? chosen_shared : 0;
    const bool gather = chosen <= kCoarseBins;
    if (k > 0 && gather) {
      for (int base = 0; base < n; base += kThreads) {
        const int c = base + tid;
        const uint32_t key = c < n ? keys[c] : 0u;
        const bool candidate = key != 0u && (key & mask) == coarse_prefix;
        const unsigned ballot = __ballot_sync(0xffffffffu, candidate);
        if (ballot == 0u) continue;
        int at = 0;
        if (lane == 0) at = atomicAdd(&gathered_shared, __popc(ballot));
        at = __shfl_sync(0xffffffffu, at, 0);
        if (candidate) coarse_words[at + __popc(ballot & ((1u << lane) - 1u))] = key;
      }
      __syncthreads();
    }
    const uint32_t* source = gather ? coarse_words : keys;
    const int count = gather ? chosen : n;
    // Bits 19..12, 11..4, then 7..0 (7..4 already fixed, so only their bins are filled).
    constexpr int kShifts[3] = {12, 4, 0};
#pragma unroll
    for (int d = 0; d < 3 && k > 0; ++d) {
      const int shift = kShifts[d];
      RadixDigit<kThreads>(source, count, shift, mask, histogram, &prefix_shared, &remaining_shared);
      mask |= 255u << shift;
    }
  } else {
    __syncthreads();
    for (int shift = 24; shift >= 0 && k > 0; shift -= 8) {
      RadixDigit<kThreads>(keys, n, shift, mask, histogram, &prefix_shared, &remaining_shared);
      mask |= 255u << shift;
    }
  }
  const uint32_t threshold = prefix_shared;
  const int ties_allowed = remaining_shared;

  // The selected chunks in index order: every key above the threshold and the first
  // ties_allowed keys equal to it.
  if constexpr (kCoarse) {
    // Warp w owns [w·span, w·span + span), span a multiple of 32: lane L reads chunk base + L,
    // and one ballot per 32 chunks gives both the places and the word of `wanted`.
    const int span = (n + kThreads - 1) / kThreads * 32;
    const int begin = min(n, warp * span), end = min(n, begin + span);
    int above_count = 0, tie_count = 0;
    if (k > 0) {
      for (int c = begin + lane; c < end; c += 32) {
        const uint32_t key = keys[c];
        above_count += key != 0u && key > threshold;
        tie_count += key != 0u && key == threshold;
      }
    }
    above_count = static_cast<int>(__reduce_add_sync(0xffffffffu, above_count));
    tie_count = static_cast<int>(__reduce_add_sync(0xffffffffu, tie_count));
    if (lane == 0) {
      warp_counts[0][warp] = above_count;
      warp_counts[1][warp] = tie_count;
    }
    __syncthreads();
    int above_before = lane < warp ? warp_counts[0][lane] : 0;
    int ties_before = lane < warp ? warp_counts[1][lane] : 0;
    above_before = static_cast<int>(__reduce_add_sync(0xffffffffu, above_before));
    ties_before = static_cast<int>(__reduce_add_sync(0xffffffffu, ties_before));
    if (k > 0) {
      const unsigned lower = (1u << lane) - 1u;
      int taken = above_before + min(ties_before, ties_allowed), ties_seen = ties_before;
      for (int base = begin; base < end; base += 32) {
        const int c = base + lane;
        const uint32_t key = c < end ? keys[c] : 0u;
        const bool tie = key != 0u && key == threshold;
        const unsigned ties = __ballot_sync(0xffffffffu, tie);
        const bool take = (key != 0u && key > threshold) ||
                          (tie && ties_seen + __popc(ties & lower) < ties_allowed);
        const unsigned takes = __ballot_sync(0xffffffffu, take);
        if (take) selected[taken + __popc(takes & lower)] = c;
        if (lane == 0) wanted[base >> 5] = takes;
        taken += __popc(takes);
        ties_seen += __popc(ties);
      }
    }
  } else {
    // Each thread owns a contiguous range, so one scan places all.
    const int per_thread = (n + kThreads - 1) / kThreads;
    const int begin = min(n, tid * per_thread), end = min(n, begin + per_thread);
    int above_count = 0, tie_count = 0;
    if (k > 0) {
      for (int c = begin; c < end; ++c) {
        const uint32_t key = keys[c];
        above_count += key != 0u && key > threshold;
        tie_count += key != 0u && key == threshold;
      }
    }
    int packed_before = 0, packed_total = 0;  // above | ties << 16 (capacity < 32768 chunks)
    SelectScan(scan_storage)
        .ExclusiveSum(above_count | (tie_count << 16), packed_before, packed_total);
    if (k > 0) {
      int ties_seen = packed_before >> 16;
      int at = (packed_before & 0xffff) + min(ties_seen, ties_allowed);
      for (int c = begin; c < end; ++c) {
        const uint32_t key = keys[c];
        bool take = key != 0u && key > threshold;
        if (key != 0u && key == threshold) take = ties_seen++ < ties_allowed;
        if (take) {
          selected[at++] = c;
          atomicOr(&wanted[c >> 5], 1u << (c & 31));
        }
      }
    }
  }
  __syncthreads();

  AssignGatherSlots<SelectScan>(scan_storage, info.budget_chunks, k, n, selected, wanted, free_slots,
                               slot_chunk, miss, l.counters);
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
    default: return nullptr;
  }
}

const void* ScoreTcKernel(int head_dim, int group, bool fp8) {
  if (head_dim == 128) return fp8 ? ScoreTcKernelOf<128, true>(group) : ScoreTcKernelOf<128, false>(group);
  if (head_dim == 64) return fp8 ? ScoreTcKernelOf<64, true>(group) : ScoreTcKernelOf<64, false>(group);
  return nullptr;
}

// The roomy select (the coarse one's default; SkvDecodeParams::select_registers = 32 turns it
// off): 512 threads with 64 registers each, two blocks per SM, at any length; it needs a thread
// per gather slot. The 32-register forms spill (252 bytes a thread at 1024 threads); in a split
// step its half-size blocks also leave more of each SM to the other half's scoring.
bool SelectRoomy(const SkvLayout& l, bool coarse, int registers) {
  return coarse && registers != 32 && l.max_budget <= 512;
}

// 512 threads while the budget allows (two or more blocks per SM, so a batch's (row, KV head)
// blocks run in one wave), 1024 for long contexts (more chunks per block) or large budgets; both
// with 32 registers a thread. Roomy: 512.
int SelectThreads(const SkvLayout& l, bool roomy) {
  return roomy || (l.max_budget <= 512 && l.capacity_chunks <= 8192) ? 512 : 1024;
}

template <int kThreads, bool kCoarse, int kMinBlocks = 2048 / kThreads>
const void* SelectFastKernelOf(int group) {
  switch (group) {
    case 1: return reinterpret_cast<const void*>(SkvSelectFastKernel<1, kThreads, kCoarse, kMinBlocks>);
    case 2: return reinterpret_cast<const void*>(SkvSelectFastKernel<2, kThreads, kCoarse, kMinBlocks>);
    case 3: return reinterpret_cast<const void*>(SkvSelectFastKernel<3, kThreads, kCoarse, kMinBlocks>);
    case 4: return reinterpret_cast<const void*>(SkvSelectFastKernel<4, kThreads, kCoarse, kMinBlocks>);
    case 5: return reinterpret_cast<const void*>(SkvSelectFastKernel<5, kThreads, kCoarse, kMinBlocks>);
    case 6: return reinterpret_cast<const void*>(SkvSelectFastKernel<6, kThreads, kCoarse, kMinBlocks>);
    case 7: return reinterpret_cast<const void*>(SkvSelectFastKernel<7, kThreads, kCoarse, kMinBlocks>);
    case 8: return reinterpret_cast<const void*>(SkvSelectFastKernel<8, kThreads, kCoarse, kMinBlocks>);
    default: return nullptr;
  }
}

const void* SelectFastKernel(const SkvLayout& l, bool coarse, bool roomy) {
  if (roomy) return SelectFastKernelOf<512, true, 2>(l.group);
  if (SelectThreads(l, false) == 512) {
    return coarse ? SelectFastKernelOf<512, true>(l.group) : SelectFastKernelOf<512, false>(l.group);
  }
  return coarse ? SelectFastKernelOf<1024, true>(l.group) : SelectFastKernelOf<1024, false>(l.group);
}

}  // namespace

cudaError_t SkvConfigureFastKernels(const SkvLayout& l, int64_t select_dynamic_bytes) {
  if (l.capacity_chunks >= 32768) return cudaErrorInvalidValue;  // packed scan counts
  auto raise = [&](const void* kernel, int64_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(bytes));
  };
  cudaError_t e = cudaSuccess;
  for (bool coarse : {false, true}) {
    for (bool roomy : {false, true}) {
      if (roomy && !SelectRoomy(l, coarse, 0)) continue;
      if (const void* select = SelectFastKernel(l, coarse, roomy)) {
        if ((e = raise(select, select_dynamic_bytes)) != cudaSuccess) return e;
      }
    }
  }
  const bool fp8 = l.fp8_landmarks != 0;
  if (fp8 && l.capacity_chunks % kScoreTcTile != 0) return cudaErrorInvalidValue;
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

cudaError_t LaunchSkvSelectFast(const SkvDecodeParams& p, int64_t dynamic_bytes,
                                cudaStream_t stream) {
  const SkvLayout& l = p.layout;
  if (p.softmax_partials == nullptr) return cudaErrorInvalidValue;
  const bool roomy = SelectRoomy(l, p.coarse_select != 0, p.select_registers);
  const void* kernel = SelectFastKernel(l, p.coarse_select != 0, roomy);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  SkvDecodeParams params = p;
  void* args[] = {&params};
  return cudaLaunchKernel(kernel, dim3(l.num_kv_heads, p.rows), dim3(SelectThreads(l, roomy)),
                          args, static_cast<size_t>(dynamic_bytes), stream);
}

}  // namespace shadowkv::cuda
