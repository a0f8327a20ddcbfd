// ShadowKV re-ranking (selection "rerank"): the candidates a landmark select kept are scored by
// their rebuilt keys (exact attention logits), and the best K of them take the gather slots.
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/shadowkv/gather_slots.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"

namespace shadowkv::cuda {
namespace {

using Bf16 = __nv_bfloat16;

// ---- exact scoring ----------------------------------------------------------------------------

constexpr int kExactThreads = 128;
constexpr int kExactTokens = 32;  // candidate tokens per block (whole chunks)

__host__ __device__ constexpr int ExactChunksPerBlock(int chunk_size) {
  return chunk_size >= kExactTokens ? 1 : kExactTokens / chunk_size;
}

// Shared memory of one exact-scoring block: its chunks' A rows up to the layout's rank, their
// rotated keys and the group's queries, fp32.
int64_t ExactSharedBytes(const SkvLayout& l) {
  const int64_t tokens = int64_t{ExactChunksPerBlock(l.chunk_size)} * l.chunk_size;
  return 4 * (tokens * l.rank + tokens * l.head_dim + int64_t{l.group} * l.head_dim);
}

// One block per (ExactChunksPerBlock candidates, KV head, row). Keys: thread (pair, token
// group) rebuilds one rotary pair of its tokens from the staged A rows and B_h (read through the
// cache), up to the layer's own rank; then one warp per token scores it against every query of
// the group. No key leaves the block: the kept chunks are rebuilt into their gather slots by
// the ordinary rebuild, and only the logits go to memory.
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
  const int rank = l.RankOf(m.seq, p.layer), width = l.kv_width();
  const int64_t stride = l.rank, layer_index = static_cast<int64_t>(m.seq) * l.num_layers + p.layer;
  const int tokens = per_block * chunk_size;
  float* a_rows = exact_shared;                                  // [tokens, l.rank]
  float* keys = a_rows + static_cast<int64_t>(tokens) * l.rank;  // [tokens, d]
  float* queries = keys + tokens * d;                            // [group, d]

  const Bf16* coefficients = l.coefficients + layer_index * l.capacity_chunks * chunk_size * stride;
  for (int i = threadIdx.x; i < tokens * rank; i += blockDim.x) {
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

  const Bf16* basis = l.basis + layer_index * stride * width + h * d;
  const int pairs = d / 2, token_groups = kExactThreads / pairs;
  const int pair = threadIdx.x % pairs;
  int dim_a, dim_b;
  SkvRopePairDims(pair, p.rotary_dim, p.halves, &dim_a, &dim_b);
  const bool rotates = pair < p.rotary_dim / 2;
  for (int token = threadIdx.x / pairs; token < tokens; token += token_groups) {
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
  const int64_t span = static_cast<int64_t>(l.max_candidates) * chunk_size;
  float* out = p.exact_logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * span;
  for (int token = warp; token < tokens; token += kExactThreads / 32) {
    const int which = token / chunk_size;
    if (which >= chunks || candidates[first + which] < 0) continue;
    for (int g = 0; g < l.group; ++g) {
      float dot = 0.0f;
      for (int e = lane; e < d; e += 32) dot = fmaf(keys[token * d + e], queries[g * d + e], dot);
      dot = WarpSum(dot);
      if (lane == 0)
        out[g * span + static_cast<int64_t>(first) * chunk_size + token] = dot * p.scale;
    }
  }
}

// ---- re-rank select ---------------------------------------------------------------------------

constexpr int kRerankThreads = 1024;
using RerankScan = cub::BlockScan<int, kRerankThreads>;

int64_t RerankSharedBytes(const SkvLayout& l) {
  // Candidates and their scores, the kept list and the free slots, the wanted bitmap.
  return 8ll * l.max_candidates + 8ll * l.max_budget + 4ll * ((l.capacity_chunks + 31) / 32);
}

// One block per (KV head, row): per query head the softmax over every candidate token, a
// chunk's score the sum of its tokens' probabilities, the max over the group; the chunk ranks
// below K by (score, lower index first) are kept, in index order, and take the gather slots.
__global__ void __launch_bounds__(kRerankThreads) SkvRerankSelectKernel(SkvDecodeParams p) {
  extern __shared__ uint32_t rerank_shared[];
  __shared__ typename RerankScan::TempStorage scan_storage;
  __shared__ float reduce[32];
  const SkvLayout& l = p.layout;
  const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, chunk_size = l.chunk_size;
  const SkvRowMeta m = p.meta[row];
  const SkvSequenceInfo info = l.info[m.seq];
  const int words = (l.capacity_chunks + 31) / 32;
  int* candidate = reinterpret_cast<int*>(rerank_shared);
  float* score = reinterpret_cast<float*>(candidate + l.max_candidates);
  int* selected = reinterpret_cast<int*>(score + l.max_candidates);
  int* free_slots = selected + l.max_budget;
  uint32_t* wanted = reinterpret_cast<uint32_t*>(free_slots + l.max_budget);
  const int32_t* list =
      p.candidates + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_candidates;
  int32_t* miss = p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  int32_t* slot_chunk = l.slot_chunk + l.HeadIndex(m.seq, p.layer, h) * l.max_budget;
  int held = 0;
  for (int i = tid; i < l.max_candidates; i += kRerankThreads) {
    candidate[i] = list[i];
    score[i] = 0.0f;
    held += list[i] >= 0;
  }
  for (int w = tid; w < words; w += kRerankThreads) wanted[w] = 0;
  for (int s = tid; s < l.max_budget; s += kRerankThreads) miss[s] = -1;
  const int count = static_cast<int>(BlockSum(static_cast<float>(held), reduce));
  const int tokens = count * chunk_size;
  const int64_t span = static_cast<int64_t>(l.max_candidates) * chunk_size;
  const float* logits =
      p.exact_logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * span;
  for (int g = 0; g < l.group; ++g) {
    const float* x = logits + g * span;
    float local = -INFINITY;
    for (int t = tid; t < tokens; t += kRerankThreads) local = fmaxf(local, x[t]);
    const float top = SkvBlockMax(local, reduce);
    float sum = 0.0f;
    for (int t = tid; t < tokens; t += kRerankThreads) sum += expf(x[t] - top);
    const float inv = 1.0f / BlockSum(sum, reduce);
    for (int i = tid; i < count; i += kRerankThreads) {
      float mass = 0.0f;
      for (int t = 0; t < chunk_size; ++t) mass += expf(x[i * chunk_size + t] - top) * inv;
      score[i] = fmaxf(score[i], mass);
    }
    __syncthreads();  // each candidate's score is one thread's; the next head reads it again
  }
  // Keep rank < K, a chunk's rank counting the better ones and the equal ones of lower index
  // (candidates are in index order), then place the kept in index order.
  const int k = min(info.budget_chunks, count);
  int carry = 0;
  for (int base = 0; base < count; base += kRerankThreads) {
    const int i = base + tid;
    int keep = 0;
    if (i < count) {
      const float own = score[i];
      int better = 0;
      for (int j = 0; j < count && better < k; ++j) {
        const float other = score[j];
        better += other > own || (other == own && j < i);
      }
      keep = better < k;
    }
    int before = 0, total = 0;
    RerankScan(scan_storage).ExclusiveSum(keep, before, total);
    if (keep) {
      const int chunk = candidate[i];
      selected[carry + before] = chunk;
      atomicOr(&wanted[chunk >> 5], 1u << (chunk & 31));
    }
    carry += total;
    __syncthreads();  // the scan storage is used again
  }
  AssignGatherSlots<RerankScan>(scan_storage, info.budget_chunks, k, m.num_chunks, selected, wanted,
                                free_slots, slot_chunk, miss, l.SequenceCounters(m.seq));
}

}  // namespace

cudaError_t SkvConfigureRerank(const SkvLayout& l) {
  int limit = 0;
  cudaError_t e = SkvSharedMemoryLimit(&limit);
  if (e != cudaSuccess) return e;
  const int64_t exact = ExactSharedBytes(l), select = RerankSharedBytes(l);
  if (exact > limit ||
      select + static_cast<int64_t>(sizeof(RerankScan::TempStorage)) + 1024 > limit ||
      l.max_candidates > kSkvMaxRerankCandidates || l.max_budget > kRerankThreads ||
      kExactThreads % (l.head_dim / 2) != 0) {
    return cudaErrorInvalidValue;
  }
  e = AllowDynamicSharedMemory(reinterpret_cast<const void*>(SkvExactScoreKernel),
                               static_cast<int>(exact));
  if (e != cudaSuccess) return e;
  return AllowDynamicSharedMemory(reinterpret_cast<const void*>(SkvRerankSelectKernel),
                                  static_cast<int>(select));
}

cudaError_t LaunchSkvRerank(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  if (!p.candidates || !p.exact_logits || l.max_candidates < 1) return cudaErrorInvalidValue;
  const int per_block = ExactChunksPerBlock(l.chunk_size);
  const dim3 exact_grid((l.max_candidates + per_block - 1) / per_block, l.num_kv_heads, p.rows);
  SkvExactScoreKernel<<<exact_grid, kExactThreads, ExactSharedBytes(l), stream>>>(p);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  SkvRerankSelectKernel<<<dim3(l.num_kv_heads, p.rows), kRerankThreads, RerankSharedBytes(l),
                          stream>>>(p);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
