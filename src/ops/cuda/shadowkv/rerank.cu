// ShadowKV re-ranking (selection "rerank"): the candidates a landmark select kept are scored by
// their keys (exact attention logits, reduced to one log-sum-exp per chunk and query head), and
// the best K of them take the gather slots (rerank_select.cu). The keys are rebuilt from A·B, or
// with exact keys scored as stored (rerank_stored) read from the store: bf16, or FP8 runs scored
// as coded or decoded as the fetch decodes them.
#include <cmath>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/shadowkv/rebuild_tile.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"
#include "ops/cuda/shadowkv/shadowkv_fp8.cuh"

namespace shadowkv::cuda {
namespace {

using Bf16 = __nv_bfloat16;

// ---- exact scoring ----------------------------------------------------------------------------

// Components the candidates of sequence `seq` are scored with (SkvDecodeParams::rerank_rank).
__device__ __forceinline__ int ScoreRank(const SkvDecodeParams& p, int seq) {
  const int rank = p.layout.RankOf(seq, p.layer);
  return p.rerank_rank > 0 ? min(rank, p.rerank_rank) : rank;
}

// Eight stored exact keys (exact_keys) of chunk `chunk`, from element `at` of its run (a
// multiple of 8), as the fetch puts them in the gather rows: bf16, or FP8 codes decoded.
__device__ __forceinline__ uint4 StoredKeys8(const SkvLayout& l, int seq, int layer, int h,
                                             int chunk, int64_t at) {
  if (!l.fp8_keys) return *reinterpret_cast<const uint4*>(l.KeyRun(seq, layer, h, chunk) + at);
  return SkvDecodeFp8Keys8(l, seq, layer, h, chunk, at);
}

// One warp: the stored exact keys of token rows [16 tile, 16 tile + 16) of a list of chunks
// into `target` [16, pitch], bf16. Token row t is token t % chunk_size of chunk
// chunks[t / chunk_size]; rows past `total_rows` repeat the last one (their logits are not
// kept). Ends with __syncwarp: the tile is readable by the warp.
template <int kHeadDim>
__device__ __forceinline__ void LoadStoredKeyTile(const SkvLayout& l, int seq, int layer, int h,
                                                  const int* chunks, int total_rows, int tile,
                                                  Bf16* target, int pitch) {
  constexpr int kVectors = kHeadDim / 8;
  for (int i = threadIdx.x % 32; i < 16 * kVectors; i += 32) {
    const int r = i / kVectors, v = i % kVectors;
    const int token_row = min(tile * 16 + r, total_rows - 1);
    const int64_t at = static_cast<int64_t>(token_row % l.chunk_size) * kHeadDim + v * 8;
    *reinterpret_cast<uint4*>(target + r * pitch + v * 8) =
        StoredKeys8(l, seq, layer, h, chunks[token_row / l.chunk_size], at);
  }
  __syncwarp();
}

// LoadStoredKeyTile for bf16 runs by cp.async: the copies are issued, not awaited (the caller
// commits and waits).
template <int kHeadDim>
__device__ __forceinline__ void LoadStoredKeyTileAsync(const SkvLayout& l, int seq, int layer,
                                                       int h, const int* chunks, int total_rows,
                                                       int tile, Bf16* target, int pitch) {
  constexpr int kVectors = kHeadDim / 8;
  for (int i = threadIdx.x % 32; i < 16 * kVectors; i += 32) {
    const int r = i / kVectors, v = i % kVectors;
    const int token_row = min(tile * 16 + r, total_rows - 1);
    const int64_t at = static_cast<int64_t>(token_row % l.chunk_size) * kHeadDim + v * 8;
    CpAsync16(target + r * pitch + v * 8,
              l.KeyRun(seq, layer, h, chunks[token_row / l.chunk_size]) + at, 16);
  }
}

// After a block has staged the logits of its `count` candidate chunks in `token_logits`
// [count * chunk_size, group] (a barrier before): each (chunk, query head)'s log-sum-exp over
// the chunk's tokens into lse [group, max_candidates], from column `first`.
__device__ void WriteChunkLse(const float* token_logits, int count, int chunk_size, int group,
                              int max_candidates, int first, float* lse) {
  for (int i = threadIdx.x; i < count * group; i += blockDim.x) {
    const int chunk = i / group, g = i % group;
    const float* x = token_logits + static_cast<int64_t>(chunk) * chunk_size * group + g;
    float top = -INFINITY;
    for (int t = 0; t < chunk_size; ++t) top = fmaxf(top, x[t * group]);
    float sum = 0.0f;
    for (int t = 0; t < chunk_size; ++t) sum += expf(x[t * group] - top);
    lse[static_cast<int64_t>(g) * max_candidates + first + chunk] = top + logf(sum);
  }
}

constexpr int kExactThreads = 128;
// The CUDA-core scorer's threads take a head's rotary pairs in whole groups.
bool ExactGenericFits(const SkvLayout& l) { return kExactThreads % (l.head_dim / 2) == 0; }
constexpr int kExactTokens = 32;  // candidate tokens per block (whole chunks)

__host__ __device__ constexpr int ExactChunksPerBlock(int chunk_size) {
  return chunk_size >= kExactTokens ? 1 : kExactTokens / chunk_size;
}

// Shared memory of one exact-scoring block: its chunks' A rows up to the layout's rank, their
// rotated keys, the group's queries and the tokens' logits, fp32.
int64_t ExactSharedBytes(const SkvLayout& l) {
  const int64_t tokens = int64_t{ExactChunksPerBlock(l.chunk_size)} * l.chunk_size;
  return 4 *
         (tokens * l.rank + tokens * l.head_dim + int64_t{l.group} * l.head_dim + tokens * l.group);
}

// One block per (ExactChunksPerBlock candidates, KV head, row). Keys: thread (pair, token
// group) rebuilds one rotary pair of its tokens from the staged A rows and B_h (read through the
// cache), up to the layer's own rank, or with rerank_stored each thread reads stored keys; then
// one warp per token scores it against every query of the group. No key leaves the block: the kept
// chunks reach their gather slots by the ordinary rebuild or fetch, and only each chunk's
// log-sum-exps go to memory.
__global__ void __launch_bounds__(kExactThreads) SkvExactScoreKernel(SkvDecodeParams p) {
  extern __shared__ float exact_shared[];
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, d = l.head_dim, chunk_size = l.chunk_size;
  const int per_block = ExactChunksPerBlock(chunk_size);
  const int first = blockIdx.x * per_block;
  if (first >= l.max_candidates) return;
  const int32_t* candidates =
      p.candidates + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_candidates;
  if (candidates[first] < 0) return;  // the list is packed: nothing from here on
  const int chunks = min(per_block, l.max_candidates - first);
  const SkvRowMeta m = p.meta[row];
  // No selection at this step: the list is an earlier step's.
  if (SkvKeepsChunks(p, m, row, h)) return;
  const int rank = ScoreRank(p, m.seq), width = l.kv_width();
  const int64_t stride = l.rank, layer_index = static_cast<int64_t>(m.seq) * l.num_layers + p.layer;
  const int tokens = per_block * chunk_size;
  float* a_rows = exact_shared;                                  // [tokens, l.rank]
  float* keys = a_rows + static_cast<int64_t>(tokens) * l.rank;  // [tokens, d]
  float* queries = keys + tokens * d;                            // [group, d]
  float* token_logits = queries + l.group * d;                   // [tokens, group]

  const Bf16* coefficients = l.coefficients + layer_index * l.capacity_chunks * chunk_size * stride;
  // With keys scored from the store (rerank_stored) no A rows are staged and no key is rebuilt.
  const bool stored = l.rerank_stored != 0;
  const int rebuilt_tokens = stored ? 0 : tokens;
  for (int i = threadIdx.x; i < rebuilt_tokens * rank; i += blockDim.x) {
    const int token = i / rank, k = i % rank, which = token / chunk_size;
    const int chunk = which < chunks ? candidates[first + which] : -1;
    a_rows[token * l.rank + k] =
        chunk < 0
            ? 0.0f
            : __bfloat162float(
                  coefficients[(static_cast<int64_t>(chunk) * chunk_size + token % chunk_size) *
                                   stride +
                               k]);
  }
  const Bf16* q_row = p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * d;
  for (int i = threadIdx.x; i < l.group * d; i += blockDim.x)
    queries[i] = __bfloat162float(q_row[i]);
  __syncthreads();

  if (stored) {  // the keys as the store holds them, eight at a time
    for (int i = threadIdx.x; i < tokens * d / 8; i += blockDim.x) {
      const int token = i / (d / 8), which = token / chunk_size;
      const int chunk = which < chunks ? candidates[first + which] : -1;
      float* out = keys + static_cast<int64_t>(i) * 8;
      if (chunk < 0) {
        for (int e = 0; e < 8; ++e) out[e] = 0.0f;
        continue;
      }
      const int64_t at = static_cast<int64_t>(token % chunk_size) * d + i % (d / 8) * 8;
      const uint4 packed = StoredKeys8(l, m.seq, p.layer, h, chunk, at);
      const Bf16* eight = reinterpret_cast<const Bf16*>(&packed);
      for (int e = 0; e < 8; ++e) out[e] = __bfloat162float(eight[e]);
    }
  }
  const Bf16* basis = l.basis + layer_index * stride * width + h * d;
  const int pairs = d / 2, token_groups = kExactThreads / pairs;
  const int pair = threadIdx.x % pairs;
  int dim_a, dim_b;
  SkvRopePairDims(pair, p.rotary_dim, p.halves, &dim_a, &dim_b);
  const bool rotates = pair < p.rotary_dim / 2;
  for (int token = threadIdx.x / pairs; token < rebuilt_tokens; token += token_groups) {
    const float* a = a_rows + token * l.rank;
    float x0 = 0.0f, x1 = 0.0f;
    for (int k = 0; k < rank; ++k) {
      const Bf16* b = basis + static_cast<int64_t>(k) * width;
      x0 = fmaf(a[k], __bfloat162float(b[dim_a]), x0);
      x1 = fmaf(a[k], __bfloat162float(b[dim_b]), x1);
    }
    const int which = token / chunk_size;
    if (rotates && which < chunks) {
      const int chunk = candidates[first + which];
      const float angle =
          static_cast<float>(max(chunk, 0) * chunk_size + token % chunk_size) * p.inv_freq[pair];
      float sine, cosine;
      RopeSinCos(angle, &sine, &cosine);
      const float r0 = x0 * cosine - x1 * sine, r1 = x0 * sine + x1 * cosine;
      x0 = r0;
      x1 = r1;
    }
    keys[token * d + dim_a] = __bfloat162float(__float2bfloat16(x0));
    keys[token * d + dim_b] = __bfloat162float(__float2bfloat16(x1));
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int count = 0;  // the block's candidates (the list is packed)
  while (count < chunks && candidates[first + count] >= 0) ++count;
  for (int token = warp; token < count * chunk_size; token += kExactThreads / 32) {
    for (int g = 0; g < l.group; ++g) {
      float dot = 0.0f;
      for (int e = lane; e < d; e += 32) dot = fmaf(keys[token * d + e], queries[g * d + e], dot);
      dot = WarpSum(dot);
      if (lane == 0) token_logits[token * l.group + g] = dot * p.scale;
    }
  }
  __syncthreads();
  WriteChunkLse(token_logits, count, chunk_size, l.group, l.max_candidates, first,
                p.candidate_lse +
                    (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * l.max_candidates);
}

// ---- exact scoring on tensor cores --------------------------------------------------------------
//
// The candidates' keys are rebuilt 16 rows at a time as the gather rebuild makes them
// (SkvRebuildTile: A·B_h on tensor cores, RoPE, bf16), or with rerank_stored read from the store
// (LoadStoredKeyTile), and each key tile is multiplied by the group's queries on tensor cores
// too (keys [16, D] · Qᵀ [D, 16]: the group padded to 16 heads, two mma N blocks), so no key
// leaves the block either. Each warp loads its next tile's A rows
// while it computes one: at the H200 that is faster than staging all of a block's rows at once,
// which fits fewer blocks on a multiprocessor (dev/cuda/rerank_score_lab.cu). Stored bf16 keys
// are read the same way, kStoredStages tiles deep: a warp's copies of its next two tiles are in
// flight while it multiplies one. FP8 runs are scored as coded by a kernel of their own
// (SkvExactScoreFp8Kernel, below; decoded into the key tile a tile at a time at head dim 256 or
// with stored_key_prefetch 0).

constexpr int kExactFastWarps = 4;
constexpr int kExactFastChunks = 32;  // candidate chunks per block
constexpr int kExactFastHeads = 16;   // query heads of a group the tile product covers
constexpr int kStoredStages = 3;      // key tiles per warp where bf16 stored keys are read

int ExactFastGroupFits(const SkvLayout& l) { return l.group <= kExactFastHeads; }

// Key tiles per warp: the ring of stored bf16 keys, else the one tile rebuilt or decoded.
__host__ __device__ int ExactFastKeyTiles(const SkvLayout& l) {
  return l.rerank_stored && !l.fp8_keys ? kStoredStages : 1;
}

// B_h's rows and the elements of a warp's ring of A tiles, for a rank: none where the keys come
// from the store (rerank_stored), which reads neither, so that more blocks fit on a
// multiprocessor.
__host__ __device__ int ExactFastBasisRows(const SkvLayout& l, int rank) {
  return l.rerank_stored ? 0 : SkvRankPadded(rank);
}
__host__ __device__ int ExactFastRingElements(const SkvLayout& l, int rank) {
  return l.rerank_stored ? 0 : 2 * 16 * (SkvRankPadded(rank) + 8);
}

// Shared memory of one fast exact-scoring block: B_h [rank_padded, D + 8], the queries
// [16, D + 8] and per warp two A tiles [16, rank_padded + 8] (ExactFastBasisRows and
// ExactFastRingElements: neither with rerank_stored) and its key tiles [16, D + 8] each
// (ExactFastKeyTiles), bf16; then the tokens' logits [kExactFastChunks * C, group], fp32.
__host__ __device__ int64_t ExactFastBf16Bytes(const SkvLayout& l) {
  const int64_t pitch = l.head_dim + 8;
  return 2 *
         (ExactFastBasisRows(l, l.rank) * pitch + kExactFastHeads * pitch +
          kExactFastWarps * (ExactFastRingElements(l, l.rank) + ExactFastKeyTiles(l) * 16 * pitch));
}
int64_t ExactFastSharedBytes(const SkvLayout& l) {
  return ExactFastBf16Bytes(l) + 4ll * kExactFastChunks * l.chunk_size * l.group;
}

// The prologue of a fast scoring block (blockIdx.x: its kExactFastChunks candidates, y: the KV
// head, z: the row). Returns false, the same in every thread, where the block has nothing to
// score: past the packed list, or no selection at this step (the list is an earlier step's).
// Else threads [0, kExactFastChunks) put the block's candidates in chunks (-1 past the list),
// count them into *count and call visit(i, chunk) for theirs; the caller's barrier makes them
// visible.
template <typename Visit>
__device__ __forceinline__ bool StageFastCandidates(const SkvDecodeParams& p, int* chunks,
                                                    int* count, Visit&& visit) {
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, first = blockIdx.x * kExactFastChunks;
  const int32_t* list =
      p.candidates + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_candidates;
  if (first >= l.max_candidates || list[first] < 0) return false;  // packed: nothing from here on
  if (SkvKeepsChunks(p, p.meta[row], row, h)) return false;
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  if (threadIdx.x < kExactFastChunks) {
    const int i = first + threadIdx.x;
    const int chunk = i < l.max_candidates ? list[i] : -1;
    chunks[threadIdx.x] = chunk;
    visit(threadIdx.x, chunk);
    if (chunk >= 0) atomicAdd(count, 1);
  }
  return true;
}

template <int kHeadDim, bool kHalves>
__global__ void __launch_bounds__(kExactFastWarps * 32) SkvExactScoreFastKernel(SkvDecodeParams p) {
  extern __shared__ __align__(16) unsigned char exact_fast_shared[];
  __shared__ int chunks[kExactFastChunks];
  __shared__ float inv_freq[kHeadDim / 2];
  __shared__ int count_shared;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kExactFastChunks;
  if (!StageFastCandidates(p, chunks, &count_shared, [](int, int) {})) return;
  for (int i = threadIdx.x; i < kHeadDim / 2; i += blockDim.x) inv_freq[i] = p.inv_freq[i];

  const SkvRowMeta m = p.meta[row];
  const int width = l.kv_width(), chunk_size = l.chunk_size, rank = ScoreRank(p, m.seq);
  const int64_t stride = l.rank;
  const int rank_padded = SkvRankPadded(rank);
  const int a_pitch = rank_padded + 8, pitch = kHeadDim + 8;
  const int64_t layer_index = static_cast<int64_t>(m.seq) * l.num_layers + p.layer;
  const int ring = ExactFastRingElements(l, rank), key_tiles = ExactFastKeyTiles(l);
  Bf16* b_tile = reinterpret_cast<Bf16*>(exact_fast_shared);
  Bf16* q_tile = b_tile + ExactFastBasisRows(l, rank) * pitch;
  Bf16* a_ring = q_tile + kExactFastHeads * pitch + warp * ring;
  Bf16* key_tile =
      q_tile + kExactFastHeads * pitch + kExactFastWarps * ring + warp * key_tiles * 16 * pitch;
  float* token_logits = reinterpret_cast<float*>(exact_fast_shared + ExactFastBf16Bytes(l));
  const bool stored = l.rerank_stored != 0;  // the keys come from the store, not A·B
  // bf16 runs, read by cp.async (the ring is sized for it whether or not it is used)
  const bool stored_async = stored && !l.fp8_keys && p.stored_key_prefetch != 0;
  if (!stored) {
    SkvStageBasis<kHeadDim>(l.basis + layer_index * stride * width + h * kHeadDim, width, rank,
                            b_tile, pitch);
  }
  const Bf16* q_row =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * kHeadDim;
  for (int i = threadIdx.x; i < kExactFastHeads * (kHeadDim / 8); i += blockDim.x) {
    const int head = i / (kHeadDim / 8), v = i % (kHeadDim / 8);
    const bool inside = head < l.group;
    CpAsync16(q_tile + head * pitch + v * 8,
              inside ? q_row + static_cast<int64_t>(head) * kHeadDim + v * 8 : q_row,
              inside ? 16 : 0);
  }
  CpAsyncCommit();
  __syncthreads();  // the chunk list and its count are visible

  const int count = count_shared, total_rows = count * chunk_size;
  const int num_tiles = (total_rows + 15) / 16;
  const Bf16* coefficients = l.coefficients + layer_index * l.capacity_chunks * chunk_size * stride;
  auto load_tile = [&](int tile, Bf16* target) {
    SkvLoadCoefficientTile(coefficients, stride, rank, chunk_size, chunks, total_rows, tile, target,
                           a_pitch);
  };
  auto load_keys = [&](int tile, int stage) {
    LoadStoredKeyTileAsync<kHeadDim>(l, m.seq, p.layer, h, chunks, total_rows, tile,
                                     key_tile + stage * 16 * pitch, pitch);
  };
  if (stored_async) {  // the warp's first kStoredStages - 1 tiles, a commit group each
    for (int stage = 0; stage < kStoredStages - 1; ++stage) {
      const int tile = warp + stage * kExactFastWarps;
      if (tile < num_tiles) load_keys(tile, stage);
      CpAsyncCommit();
    }
    CpAsyncWait<kStoredStages - 1>();  // this thread's share of B_h and the queries have landed
  } else {
    if (!stored && warp < num_tiles) load_tile(warp, a_ring);
    CpAsyncCommit();
    CpAsyncWait<1>();  // this thread's share of B_h and the queries have landed
  }
  __syncthreads();

  const int g = lane / 4, c2 = (lane % 4) * 2;
  int buffer = 0, step = 0;
  for (int tile = warp; tile < num_tiles; tile += kExactFastWarps, buffer ^= 1, ++step) {
    const Bf16* keys = key_tile;
    if (stored_async) {
      // Tile `step + kStoredStages - 1` of the warp goes in the stage freed by the last tile.
      const int ahead = tile + (kStoredStages - 1) * kExactFastWarps;
      if (ahead < num_tiles) load_keys(ahead, (step + kStoredStages - 1) % kStoredStages);
      CpAsyncCommit();
      CpAsyncWait<kStoredStages - 1>();
      __syncwarp();  // this warp's tile `step` has landed
      keys = key_tile + (step % kStoredStages) * 16 * pitch;
    } else if (stored) {
      LoadStoredKeyTile<kHeadDim>(l, m.seq, p.layer, h, chunks, total_rows, tile, key_tile, pitch);
    } else {
      if (tile + kExactFastWarps < num_tiles) {
        load_tile(tile + kExactFastWarps, a_ring + (buffer ^ 1) * 16 * a_pitch);
      }
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncwarp();  // this warp's A tile has landed
      auto position = [&](int r) {
        const int token_row = tile * 16 + r;
        const int which = min(token_row / chunk_size, count - 1), t = token_row % chunk_size;
        return static_cast<float>(chunks[which] * chunk_size + t);
      };
      SkvRebuildTile<kHeadDim, kHalves>(a_ring + buffer * 16 * a_pitch, a_pitch, b_tile, pitch,
                                        rank_padded, inv_freq, position, key_tile, pitch);
    }
    // logits [16 tokens, 16 heads] = keys · Qᵀ: matrices 0/1 of the x4 load are dims k0..k0+15
    // of heads 0-7, matrices 2/3 those of heads 8-15.
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int k0 = 0; k0 < kHeadDim; k0 += 16) {
      uint32_t a[4], b[4];
      LdMatrixX4(a, keys + (lane & 15) * pitch + k0 + (lane >> 4) * 8);
      LdMatrixX4(b, q_tile + ((lane >> 4) * 8 + (lane & 7)) * pitch + k0 + ((lane >> 3) & 1) * 8);
      MmaBf16(acc[0], a, b[0], b[1]);
      MmaBf16(acc[1], a, b[2], b[3]);
    }
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token_row = tile * 16 + g + 8 * (e >> 1), head = nb * 8 + c2 + (e & 1);
        if (token_row < total_rows && head < l.group)
          token_logits[token_row * l.group + head] = acc[nb][e] * p.scale;
      }
    }
    __syncwarp();  // the key tile (stage) is written again by a later tile
  }
  CpAsyncWait<0>();
  __syncthreads();
  WriteChunkLse(token_logits, count, chunk_size, l.group, l.max_candidates, first,
                p.candidate_lse +
                    (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * l.max_candidates);
}

// ---- FP8 stored keys scored as coded ------------------------------------------------------------
//
// A run of FP8 stored keys holds each key less its chunk's landmark L (codes times the run's
// scale s), so a candidate token's logit is
//   scale · q·(s · code + L) = s · (scale · q·code) + scale · q·L,
// and scale · q·L is the logit the landmark scoring wrote for the chunk at this step (p.logits;
// candidates are never outliers, whose logit is −∞). So the scorer multiplies the codes as they
// are, converted exactly to fp16, by the group's queries rounded to fp16 (saturated, as the FP8
// landmark scoring rounds them) on tensor cores with fp32 sums, and adds the landmark's logit:
// it reads a key's codes and nothing else, where decoding reads the landmark's elements too.
// A warp takes 16 token rows a tile; lane (g, c) holds dims [c·D/4, c·D/4 + D/4) of rows g and
// g + 8, and at mma step t gives dims c·D/4 + 4t .. + 3 as k = 2c, 2c + 1, 2c + 8, 2c + 9 (the
// query fragments permuted alike; a dot product ignores the order), so each lane reads its
// share of a row in 8- or 16-byte loads. A warp loads its next tile while it multiplies one.
// Head dims up to 128 (at 256 a lane's share of two tiles would not fit its registers).
template <int kHeadDim>
__global__ void __launch_bounds__(kExactFastWarps * 32) SkvExactScoreFp8Kernel(SkvDecodeParams p) {
  static_assert(kHeadDim % 32 == 0, "a lane's D/4 codes of a row are whole 8-byte words");
  constexpr int kSteps = kHeadDim / 16;  // mma steps; one 32-bit word of 4 codes each
  extern __shared__ __align__(16) unsigned char exact_fp8_shared[];
  __shared__ int chunks[kExactFastChunks];
  __shared__ float run_scale[kExactFastChunks];
  __shared__ int count_shared;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kExactFastChunks;
  const SkvRowMeta m = p.meta[row];
  // Each candidate's run scale, times the logits' scale.
  if (!StageFastCandidates(p, chunks, &count_shared, [&](int i, int chunk) {
        run_scale[i] = chunk >= 0 ? *l.KeyScale(m.seq, p.layer, h, chunk) * p.scale : 0.0f;
      })) {
    return;
  }
  const int group = l.group, chunk_size = l.chunk_size;
  // [kExactFastChunks * C, group] the tokens' logits, then [kExactFastChunks, group] the
  // landmarks' logits
  float* token_logits = reinterpret_cast<float*>(exact_fp8_shared);
  float* landmark_logits = token_logits + kExactFastChunks * chunk_size * group;
  const float* logits =
      p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * group * l.capacity_chunks;
  __syncthreads();  // the chunk list, its count and the scales are visible
  const int count = count_shared, total_rows = count * chunk_size;
  const int num_tiles = (total_rows + 15) / 16;
  for (int i = threadIdx.x; i < count * group; i += blockDim.x) {
    const int which = i / group, g = i % group;
    landmark_logits[i] = logits[static_cast<int64_t>(g) * l.capacity_chunks + chunks[which]];
  }

  const int g = lane / 4, c = lane % 4;
  // B fragments: column g of head tile nb is query head 8 · nb + g.
  uint32_t qb[2][kSteps][2];
  const Bf16* q_row =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * group * kHeadDim;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const int head = 8 * nb + g;
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      qb[nb][t][0] = qb[nb][t][1] = 0u;
      if (head < group) {
        const uint2 four = *reinterpret_cast<const uint2*>(q_row + head * kHeadDim +
                                                          c * (kHeadDim / 4) + 4 * t);
        const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&four.x));
        const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&four.y));
        qb[nb][t][0] = PackHalf2Saturated(low.x, low.y);
        qb[nb][t][1] = PackHalf2Saturated(high.x, high.y);
      }
    }
  }

  // A lane's codes of a tile: words [row g, row g + 8][kSteps].
  auto load_codes = [&](int tile, uint32_t (&words)[2][kSteps]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int token_row = min(tile * 16 + g + 8 * half, total_rows - 1);
      const uint8_t* from = l.KeyCodes(m.seq, p.layer, h, chunks[token_row / chunk_size]) +
                            static_cast<int64_t>(token_row % chunk_size) * kHeadDim +
                            c * (kHeadDim / 4);
      if constexpr (kSteps % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kSteps / 4; ++i) {
          const uint4 v = reinterpret_cast<const uint4*>(from)[i];
          words[half][4 * i] = v.x;
          words[half][4 * i + 1] = v.y;
          words[half][4 * i + 2] = v.z;
          words[half][4 * i + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kSteps / 2; ++i) {
          const uint2 v = reinterpret_cast<const uint2*>(from)[i];
          words[half][2 * i] = v.x;
          words[half][2 * i + 1] = v.y;
        }
      }
    }
  };
  uint32_t next[2][kSteps];
  if (warp < num_tiles) load_codes(warp, next);
  __syncthreads();  // the landmarks' logits are staged
  const bool two_tiles = group > 8;
  for (int tile = warp; tile < num_tiles; tile += kExactFastWarps) {
    uint32_t words[2][kSteps];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int t = 0; t < kSteps; ++t) words[half][t] = next[half][t];
    }
    if (tile + kExactFastWarps < num_tiles) load_codes(tile + kExactFastWarps, next);
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      uint32_t a[4];
      // word t of a row: dims d .. d + 3, d = c·D/4 + 4t; k = 2c, 2c + 1 then 2c + 8, 2c + 9
      a[0] = Fp8x2ToHalf2Bits(words[0][t]);  // row g
      a[1] = Fp8x2ToHalf2Bits(words[1][t]);  // row g + 8
      a[2] = Fp8x2ToHalf2Bits(words[0][t] >> 16);
      a[3] = Fp8x2ToHalf2Bits(words[1][t] >> 16);
      MmaF16(acc[0], a, qb[0][t][0], qb[0][t][1]);
      if (two_tiles) MmaF16(acc[1], a, qb[1][t][0], qb[1][t][1]);
    }
    // acc[nb]: (row g, head 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1), heads from 8 · nb.
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token_row = tile * 16 + g + 8 * (e >> 1), head = nb * 8 + 2 * c + (e & 1);
        if (token_row < total_rows && head < group) {
          const int which = token_row / chunk_size;
          token_logits[token_row * group + head] =
              fmaf(acc[nb][e], run_scale[which], landmark_logits[which * group + head]);
        }
      }
    }
  }
  __syncthreads();
  WriteChunkLse(token_logits, count, chunk_size, group, l.max_candidates, first,
                p.candidate_lse +
                    (static_cast<int64_t>(row) * l.num_kv_heads + h) * group * l.max_candidates);
}

// Shared memory of one SkvExactScoreFp8Kernel block: its tokens' and its chunks' logits, fp32.
int64_t ExactFp8SharedBytes(const SkvLayout& l) {
  return 4ll * kExactFastChunks * (l.chunk_size + 1) * l.group;
}

// Whether the re-rank scores FP8 stored keys as coded (SkvExactScoreFp8Kernel): the fast kernels,
// stored FP8 keys read ahead (stored_key_prefetch), head dims up to 128; other FP8 stores are
// decoded into key tiles.
bool ScoresFp8AsCoded(const SkvDecodeParams& p) {
  const SkvLayout& l = p.layout;
  return l.rerank_stored && l.fp8_keys && p.stored_key_prefetch != 0 && l.head_dim <= 128;
}

// The tensor-core scorer's instance for (head dim, RoPE style).
template <int kHeadDim>
const void* ExactFastForm(bool halves) {
  return halves ? reinterpret_cast<const void*>(SkvExactScoreFastKernel<kHeadDim, true>)
                : reinterpret_cast<const void*>(SkvExactScoreFastKernel<kHeadDim, false>);
}

// The tensor-core scorer for (head_dim, RoPE style, stored keys) and its shared bytes, or null
// where it does not apply (the first kernels, partial rotary, head dims other than 64, 96, 128
// and 256, groups above 16 heads).
const void* ExactFastKernel(const SkvDecodeParams& p, int64_t* shared_bytes) {
  const SkvLayout& l = p.layout;
  if (p.kernel_variant != kSkvKernelsFast || p.rotary_dim != l.head_dim || !ExactFastGroupFits(l))
    return nullptr;
  if (ScoresFp8AsCoded(p)) {
    *shared_bytes = ExactFp8SharedBytes(l);
    switch (l.head_dim) {
      case 64:
        return reinterpret_cast<const void*>(SkvExactScoreFp8Kernel<64>);
      case 96:
        return reinterpret_cast<const void*>(SkvExactScoreFp8Kernel<96>);
      case 128:
        return reinterpret_cast<const void*>(SkvExactScoreFp8Kernel<128>);
      default:
        return nullptr;
    }
  }
  *shared_bytes = ExactFastSharedBytes(l);
  switch (l.head_dim) {
    case 64:
      return ExactFastForm<64>(p.halves);
    case 96:
      return ExactFastForm<96>(p.halves);
    case 128:
      return ExactFastForm<128>(p.halves);
    case 256:
      return ExactFastForm<256>(p.halves);
    default:
      return nullptr;
  }
}

}  // namespace

cudaError_t SkvConfigureRerank(const SkvLayout& l) {
  int limit = 0;
  cudaError_t e = SkvSharedMemoryLimit(&limit);
  if (e != cudaSuccess) return e;
  if ((e = SkvConfigureRerankSelect(l, limit)) != cudaSuccess) return e;
  const int64_t exact = ExactSharedBytes(l);
  // The CUDA-core scorer (ExactGenericFits) serves what the tensor-core one does not (the first
  // kernels, partial rotary); a layout neither takes is refused here.
  const bool generic = ExactGenericFits(l) && exact <= limit;
  const bool fast = SkvHeadDimSupported(l.head_dim) && ExactFastGroupFits(l);
  if (!generic && !fast) return cudaErrorInvalidValue;
  if (generic) {
    e = AllowDynamicSharedMemory(reinterpret_cast<const void*>(SkvExactScoreKernel),
                                 static_cast<int>(exact));
    if (e != cudaSuccess) return e;
  }
  if (fast) {
    if (ExactFastSharedBytes(l) > limit) return cudaErrorInvalidValue;
    const int fast_bytes = static_cast<int>(ExactFastSharedBytes(l));
    for (const bool halves : {false, true}) {
      for (const void* kernel : {ExactFastForm<64>(halves), ExactFastForm<96>(halves),
                                 ExactFastForm<128>(halves), ExactFastForm<256>(halves)}) {
        if ((e = AllowDynamicSharedMemory(kernel, fast_bytes)) != cudaSuccess) return e;
      }
    }
    if (l.fp8_keys) {
      const int fp8_bytes = static_cast<int>(ExactFp8SharedBytes(l));
      for (const void* kernel : {reinterpret_cast<const void*>(SkvExactScoreFp8Kernel<64>),
                                 reinterpret_cast<const void*>(SkvExactScoreFp8Kernel<96>),
                                 reinterpret_cast<const void*>(SkvExactScoreFp8Kernel<128>)}) {
        if ((e = AllowDynamicSharedMemory(kernel, fp8_bytes)) != cudaSuccess) return e;
      }
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchSkvRerank(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  if (!p.candidates || !p.candidate_lse || l.max_candidates < 1) return cudaErrorInvalidValue;
  cudaError_t error = cudaSuccess;
  int64_t fast_bytes = 0;
  if (const void* fast = ExactFastKernel(p, &fast_bytes)) {
    if (ScoresFp8AsCoded(p) && !p.logits) return cudaErrorInvalidValue;  // landmark logits
    const dim3 grid((l.max_candidates + kExactFastChunks - 1) / kExactFastChunks, l.num_kv_heads,
                    p.rows);
    SkvDecodeParams params = p;
    void* args[] = {&params};
    error = cudaLaunchKernel(fast, grid, dim3(kExactFastWarps * 32), args,
                             static_cast<size_t>(fast_bytes), stream);
  } else {
    if (!ExactGenericFits(l)) return cudaErrorInvalidValue;  // e.g. head_dim 96, first kernels
    const int per_block = ExactChunksPerBlock(l.chunk_size);
    const dim3 exact_grid((l.max_candidates + per_block - 1) / per_block, l.num_kv_heads, p.rows);
    SkvExactScoreKernel<<<exact_grid, kExactThreads, ExactSharedBytes(l), stream>>>(p);
    error = cudaGetLastError();
  }
  if (error != cudaSuccess) return error;
  return LaunchSkvRerankSelect(p, stream);
}

}  // namespace shadowkv::cuda
