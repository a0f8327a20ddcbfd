// ShadowKV per-query-head selection (selection "heads"): each query head of a GQA group ranks
// the chunks by its own landmark softmax, and the group takes them round-robin, each head its
// best chunk not yet taken, until K distinct chunks fill the KV head's gather slots.
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/shadowkv/gather_slots.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kHeadsThreads = 1024;
constexpr int kMaxHeadsGroup = kSkvMaxGroup;  // query heads per KV head
// Entries of the group's top-K lists one thread ranks: kMaxHeadsGroup · K / kHeadsThreads.
constexpr int kRanksPerThread = kMaxHeadsGroup * kSkvMaxBudgetChunks / kHeadsThreads;
using HeadsScan = cub::BlockScan<int, kHeadsThreads>;

int64_t HeadsSharedBytes(const SkvLayout& l) {
  // Each head's top-K chunks and their keys, the wanted bitmap, the selected list, free slots.
  return 4ll * (2ll * l.group * l.max_budget + (l.capacity_chunks + 31) / 32 + 2ll * l.max_budget);
}

// One block per (KV head, row). Per query head g: its softmax over the selectable chunks (the
// landmarks select's score with the group's max left out), the K-th largest of its radix keys
// (score bits + 1; 0 = not selectable) by four 8-bit digits, and its top K (ties: the lower
// chunk) ranked by counting. Then one thread takes them round-robin over the heads, skipping
// what is taken; no head's list runs out first, since all K of a list taken means K taken. The
// chosen chunks, in index order, take the gather slots as the landmarks select's do.
__global__ void __launch_bounds__(kHeadsThreads) SkvSelectHeadsKernel(SkvDecodeParams p) {
  extern __shared__ uint32_t heads_shared[];
  __shared__ typename HeadsScan::TempStorage scan_storage;
  __shared__ float reduce[32];
  __shared__ int histogram[256];
  __shared__ uint32_t prefix_shared;
  __shared__ int remaining_shared;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, group = l.group;
  const SkvRowMeta m = p.meta[row];
  const SkvSequenceInfo info = l.info[m.seq];
  const int n = m.num_chunks, budget = l.max_budget;
  const int words = (l.capacity_chunks + 31) / 32;
  int* list_chunk = reinterpret_cast<int*>(heads_shared);  // [group, budget]
  uint32_t* list_key = heads_shared + group * budget;      // [group, budget], then sorted chunks
  uint32_t* wanted = list_key + group * budget;
  int* selected = reinterpret_cast<int*>(wanted + words);
  int* free_slots = selected + budget;
  const float* logits =
      p.logits + (static_cast<int64_t>(row) * l.num_kv_heads + h) * group * l.capacity_chunks;
  int32_t* miss = p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * budget;
  int32_t* slot_chunk = l.slot_chunk + l.HeadIndex(m.seq, p.layer, h) * budget;
  for (int w = tid; w < words; w += kHeadsThreads) wanted[w] = 0;
  for (int s = tid; s < budget; s += kHeadsThreads) miss[s] = -1;
  if (SkvKeepsChunks(p, m, row, h)) return;  // the slots keep the chunks of the last selecting step
  int selectable_local = 0;
  for (int c = tid; c < n; c += kHeadsThreads) selectable_local += logits[c] != -INFINITY;
  const int selectable = static_cast<int>(BlockSum(static_cast<float>(selectable_local), reduce));
  const int k = min(info.budget_chunks, selectable);

  for (int g = 0; g < group && k > 0; ++g) {
    const float* x = logits + static_cast<int64_t>(g) * l.capacity_chunks;
    float local = -INFINITY;
    for (int c = tid; c < n; c += kHeadsThreads) local = fmaxf(local, x[c]);
    const float top = SkvBlockMax(local, reduce);
    float sum = 0.0f;
    for (int c = tid; c < n; c += kHeadsThreads) sum += x[c] == -INFINITY ? 0.0f : expf(x[c] - top);
    const float inv = 1.0f / BlockSum(sum, reduce);
    auto key_of = [&](int c) {
      return x[c] == -INFINITY ? 0u : __float_as_uint(expf(x[c] - top) * inv) + 1u;
    };
    int ties_allowed = 0;
    const uint32_t threshold =
        SkvRadixKthKey(key_of, n, k, histogram, &prefix_shared, &remaining_shared, &ties_allowed);
    // Head g's top k in index order.
    SkvTakeInIndexOrder<HeadsScan>(scan_storage, key_of, n, threshold, ties_allowed,
                                   [&](int place, int c) {
                                     list_chunk[g * budget + place] = c;
                                     list_key[g * budget + place] = key_of(c);
                                   });
  }
  __syncthreads();
  // Each list in descending key order (ties: the lower chunk), into list_key's words.
  int order[kRanksPerThread], chunk_at[kRanksPerThread];
#pragma unroll
  for (int j = 0; j < kRanksPerThread; ++j) {
    const int entry = tid + j * kHeadsThreads, g = entry / max(k, 1), i = entry % max(k, 1);
    order[j] = -1;
    if (k > 0 && g < group) {
      const uint32_t own = list_key[g * budget + i];
      const int chunk = list_chunk[g * budget + i];
      int before = 0;
      for (int other = 0; other < k; ++other) {
        const uint32_t key = list_key[g * budget + other];
        before += key > own || (key == own && list_chunk[g * budget + other] < chunk);
      }
      order[j] = g * budget + before;
      chunk_at[j] = chunk;
    }
  }
  __syncthreads();
  int* sorted = reinterpret_cast<int*>(list_key);
#pragma unroll
  for (int j = 0; j < kRanksPerThread; ++j) {
    if (order[j] >= 0) sorted[order[j]] = chunk_at[j];
  }
  __syncthreads();
  if (tid == 0) {
    int next[kMaxHeadsGroup] = {};
    int taken = 0;
    while (taken < k) {
      for (int g = 0; g < group && taken < k; ++g) {
        int chunk = sorted[g * budget + next[g]];
        while (wanted[chunk >> 5] >> (chunk & 31) & 1u) chunk = sorted[g * budget + ++next[g]];
        wanted[chunk >> 5] |= 1u << (chunk & 31);
        ++next[g];
        ++taken;
      }
    }
  }
  __syncthreads();
  // The chosen chunks in index order.
  int carry = 0;
  for (int base = 0; base < n && k > 0; base += kHeadsThreads) {
    const int c = base + tid;
    const int chosen = c < n && (wanted[c >> 5] >> (c & 31) & 1u);
    int before = 0, total = 0;
    HeadsScan(scan_storage).ExclusiveSum(chosen, before, total);
    if (chosen) selected[carry + before] = c;
    carry += total;
    __syncthreads();
  }
  AssignGatherSlots<HeadsScan>(scan_storage, info.budget_chunks, k, n, selected, wanted, free_slots,
                               slot_chunk, miss, l.SequenceCounters(m.seq));
}

}  // namespace

cudaError_t SkvConfigureSelectHeads(const SkvLayout& l) {
  int limit = 0;
  cudaError_t e = SkvSharedMemoryLimit(&limit);
  if (e != cudaSuccess) return e;
  const int64_t bytes = HeadsSharedBytes(l);
  if (bytes + static_cast<int64_t>(sizeof(HeadsScan::TempStorage)) + 2048 > limit ||
      l.group > kMaxHeadsGroup || l.max_budget > kSkvMaxBudgetChunks) {
    return cudaErrorInvalidValue;
  }
  return AllowDynamicSharedMemory(reinterpret_cast<const void*>(SkvSelectHeadsKernel),
                                  static_cast<int>(bytes));
}

cudaError_t LaunchSkvSelectHeads(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  SkvSelectHeadsKernel<<<dim3(l.num_kv_heads, p.rows), kHeadsThreads, HeadsSharedBytes(l),
                         stream>>>(p);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
