// ShadowKV kernels. Decode, per layer: graduate (+ shift) → score → select (→ re-rank) → fetch
// values and rebuild keys (misses only; with exact keys the fetch copies both) → the ordinary
// split decode kernel over the attention buffer. (The compression kernels are in compress.cu.)
// Every grid is sized from the capacities, never from this step's counts, so a decode step can
// be captured once as a CUDA graph; blocks with nothing to do return at once.
#include <algorithm>
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/common/mma_utils.cuh"
#include "ops/cuda/shadowkv/gather_slots.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"
#include "ops/cuda/shadowkv/shadowkv_fp8.cuh"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {
namespace {

using Bf16 = __nv_bfloat16;

__device__ __forceinline__ int64_t LayerIndex(const SkvLayout& l, int seq, int layer) {
  return static_cast<int64_t>(seq) * l.num_layers + layer;
}

// ---- graduation -------------------------------------------------------------------------------

constexpr int kGraduateThreads = 256;

constexpr int kGraduateBasisRows = 16;  // rank outputs per block of the A-row kernel

// The graduation kernels run once per step for every layer (blockIdx.z), before the first
// layer's QKV kernel appends the step's token: the chunk that leaves holds only earlier tokens
// (the window keeps local_window >= 1 of them, MakeSkvGeometry), so one launch of each serves
// all layers, and a step on which a few rows graduate costs three launches, not three per layer.

// A rows of each graduating chunk, a = k_pre · Bᵀ (B has orthonormal rows): one block per (row,
// kGraduateBasisRows of the rank, layer), its warps one basis row at a time, each lane 8 dims of
// every 256 against all C tokens, then a warp sum per token. Shared: the chunk's pre-RoPE keys
// [C, kv_width] as fp32 (kv_width a multiple of 8).
__global__ void __launch_bounds__(kGraduateThreads) SkvGraduateCoefficientsKernel(SkvDecodeParams p) {
  extern __shared__ float pre_rows[];
  const SkvRowMeta m = p.meta[blockIdx.x];
  if (m.graduate_chunk < 0) return;
  const SkvLayout& l = p.layout;
  const int layer = blockIdx.z;
  const int width = l.kv_width(), chunk = l.chunk_size;
  const int64_t layer_index = LayerIndex(l, m.seq, layer);
  Bf16* coefficients =
      l.coefficients + (layer_index * l.capacity_chunks + m.graduate_chunk) * chunk * l.rank;
  // Past the layer's own rank (a per-layer rank) the coefficients are zeros, as B's rows there
  // are: written, not computed, so that the row never keeps what an earlier sequence left.
  const int rank = l.RankOf(m.seq, layer);
  const int first = blockIdx.y * kGraduateBasisRows;
  const int last = min(l.rank, first + kGraduateBasisRows), own_last = min(last, rank);
  const int zero_from = max(first, own_last), zeros = last - zero_from;
  for (int i = threadIdx.x; i < chunk * zeros; i += blockDim.x) {
    coefficients[(i / zeros) * l.rank + zero_from + i % zeros] = __float2bfloat16(0.0f);
  }
  if (first >= own_last) return;
  const Bf16* pre = l.keys_pre + layer_index * l.recent_capacity * width;
  for (int i = threadIdx.x; i < chunk * width; i += blockDim.x) pre_rows[i] = __bfloat162float(pre[i]);
  __syncthreads();
  const Bf16* basis = l.basis + layer_index * l.rank * width;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = first + warp; j < own_last; j += kGraduateThreads / 32) {
    const Bf16* b = basis + static_cast<int64_t>(j) * width;
    float dot[kSkvMaxGraduateChunk] = {};
    for (int k = lane * 8; k < width; k += 256) {
      float bv[8];
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(b + k), bv);
#pragma unroll
      for (int t = 0; t < kSkvMaxGraduateChunk; ++t) {
        if (t < chunk) {
          const float* x = pre_rows + t * width + k;
#pragma unroll
          for (int i = 0; i < 8; ++i) dot[t] = fmaf(x[i], bv[i], dot[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kSkvMaxGraduateChunk; ++t) {
      if (t >= chunk) break;
      const float sum = WarpSum(dot[t]);
      if (lane == 0) coefficients[t * l.rank + j] = __float2bfloat16(sum);
    }
  }
}

// One block per (row, layer): landmark, values (and exact keys) to the store, outlier flag (and
// under FP8 the quantised runs and landmark). Shared (FP8 landmarks only): the means [kv_heads,
// d] as fp32.
__global__ void __launch_bounds__(kGraduateThreads) SkvGraduateKernel(SkvDecodeParams p) {
  extern __shared__ float means[];
  const SkvRowMeta m = p.meta[blockIdx.x];
  if (m.graduate_chunk < 0) return;
  const SkvLayout& l = p.layout;
  const int layer = blockIdx.z;
  const int chunk = l.chunk_size, d = l.head_dim;
  const SkvSequenceInfo info = l.info[m.seq];
  // Landmark (mean post-RoPE key), values to the store, and the chunk joins the landmark set.
  for (int index = threadIdx.x; index < l.num_kv_heads * d; index += blockDim.x) {
    const int h = index / d, e = index % d;
    const int64_t head_offset = l.attn.HeadOffset(m.seq, layer, h);
    const Bf16* keys = l.attn.keys + head_offset + static_cast<int64_t>(info.recent_base) * d;
    const Bf16* values = l.attn.values + head_offset + static_cast<int64_t>(info.recent_base) * d;
    float sum = 0.0f;
    for (int t = 0; t < chunk; ++t) sum += __bfloat162float(keys[t * d + e]);
    if (!l.fp8_values) {
      Bf16* store = l.values[m.seq] + l.RunIndex(layer, h, m.graduate_chunk) * chunk * d;
      for (int t = 0; t < chunk; ++t) store[t * d + e] = values[t * d + e];
    }
    if (l.exact_keys && !l.fp8_keys) {
      Bf16* store = l.KeyRun(m.seq, layer, h, m.graduate_chunk);
      for (int t = 0; t < chunk; ++t) store[t * d + e] = keys[t * d + e];
    }
    const float mean = sum / static_cast<float>(chunk);
    const int64_t head_index = l.HeadIndex(m.seq, layer, h);
    if (l.fp8_landmarks) {
      means[index] = mean;
    } else {
      l.landmarks[(head_index * l.capacity_chunks + m.graduate_chunk) * d + e] =
          __float2bfloat16(mean);
    }
    if (e == 0) l.outlier[head_index * l.capacity_chunks + m.graduate_chunk] = 0;
  }
  if (!l.fp8_values && !l.fp8_landmarks && !l.fp8_keys) return;
  __syncthreads();
  // FP8: one warp per KV head quantises the chunk's values, its landmark and its keys.
  for (int h = threadIdx.x / 32; h < l.num_kv_heads; h += blockDim.x / 32) {
    const int64_t recent = l.attn.HeadOffset(m.seq, layer, h) +
                           static_cast<int64_t>(info.recent_base) * d;
    if (l.fp8_values) {
      const Bf16* values = l.attn.values + recent;
      WarpQuantizeFp8Run([&](int i) { return __bfloat162float(values[i]); }, chunk * d,
                         l.ValueCodes(m.seq, layer, h, m.graduate_chunk),
                         l.ValueScale(m.seq, layer, h, m.graduate_chunk));
    }
    const int64_t landmark = l.ChunkIndex(m.seq, layer, h, m.graduate_chunk);
    if (l.fp8_landmarks) {
      WarpQuantizeFp8Run([&](int i) { return means[h * d + i]; }, d,
                         l.landmark_codes + landmark * d, l.landmark_scales + landmark);
      __syncwarp();  // the key codes below are made against the landmark as stored
    }
    if (l.fp8_keys) {  // each key less the chunk's landmark
      const Bf16* keys = l.attn.keys + recent;
      WarpQuantizeFp8Run(
          [&](int i) { return __bfloat162float(keys[i]) - SkvLandmarkElement(l, landmark, i % d); },
          chunk * d, l.KeyCodes(m.seq, layer, h, m.graduate_chunk),
          l.KeyScale(m.seq, layer, h, m.graduate_chunk));
    }
  }
}

// One block per (row, KV head, layer): exact rows [C, held_rows) move to [0, held_rows − C), for
// post-RoPE K, V and this head's slice of the pre-RoPE keys. Everything is read before anything
// is written (the ranges overlap).
__global__ void __launch_bounds__(kGraduateThreads) SkvShiftKernel(SkvDecodeParams p) {
  extern __shared__ Bf16 staged[];
  const SkvRowMeta m = p.meta[blockIdx.x];
  if (m.graduate_chunk < 0) return;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, layer = blockIdx.z, d = l.head_dim, chunk = l.chunk_size;
  const int width = l.kv_width(), kept = m.held_rows - chunk;
  const SkvSequenceInfo info = l.info[m.seq];
  const int64_t head_offset =
      l.attn.HeadOffset(m.seq, layer, h) + static_cast<int64_t>(info.recent_base) * d;
  Bf16* keys = l.attn.keys + head_offset;
  Bf16* values = l.attn.values + head_offset;
  Bf16* pre = l.keys_pre + LayerIndex(l, m.seq, layer) * l.recent_capacity * width + h * d;
  const int count = kept * d;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int t = i / d, e = i % d;
    staged[i] = keys[(t + chunk) * d + e];
    staged[count + i] = values[(t + chunk) * d + e];
    staged[2 * count + i] = pre[static_cast<int64_t>(t + chunk) * width + e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int t = i / d, e = i % d;
    keys[t * d + e] = staged[i];
    values[t * d + e] = staged[count + i];
    pre[static_cast<int64_t>(t) * width + e] = staged[2 * count + i];
  }
}

// ---- scoring ----------------------------------------------------------------------------------

constexpr int kScoreThreads = 256;
constexpr int kScoreChunksPerBlock = 256;

// Block: kScoreChunksPerBlock chunks of one (row, KV head). head_dim/8 lanes per chunk, each
// with one 16-byte slice of the landmark and the same slice of every query of the group.
template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kScoreThreads) SkvScoreKernel(SkvDecodeParams p) {
  constexpr int kLanes = kHeadDim / 8;
  constexpr int kChunksPerPass = kScoreThreads / kLanes;
  const int row = blockIdx.z, h = blockIdx.y;
  const SkvRowMeta m = p.meta[row];
  const SkvLayout& l = p.layout;
  const int first = blockIdx.x * kScoreChunksPerBlock;
  // No selection at this step (reuse or drift).
  if (first >= m.num_chunks || SkvKeepsChunks(p, m, row, h)) return;
  const int lane = threadIdx.x % kLanes, sub = threadIdx.x / kLanes;
  float q[kGroup][8];
  const Bf16* q_row = p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup * kHeadDim;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    Bf16x8ToFloat(*reinterpret_cast<const uint4*>(q_row + g * kHeadDim + lane * 8), q[g]);
  }
  const int64_t head_index = l.HeadIndex(m.seq, p.layer, h);
  const Bf16* landmarks = l.landmarks + head_index * l.capacity_chunks * kHeadDim;
  const uint8_t* outlier = l.outlier + head_index * l.capacity_chunks;
  float* logits = p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * kGroup *
                                 l.capacity_chunks;
  const int last = min(first + kScoreChunksPerBlock, m.num_chunks);
  for (int base = first; base < last; base += kChunksPerPass) {
    const int c = base + sub;
    const bool live = c < last && !outlier[c];
    float k[8];
    if (live) {
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(landmarks + static_cast<int64_t>(c) * kHeadDim +
                                                    lane * 8),
                    k);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) k[i] = 0.0f;
    }
    float dots[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = fmaf(q[g][i], k[i], dot);
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      }
      dots[g] = dot;
    }
    if (c < last && lane < kGroup) {
      float mine = dots[0];
#pragma unroll
      for (int g = 1; g < kGroup; ++g) {
        if (lane == g) mine = dots[g];
      }
      logits[static_cast<int64_t>(lane) * l.capacity_chunks + c] =
          live ? mine * p.scale : -INFINITY;
    }
  }
}

// ---- selection --------------------------------------------------------------------------------

constexpr int kSelectThreads = 1024;
using SelectScan = cub::BlockScan<int, kSelectThreads>;

// One block per (KV head, row). Shared: one 32-bit key per chunk (0: not selectable; else the
// score's bits + 1, which orders like the score), the wanted bitmap, the selected list and the
// free slots.
__global__ void __launch_bounds__(kSelectThreads) SkvSelectKernel(SkvDecodeParams p) {
  extern __shared__ uint32_t shared_words[];
  __shared__ typename SelectScan::TempStorage scan_storage;
  __shared__ float reduce[32];
  __shared__ int histogram[256];
  __shared__ uint32_t prefix_shared;
  __shared__ int remaining_shared;

  const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
  const SkvRowMeta m = p.meta[row];
  const SkvLayout& l = p.layout;
  const SkvSequenceInfo info = l.info[m.seq];
  const int n = m.num_chunks, group = l.group;
  const int words = (l.capacity_chunks + 31) / 32;
  uint32_t* keys = shared_words;
  uint32_t* wanted = keys + l.capacity_chunks;
  int* selected = reinterpret_cast<int*>(wanted + words);
  int* free_slots = selected + max(l.max_budget, l.max_candidates);
  const float* logits = p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * group *
                                       l.capacity_chunks;
  int32_t* miss = p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  int32_t* slot_chunk = l.slot_chunk + l.HeadIndex(m.seq, p.layer, h) * l.max_budget;

  // Scores: softmax of each query head over the selectable chunks, max over the group.
  float* score = reinterpret_cast<float*>(keys);
  for (int c = tid; c < n; c += kSelectThreads) score[c] = 0.0f;
  for (int w = tid; w < words; w += kSelectThreads) wanted[w] = 0;
  for (int s = tid; s < l.max_budget; s += kSelectThreads) miss[s] = -1;
  if (SkvKeepsChunks(p, m, row, h)) return;  // the slots keep the chunks of the last selecting step
  __syncthreads();
  for (int g = 0; g < group; ++g) {
    const float* x = logits + static_cast<int64_t>(g) * l.capacity_chunks;
    float local = -INFINITY;
    for (int c = tid; c < n; c += kSelectThreads) local = fmaxf(local, x[c]);
    const float top = SkvBlockMax(local, reduce);
    float sum = 0.0f;
    for (int c = tid; c < n; c += kSelectThreads) sum += x[c] == -INFINITY ? 0.0f : expf(x[c] - top);
    sum = BlockSum(sum, reduce);
    const float inv = 1.0f / sum;
    for (int c = tid; c < n; c += kSelectThreads) {
      if (x[c] != -INFINITY) score[c] = fmaxf(score[c], expf(x[c] - top) * inv);
    }
  }
  __syncthreads();
  int selectable_local = 0;
  for (int c = tid; c < n; c += kSelectThreads) {
    const bool live = logits[c] != -INFINITY;  // query head 0's logit marks outliers
    keys[c] = live ? __float_as_uint(score[c]) + 1u : 0u;
    selectable_local += live;
  }
  const int selectable = static_cast<int>(BlockSum(static_cast<float>(selectable_local), reduce));
  const int drawn = p.candidates ? 0 : SkvDrawnChunks(l, info, selectable);
  const int k = min(SkvSelectWanted(p, info.budget_chunks), selectable) - drawn;

  // Radix select of the k-th largest key, then the selected chunks in index order.
  auto key_of = [&](int c) { return keys[c]; };
  int ties_allowed = 0;
  const uint32_t threshold =
      SkvRadixKthKey(key_of, n, k, histogram, &prefix_shared, &remaining_shared, &ties_allowed);
  if (k > 0) {
    SkvTakeInIndexOrder<SelectScan>(scan_storage, key_of, n, threshold, ties_allowed,
                                    [&](int place, int c) {
                                      selected[place] = c;
                                      atomicOr(&wanted[c >> 5], 1u << (c & 31));
                                    });
  }
  __syncthreads();

  if (p.candidates) {
    SkvWriteCandidates(p, row, h, k, selected);
    return;
  }
  SkvFinishSelection<SelectScan>(
      scan_storage, p, m, info, h, k, drawn, [&](int w) { return SkvKeysLiveWord(keys, n, w); },
      selected, wanted, free_slots, free_slots + l.max_budget, slot_chunk, miss);
}

// ---- value fetch ------------------------------------------------------------------------------

constexpr int kFetchThreads = 256;
constexpr int kFetchSlots = 32;  // gather slots per block: one warp's ballot over their misses
constexpr int kFetchUnroll = 4;  // 16-byte pieces in flight per thread

// Copies pieces [0, total) of a block's missed runs: every thread loads kFetchUnroll pieces (of
// any run) before it stores one, so a block keeps up to kFetchThreads·kFetchUnroll loads in
// flight (pinned host stores are read over PCIe). load(i) returns what store(i, loaded) writes.
template <typename Load, typename Store>
__device__ __forceinline__ void FetchPieces(int total, const Load& load, const Store& store) {
  for (int base = threadIdx.x; base < total; base += kFetchThreads * kFetchUnroll) {
    decltype(load(0)) loaded[kFetchUnroll];
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u) {
      const int i = base + u * kFetchThreads;
      if (i < total) loaded[u] = load(i);
    }
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u) {
      const int i = base + u * kFetchThreads;
      if (i < total) store(i, loaded[u]);
    }
  }
}

// One block per (kFetchSlots gather slots, KV head, row). The first warp lists the slots that
// missed (one ballot); then the block copies each missed chunk's run of C·D values, store →
// gather rows (bf16 as stored, or FP8 codes decoded with the run's scale), and with exact_keys
// the chunk's run of keys, in 16-byte pieces spread over all threads. A block whose slots all
// hit (or whose row or KV head keeps its chunks this step) leaves after the ballot: a grid of a
// block per slot spent most of a large budget's fetch launching blocks that had nothing to copy.
__global__ void __launch_bounds__(kFetchThreads) SkvFetchValuesKernel(SkvDecodeParams p) {
  __shared__ int miss_slot[kFetchSlots], miss_chunk[kFetchSlots], miss_count;
  const int h = blockIdx.y, row = blockIdx.z;
  const SkvLayout& l = p.layout;
  if (threadIdx.x < 32) {
    const int slot = blockIdx.x * kFetchSlots + static_cast<int>(threadIdx.x);
    const int chunk =
        slot < l.max_budget
            ? p.miss_chunk[(static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget + slot]
            : -1;
    const unsigned misses = __ballot_sync(0xffffffffu, chunk >= 0);
    if (chunk >= 0) {
      const int at = __popc(misses & ((1u << threadIdx.x) - 1u));
      miss_slot[at] = slot;
      miss_chunk[at] = chunk;
    }
    if (threadIdx.x == 0) miss_count = __popc(misses);
  }
  __syncthreads();
  const int count = miss_count;
  if (count == 0) return;
  const SkvRowMeta m = p.meta[row];
  const SkvSequenceInfo info = l.info[m.seq];
  const int run = l.chunk_size * l.head_dim;
  const int pieces = run / 8;  // 16-byte pieces of a bf16 run
  const int total = count * pieces;
  // Piece i of the block's misses: run i / pieces, piece i % pieces of it.
  auto chunk_of = [&](int i) { return miss_chunk[i / pieces]; };
  // The head's first gather row; slot s starts s runs after it.
  const int64_t gather_base =
      l.attn.HeadOffset(m.seq, p.layer, h) + static_cast<int64_t>(info.gather_base) * l.head_dim;
  auto target = [&](Bf16* rows, int i) {
    return reinterpret_cast<uint4*>(rows + gather_base +
                                    static_cast<int64_t>(miss_slot[i / pieces]) * run) +
           i % pieces;
  };
  if (l.fp8_values) {
    struct Codes {
      uint2 codes;
      float scale;
    };
    FetchPieces(
        total,
        [&](int i) {
          const int chunk = chunk_of(i);
          return Codes{
              reinterpret_cast<const uint2*>(l.ValueCodes(m.seq, p.layer, h, chunk))[i % pieces],
              *l.ValueScale(m.seq, p.layer, h, chunk)};
        },
        [&](int i, const Codes& c) {
          *target(l.attn.values, i) = DecodeFp8x8ToBf16(c.codes, c.scale);
        });
  } else {
    FetchPieces(
        total,
        [&](int i) {
          return reinterpret_cast<const uint4*>(
              l.values[m.seq] + l.RunIndex(p.layer, h, chunk_of(i)) * run)[i % pieces];
        },
        [&](int i, const uint4& v) { *target(l.attn.values, i) = v; });
  }
  if (l.fp8_keys) {  // codes of each key less the chunk's landmark
    FetchPieces(
        total,
        [&](int i) {
          return SkvLoadFp8Keys8(l, m.seq, p.layer, h, chunk_of(i),
                                 static_cast<int64_t>(i % pieces) * 8);
        },
        [&](int i, const SkvFp8Keys8& k) { *target(l.attn.keys, i) = SkvDecodeFp8Keys8(l, k); });
  } else if (l.exact_keys) {
    FetchPieces(
        total,
        [&](int i) {
          return reinterpret_cast<const uint4*>(
              l.KeyRun(m.seq, p.layer, h, chunk_of(i)))[i % pieces];
        },
        [&](int i, const uint4& v) { *target(l.attn.keys, i) = v; });
  }
}

// ---- key rebuild ------------------------------------------------------------------------------

constexpr int kRebuildWarps = 4;
constexpr int kRebuildSlots = 16;  // gather slots per block

__host__ __device__ constexpr int RankPadded(int rank) { return (rank + 15) / 16 * 16; }

// One block per (16 slots, KV head, row). B_h [rank, head_dim] is staged once in shared memory;
// each warp takes 16-row tiles of the missed chunks' A rows, multiplies on the tensor cores
// (mma m16n8k16, fp32 accumulation), and rotates the result to the chunk's positions.
template <int kHeadDim>
__global__ void __launch_bounds__(kRebuildWarps * 32) SkvRebuildKernel(SkvDecodeParams p) {
  extern __shared__ __align__(16) unsigned char rebuild_shared[];
  __shared__ int miss_slots[kRebuildSlots], miss_chunks[kRebuildSlots], miss_count;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const SkvRowMeta m = p.meta[row];
  // The layer's own rank: the tiles below are laid out for it (shared memory is sized for
  // l.rank, the most); A's rows keep their stride of l.rank.
  const int rank = l.RankOf(m.seq, p.layer);
  const int rank_padded = RankPadded(rank);
  const int a_pitch = rank_padded + 8, b_pitch = kHeadDim + 8, out_pitch = kHeadDim + 4;
  const int32_t* miss =
      p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  if (threadIdx.x < 32) {
    const int slot = blockIdx.x * kRebuildSlots + lane;
    const int chunk = lane < kRebuildSlots && slot < l.max_budget ? miss[slot] : -1;
    const unsigned ballot = __ballot_sync(0xffffffffu, chunk >= 0);
    if (chunk >= 0) {
      const int at = __popc(ballot & ((1u << lane) - 1u));
      miss_slots[at] = slot;
      miss_chunks[at] = chunk;
    }
    if (lane == 0) miss_count = __popc(ballot);
  }
  __syncthreads();
  const int count = miss_count;
  if (count == 0) return;

  const SkvSequenceInfo info = l.info[m.seq];
  const int width = l.kv_width(), chunk_size = l.chunk_size;
  const int64_t layer_index = LayerIndex(l, m.seq, p.layer);
  Bf16* b_tile = reinterpret_cast<Bf16*>(rebuild_shared);              // [rank_padded, b_pitch]
  Bf16* a_tiles = b_tile + rank_padded * b_pitch;                      // [warps][16, a_pitch]
  float* out_tiles = reinterpret_cast<float*>(a_tiles + kRebuildWarps * 16 * a_pitch);
  const Bf16* basis = l.basis + layer_index * l.rank * width + h * kHeadDim;
  for (int i = threadIdx.x; i < rank_padded * (kHeadDim / 8); i += blockDim.x) {
    const int k = i / (kHeadDim / 8), v = i % (kHeadDim / 8);
    uint4 value = make_uint4(0, 0, 0, 0);
    if (k < rank) {
      value = *reinterpret_cast<const uint4*>(basis + static_cast<int64_t>(k) * width + v * 8);
    }
    *reinterpret_cast<uint4*>(b_tile + k * b_pitch + v * 8) = value;
  }
  __syncthreads();

  Bf16* a_tile = a_tiles + warp * 16 * a_pitch;
  float* out_tile = out_tiles + warp * 16 * out_pitch;
  const Bf16* coefficients = l.coefficients + layer_index * l.capacity_chunks * chunk_size * l.rank;
  Bf16* keys = l.attn.keys + l.attn.HeadOffset(m.seq, p.layer, h);
  const int total_rows = count * chunk_size;
  const int rotary_half = p.rotary_dim / 2;
  for (int tile = warp; tile * 16 < total_rows; tile += kRebuildWarps) {
    for (int i = lane; i < 16 * (rank_padded / 8); i += 32) {
      const int r = i / (rank_padded / 8), v = i % (rank_padded / 8);
      const int token_row = tile * 16 + r;
      uint4 value = make_uint4(0, 0, 0, 0);
      if (token_row < total_rows && v * 8 < rank) {
        const int which = token_row / chunk_size, t = token_row % chunk_size;
        value = *reinterpret_cast<const uint4*>(
            coefficients + (static_cast<int64_t>(miss_chunks[which]) * chunk_size + t) * l.rank +
            v * 8);
      }
      *reinterpret_cast<uint4*>(a_tile + r * a_pitch + v * 8) = value;
    }
    __syncwarp();
    float acc[kHeadDim / 8][4];
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int k0 = 0; k0 < rank_padded; k0 += 16) {
      uint32_t a[4];
      LdMatrixX4(a, a_tile + (lane & 15) * a_pitch + k0 + (lane >> 4) * 8);
#pragma unroll
      for (int n0 = 0; n0 < kHeadDim; n0 += 16) {
        uint32_t b[4];
        LdMatrixX4Trans(b, b_tile + (k0 + (lane & 15)) * b_pitch + n0 + (lane >> 4) * 8);
        MmaBf16(acc[n0 / 8], a, b[0], b[1]);
        MmaBf16(acc[n0 / 8 + 1], a, b[2], b[3]);
      }
    }
    const int g = lane / 4, c2 = (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      out_tile[g * out_pitch + j * 8 + c2] = acc[j][0];
      out_tile[g * out_pitch + j * 8 + c2 + 1] = acc[j][1];
      out_tile[(g + 8) * out_pitch + j * 8 + c2] = acc[j][2];
      out_tile[(g + 8) * out_pitch + j * 8 + c2 + 1] = acc[j][3];
    }
    __syncwarp();
    // RoPE at the chunk's own positions, exactly as the QKV kernel rotates new keys.
    for (int i = lane; i < 16 * (kHeadDim / 2); i += 32) {
      const int r = i / (kHeadDim / 2), pair = i % (kHeadDim / 2);
      const int token_row = tile * 16 + r;
      if (token_row >= total_rows) continue;
      const int which = token_row / chunk_size, t = token_row % chunk_size;
      const bool rotates = pair < rotary_half;
      int a, b;
      SkvRopePairDims(pair, p.rotary_dim, p.halves, &a, &b);
      float x0 = out_tile[r * out_pitch + a], x1 = out_tile[r * out_pitch + b];
      if (rotates) {
        SkvRotatePair(miss_chunks[which] * chunk_size + t, p.inv_freq[pair], &x0, &x1);
      }
      Bf16* key = keys + (static_cast<int64_t>(info.gather_base) +
                          static_cast<int64_t>(miss_slots[which]) * chunk_size + t) *
                             kHeadDim;
      key[a] = __float2bfloat16(x0);
      key[b] = __float2bfloat16(x1);
    }
    __syncwarp();
  }
}

int64_t RebuildSharedBytes(int rank, int head_dim) {
  const int rank_padded = RankPadded(rank);
  return static_cast<int64_t>(rank_padded) * (head_dim + 8) * 2 +
         static_cast<int64_t>(kRebuildWarps) * 16 * (rank_padded + 8) * 2 +
         static_cast<int64_t>(kRebuildWarps) * 16 * (head_dim + 4) * 4;
}

// Dynamic shared memory of the graduation kernel (FP8 landmarks: the means before quantising)
// and of its A-row kernel (the chunk's pre-RoPE keys as fp32).
int64_t GraduateSharedBytes(const SkvLayout& l) {
  return l.fp8_landmarks ? static_cast<int64_t>(l.kv_width()) * 4 : 0;
}
int64_t GraduateCoefficientsSharedBytes(const SkvLayout& l) {
  return static_cast<int64_t>(l.chunk_size) * l.kv_width() * 4;
}

}  // namespace

int64_t SkvSelectSharedBytes(const SkvLayout& l) {
  // Keys, the wanted bitmap, the selected list (the candidates under re-ranking), free slots,
  // the draw's scratch.
  return 4ll * l.capacity_chunks + 4ll * ((l.capacity_chunks + 31) / 32) +
         4ll * std::max(l.max_budget, l.max_candidates) + 4ll * l.max_budget +
         SkvSampleSharedBytes(l.capacity_chunks, l.max_sample);
}

cudaError_t SkvSharedMemoryLimit(int* limit) {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

cudaError_t SkvConfigureKernels(const SkvLayout& l) {
  int limit = 0;
  cudaError_t e = SkvSharedMemoryLimit(&limit);
  if (e != cudaSuccess) return e;
  const int64_t select_bytes =
      SkvSelectSharedBytes(l) +
      static_cast<int64_t>(sizeof(SelectScan::TempStorage)) + 2048;
  const int64_t rebuild_bytes = RebuildSharedBytes(l.rank, l.head_dim);
  const int64_t graduate_bytes = GraduateSharedBytes(l);
  const int64_t coefficient_bytes = GraduateCoefficientsSharedBytes(l);
  if (select_bytes > limit || rebuild_bytes > limit || graduate_bytes > limit ||
      coefficient_bytes > limit || l.chunk_size > kSkvMaxGraduateChunk ||
      l.max_budget > kSkvMaxBudgetChunks || l.rank % 8 != 0 ||
      !SkvHeadDimSupported(l.head_dim) || !SkvGroupSupported(l.group)) {
    return cudaErrorInvalidValue;
  }
  // Never lowers a limit another layout of this process raised (an FP8 model's graduation asks
  // for more than a bf16 one's).
  auto raise = [&](const void* kernel, int64_t bytes) {
    return AllowDynamicSharedMemory(kernel, static_cast<int>(bytes));
  };
  const int64_t dynamic_select =
      SkvSelectSharedBytes(l);
  if ((e = raise(reinterpret_cast<const void*>(SkvSelectKernel), dynamic_select)) != cudaSuccess) return e;
  if ((e = raise(reinterpret_cast<const void*>(SkvGraduateKernel), graduate_bytes)) != cudaSuccess) return e;
  if ((e = raise(reinterpret_cast<const void*>(SkvGraduateCoefficientsKernel),
                 coefficient_bytes)) != cudaSuccess) {
    return e;
  }
  if (SkvHeadDimFirstKernels(l.head_dim)) {  // the first kernels' rebuild (64 and 128 only)
    const void* rebuild = l.head_dim == 128 ? reinterpret_cast<const void*>(SkvRebuildKernel<128>)
                                            : reinterpret_cast<const void*>(SkvRebuildKernel<64>);
    if ((e = raise(rebuild, rebuild_bytes)) != cudaSuccess) return e;
  }
  if (SkvRebuildFastSharedBytes(l.rank, l.head_dim) > limit) return cudaErrorInvalidValue;
  if (l.max_candidates > 0 && (e = SkvConfigureRerank(l)) != cudaSuccess) return e;
  return SkvConfigureFastKernels(l, dynamic_select);
}

cudaError_t LaunchSkvGraduate(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  const int layers = l.num_layers;
  SkvGraduateKernel<<<dim3(p.rows, 1, layers), kGraduateThreads, GraduateSharedBytes(l),
                      stream>>>(p);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const dim3 coefficient_grid(p.rows, (l.rank + kGraduateBasisRows - 1) / kGraduateBasisRows,
                              layers);
  SkvGraduateCoefficientsKernel<<<coefficient_grid, kGraduateThreads,
                                  GraduateCoefficientsSharedBytes(l), stream>>>(p);
  if ((error = cudaGetLastError()) != cudaSuccess) return error;
  const size_t shift_bytes = 3ull * (l.recent_capacity - l.chunk_size) * l.head_dim * sizeof(Bf16);
  SkvShiftKernel<<<dim3(p.rows, l.num_kv_heads, layers), kGraduateThreads, shift_bytes,
                   stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSkvScore(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.kernel_variant == kSkvKernelsFast) return LaunchSkvScoreFast(p, stream);
  const SkvLayout& l = p.layout;
  if (l.fp8_landmarks) return cudaErrorInvalidValue;  // the fast kernels only
  const dim3 grid((l.capacity_chunks + kScoreChunksPerBlock - 1) / kScoreChunksPerBlock,
                  l.num_kv_heads, p.rows);
#define SKV_SCORE_CASE(D, G)                                                  \
  if (l.head_dim == D && l.group == G) {                                      \
    SkvScoreKernel<D, G><<<grid, kScoreThreads, 0, stream>>>(p);              \
    return cudaGetLastError();                                                \
  }
  SKV_SCORE_CASE(128, 1) SKV_SCORE_CASE(128, 2) SKV_SCORE_CASE(128, 3) SKV_SCORE_CASE(128, 4)
  SKV_SCORE_CASE(128, 5) SKV_SCORE_CASE(128, 6) SKV_SCORE_CASE(128, 7) SKV_SCORE_CASE(128, 8)
  SKV_SCORE_CASE(64, 1) SKV_SCORE_CASE(64, 2) SKV_SCORE_CASE(64, 3) SKV_SCORE_CASE(64, 4)
  SKV_SCORE_CASE(64, 5) SKV_SCORE_CASE(64, 6) SKV_SCORE_CASE(64, 7) SKV_SCORE_CASE(64, 8)
#undef SKV_SCORE_CASE
  return cudaErrorInvalidValue;
}

SkvDecodeParams SkvDecodeRows(const SkvDecodeParams& p, int first, int count) {
  const SkvLayout& l = p.layout;
  const int64_t heads = first * static_cast<int64_t>(l.num_kv_heads);  // (row, KV head) pairs before
  SkvDecodeParams part = p;
  part.meta = p.meta + first;
  part.rows = count;
  part.queries = p.queries + heads * l.group * l.head_dim;
  part.logits = p.logits + heads * l.group * l.capacity_chunks;
  if (p.softmax_partials) {
    part.softmax_partials =
        p.softmax_partials + heads * l.group * SkvScoreBlocks(l.capacity_chunks) * 2;
  }
  part.miss_chunk = p.miss_chunk + heads * l.max_budget;
  if (p.head_keeps) part.head_keeps = p.head_keeps + heads;
  if (p.candidates) {
    part.candidates = p.candidates + heads * l.max_candidates;
    part.candidate_lse = p.candidate_lse + heads * l.group * static_cast<int64_t>(l.max_candidates);
  }
  return part;
}

cudaError_t LaunchSkvSelect(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  if (l.max_budget > kSkvMaxBudgetChunks) return cudaErrorInvalidValue;
  if (p.candidates && (l.max_candidates < 1 || p.rerank_factor < 1 || !p.candidate_lse)) {
    return cudaErrorInvalidValue;
  }
  if (p.select_heads) {
    if (p.candidates || p.select_successors) return cudaErrorInvalidValue;  // one mode at a time
    return LaunchSkvSelectHeads(p, stream);
  }
  const int64_t bytes = SkvSelectSharedBytes(l);
  if (p.kernel_variant == kSkvKernelsFast) return LaunchSkvSelectFast(p, bytes, stream);
  if (p.select_successors) return cudaErrorInvalidValue;  // the fast kernels only
  SkvSelectKernel<<<dim3(l.num_kv_heads, p.rows), kSelectThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSkvFetchValues(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  if ((l.chunk_size * l.head_dim) % 8 != 0) return cudaErrorInvalidValue;
  const dim3 grid((l.max_budget + kFetchSlots - 1) / kFetchSlots, l.num_kv_heads, p.rows);
  SkvFetchValuesKernel<<<grid, kFetchThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSkvRebuildKeys(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.layout.exact_keys) return cudaSuccess;  // exact keys: the fetch's copy
  const SkvLayout& l = p.layout;
  if (l.rank % 8 != 0) return cudaErrorInvalidValue;
  if (p.kernel_variant == kSkvKernelsFast && SkvRebuildFastApplies(p)) {
    return LaunchSkvRebuildFast(p, stream);
  }
  const int64_t bytes = RebuildSharedBytes(l.rank, l.head_dim);
  const dim3 grid((l.max_budget + kRebuildSlots - 1) / kRebuildSlots, l.num_kv_heads, p.rows);
  if (l.head_dim == 128) {
    SkvRebuildKernel<128><<<grid, kRebuildWarps * 32, bytes, stream>>>(p);
  } else if (l.head_dim == 64) {
    SkvRebuildKernel<64><<<grid, kRebuildWarps * 32, bytes, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
