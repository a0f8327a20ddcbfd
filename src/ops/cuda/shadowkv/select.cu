// The second-version ShadowKV select (kSkvKernelsFast): combines the scoring blocks' softmax
// statistics, reads the logits once, finds the K-th key by radix select (a 12-bit first digit
// counted while the keys are written, the later digits over its candidates; or four 8-bit
// digits over every key, kept to compare) and assigns the gather slots.
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/shadowkv/gather_slots.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"

namespace shadowkv::cuda {
namespace {

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
  int* free_slots = selected + max(l.max_budget, l.max_candidates);
  int32_t* miss = p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  int32_t* slot_chunk = l.slot_chunk + l.HeadIndex(m.seq, p.layer, h) * l.max_budget;
  for (int w = tid; w < words; w += kThreads) wanted[w] = 0;
  for (int s = tid; s < l.max_budget; s += kThreads) miss[s] = -1;
  if (SkvKeepsChunks(p, m, row, h)) return;  // the slots keep the chunks of the last selecting step
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
  const int drawn = p.candidates ? 0 : SkvDrawnChunks(l, info, selectable);
  const int k = min(SkvSelectWanted(p, info.budget_chunks), selectable) - drawn;
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
      SkvRadixDigit([&](int c) { return source[c]; }, count, shift, mask, histogram, &prefix_shared,
                    &remaining_shared);
      mask |= 255u << shift;
    }
  } else {
    __syncthreads();
    for (int shift = 24; shift >= 0 && k > 0; shift -= 8) {
      SkvRadixDigit([&](int c) { return keys[c]; }, n, shift, mask, histogram, &prefix_shared,
                    &remaining_shared);
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

  if (p.candidates) {
    SkvWriteCandidates(p, row, h, k, selected);
    return;
  }
  SkvFinishSelection<SelectScan>(
      scan_storage, p, m, info, h, k, drawn, [&](int w) { return SkvKeysLiveWord(keys, n, w); },
      selected, wanted, free_slots, free_slots + l.max_budget, slot_chunk, miss);
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
    case 16: return reinterpret_cast<const void*>(SkvSelectFastKernel<16, kThreads, kCoarse, kMinBlocks>);
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

cudaError_t SkvConfigureSelectFast(const SkvLayout& l, int64_t dynamic_bytes) {
  if (l.capacity_chunks >= 32768) return cudaErrorInvalidValue;  // packed scan counts
  for (bool coarse : {false, true}) {
    for (bool roomy : {false, true}) {
      if (roomy && !SelectRoomy(l, coarse, 0)) continue;
      if (const void* select = SelectFastKernel(l, coarse, roomy)) {
        const cudaError_t e = AllowDynamicSharedMemory(select, static_cast<int>(dynamic_bytes));
        if (e != cudaSuccess) return e;
      }
    }
  }
  return cudaSuccess;
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
