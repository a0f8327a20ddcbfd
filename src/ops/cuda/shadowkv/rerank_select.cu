// The re-rank's select (selection "rerank", after rerank.cu's scorers): from each candidate
// chunk's log-sum-exps per query head, the softmax over every candidate token, each chunk's mass
// (the max over the GQA group), the best K by radix select, and the gather slots they take.
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/shadowkv/gather_slots.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"

namespace shadowkv::cuda {
namespace {

// Threads of a re-rank select block: one per gather slot at least (AssignGatherSlots), 256 for
// budgets up to 256 chunks, else 1024.
constexpr int kRerankThreadsSmall = 256;
constexpr int kRerankThreads = 1024;
int RerankThreads(const SkvLayout& l) {
  return l.max_budget <= kRerankThreadsSmall ? kRerankThreadsSmall : kRerankThreads;
}

int64_t RerankSharedBytes(const SkvLayout& l) {
  // The candidates' scores and the candidates, the kept list and the free slots, the wanted
  // bitmap, each query head's log-sum-exp over all candidates, the draw's scratch.
  return 8ll * l.max_candidates + 8ll * l.max_budget + 4ll * ((l.capacity_chunks + 31) / 32) +
         4ll * l.group + SkvSampleSharedBytes(l.capacity_chunks, l.max_sample);
}

// One block per (KV head, row): per query head the softmax over every candidate token, a
// chunk's score the sum of its tokens' probabilities (exp(chunk lse − all lse)), the max over
// the group; the chunk ranks below K by (score, lower index first) are kept, in index order,
// and take the gather slots.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) SkvRerankSelectKernel(SkvDecodeParams p) {
  using Scan = cub::BlockScan<int, kThreads>;
  extern __shared__ uint32_t rerank_shared[];
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int count_shared, histogram[256], remaining_shared;
  __shared__ uint32_t prefix_shared;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const SkvRowMeta m = p.meta[row];
  if (SkvKeepsChunks(p, m, row, h)) return;  // the slots keep the chunks of the last selecting step
  const SkvSequenceInfo info = l.info[m.seq];
  const int words = (l.capacity_chunks + 31) / 32;
  float* score = reinterpret_cast<float*>(rerank_shared);
  int* candidate = reinterpret_cast<int*>(score + l.max_candidates);
  int* selected = candidate + l.max_candidates;
  int* free_slots = selected + l.max_budget;
  uint32_t* wanted = reinterpret_cast<uint32_t*>(free_slots + l.max_budget);
  float* all = reinterpret_cast<float*>(wanted + words);  // [group]
  const int32_t* list =
      p.candidates + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_candidates;
  int32_t* miss = p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  int32_t* slot_chunk = l.slot_chunk + l.HeadIndex(m.seq, p.layer, h) * l.max_budget;
  if (tid == 0) count_shared = l.max_candidates;
  __syncthreads();
  for (int i = tid; i < l.max_candidates; i += kThreads) {
    const int chunk = list[i];
    candidate[i] = chunk;
    if (chunk < 0 && (i == 0 || list[i - 1] >= 0)) count_shared = i;  // the list is packed
  }
  for (int w = tid; w < words; w += kThreads) wanted[w] = 0;
  for (int s = tid; s < l.max_budget; s += kThreads) miss[s] = -1;
  __syncthreads();
  const int count = count_shared;
  const float* lse = p.candidate_lse +
                     (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.group * l.max_candidates;
  // Each query head's log-sum-exp over every candidate, one warp per head.
  for (int g = warp; g < l.group; g += kThreads / 32) {
    const float* x = lse + static_cast<int64_t>(g) * l.max_candidates;
    float top = -INFINITY;
    for (int i = lane; i < count; i += 32) top = fmaxf(top, x[i]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
    float sum = 0.0f;
    for (int i = lane; i < count; i += 32) sum += expf(x[i] - top);
    sum = WarpSum(sum);
    if (lane == 0) all[g] = top + logf(sum);
  }
  __syncthreads();
  // Scores are probabilities (>= 0).
  for (int i = tid; i < count; i += kThreads) {
    float best = 0.0f;
    for (int g = 0; g < l.group; ++g) {
      best = fmaxf(best, expf(lse[static_cast<int64_t>(g) * l.max_candidates + i] - all[g]));
    }
    score[i] = best;
  }
  __syncthreads();
  // Keep the best K by (score, lower index first): the K-th largest score by radix select
  // (scores are >= 0, so their bits order like them; + 1 keeps 0 for "none"), then every
  // candidate above it and the first ties, placed in index order (candidates are in index order).
  // Under select_sample the chunks drawn, from every selectable chunk (all but the outliers)
  // not kept, take the last places of the budget.
  const int drawn = SkvDrawnChunks(l, info, m.num_chunks - info.outlier_chunks);
  const int k = min(info.budget_chunks, count) - drawn;
  auto key_of = [&](int i) { return __float_as_uint(score[i]) + 1u; };
  int ties_allowed = 0;
  const uint32_t threshold = SkvRadixKthKey(key_of, count, k, histogram, &prefix_shared,
                                            &remaining_shared, &ties_allowed);
  if (k > 0) {
    SkvTakeInIndexOrder<Scan>(scan_storage, key_of, count, threshold, ties_allowed,
                              [&](int place, int i) {
                                const int chunk = candidate[i];
                                selected[place] = chunk;
                                atomicOr(&wanted[chunk >> 5], 1u << (chunk & 31));
                              });
  }
  __syncthreads();
  const uint8_t* outlier = l.outlier + l.ChunkIndex(m.seq, p.layer, h, 0);
  auto live_word = [&](int w) {
    return SkvLiveWord(m.num_chunks, w, [&](int c) { return outlier[c] == 0; });
  };
  SkvFinishSelection<Scan>(scan_storage, p, m, info, h, k, drawn, live_word, selected, wanted,
                           free_slots, reinterpret_cast<int*>(all + l.group), slot_chunk, miss);
}

const void* RerankSelectKernel(const SkvLayout& l) {
  return RerankThreads(l) == kRerankThreadsSmall
             ? reinterpret_cast<const void*>(SkvRerankSelectKernel<kRerankThreadsSmall>)
             : reinterpret_cast<const void*>(SkvRerankSelectKernel<kRerankThreads>);
}

}  // namespace

cudaError_t SkvConfigureRerankSelect(const SkvLayout& l, int limit) {
  const int64_t select = RerankSharedBytes(l);
  if (select + static_cast<int64_t>(sizeof(cub::BlockScan<int, kRerankThreads>::TempStorage)) +
              1024 >
          limit ||
      l.max_candidates > kSkvMaxRerankCandidates || l.max_budget > kRerankThreads) {
    return cudaErrorInvalidValue;
  }
  return AllowDynamicSharedMemory(RerankSelectKernel(l), static_cast<int>(select));
}

cudaError_t LaunchSkvRerankSelect(const SkvDecodeParams& p, cudaStream_t stream) {
  const SkvLayout& l = p.layout;
  SkvDecodeParams params = p;
  void* args[] = {&params};
  return cudaLaunchKernel(RerankSelectKernel(l), dim3(l.num_kv_heads, p.rows),
                          dim3(RerankThreads(l)), args, static_cast<size_t>(RerankSharedBytes(l)),
                          stream);
}

}  // namespace shadowkv::cuda
