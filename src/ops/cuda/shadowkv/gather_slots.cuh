// Device code shared by the ShadowKV select kernels: the gather-slot assignment that follows
// the top-K choice (hits keep their slot, misses fill the free slots in slot order), the chunks
// drawn at random beside it (select_sample), and the block-wide pieces of a top-K by radix
// select.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {

// Max over a block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory; the call contains barriers.
__device__ __forceinline__ float SkvBlockMax(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : -INFINITY;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// Warp 0 of a radix select, all its lanes: given the 256-bin histogram of one 8-bit digit at
// `shift` (of the keys that match `prefix` above it), narrows `*prefix_shared` to the bin that
// holds the `*remaining_shared`-th largest key and `*remaining_shared` to its rank within the
// bin. Lane L owns bins [8L, 8L + 8); the chosen bin is the highest whose count from the top
// reaches `remaining`. The caller's next barrier makes the results visible.
__device__ __forceinline__ void SkvChooseRadixBin(const int* histogram, int shift, uint32_t prefix,
                                                  uint32_t* prefix_shared, int* remaining_shared) {
  const int lane = threadIdx.x & 31;
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

// One 8-bit radix digit at `shift` of the k-th largest non-zero key of key_of(c), c in
// [0, count): counts the keys that equal `*prefix_shared` under `mask` into `histogram` (256
// ints), then narrows `*prefix_shared` to the chosen bin and `*remaining_shared` to the rank
// within it. Scores share few exponents, so most keys of a warp fall in a handful of bins:
// lanes with the same bin add once. Every thread calls it; it contains barriers, the last of
// which makes the results visible.
template <typename KeyOf>
__device__ __forceinline__ void SkvRadixDigit(KeyOf&& key_of, int count, int shift, uint32_t mask,
                                              int* histogram, uint32_t* prefix_shared,
                                              int* remaining_shared) {
  const int tid = threadIdx.x, lane = tid & 31;
  for (int b = tid; b < 256; b += blockDim.x) histogram[b] = 0;
  __syncthreads();
  const uint32_t prefix = *prefix_shared;
  for (int base = 0; base < count; base += blockDim.x) {  // whole warps: the match needs them
    const int c = base + tid;
    const uint32_t key = c < count ? key_of(c) : 0u;
    const bool counted = key != 0u && (key & mask) == prefix;
    const uint32_t bin = counted ? (key >> shift) & 255u : 256u;
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (counted && lane == __ffs(peers) - 1) atomicAdd(&histogram[bin], __popc(peers));
  }
  __syncthreads();
  if (tid < 32) SkvChooseRadixBin(histogram, shift, prefix, prefix_shared, remaining_shared);
  __syncthreads();
}

// The k-th largest non-zero key of key_of(c), c in [0, n), by four 8-bit radix digits (k from
// 1 to the number of non-zero keys; 0 leaves it 0): returns it, and in *ties_allowed how many
// of the keys equal to it are among the k (the first ones in index order). Every thread calls
// it; it contains barriers, the last of which makes the result visible.
template <typename KeyOf>
__device__ __forceinline__ uint32_t SkvRadixKthKey(KeyOf&& key_of, int n, int k, int* histogram,
                                                   uint32_t* prefix_shared, int* remaining_shared,
                                                   int* ties_allowed) {
  if (threadIdx.x == 0) {
    *prefix_shared = 0;
    *remaining_shared = k;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0 && k > 0; shift -= 8) {
    SkvRadixDigit(key_of, n, shift, mask, histogram, prefix_shared, remaining_shared);
    mask |= 255u << shift;
  }
  __syncthreads();
  *ties_allowed = *remaining_shared;
  return *prefix_shared;
}

// Calls take(place, c) for the chunks among the k of SkvRadixKthKey, in index order: every key
// above `threshold` and the first `ties_allowed` equal to it; `place` counts them from 0. Every
// thread calls it; it contains barriers.
template <typename Scan, typename KeyOf, typename Take>
__device__ __forceinline__ void SkvTakeInIndexOrder(typename Scan::TempStorage& scan_storage,
                                                    KeyOf&& key_of, int n, uint32_t threshold,
                                                    int ties_allowed, Take&& take) {
  int tie_carry = 0, take_carry = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int c = base + threadIdx.x;
    const uint32_t key = c < n ? key_of(c) : 0u;
    const int tie = key != 0u && key == threshold;
    int tie_before = 0, tie_total = 0;
    Scan(scan_storage).ExclusiveSum(tie, tie_before, tie_total);
    __syncthreads();
    const int taken =
        (key != 0u && key > threshold) || (tie && tie_carry + tie_before < ties_allowed);
    int take_before = 0, take_total = 0;
    Scan(scan_storage).ExclusiveSum(taken, take_before, take_total);
    __syncthreads();
    if (taken) take(take_carry + take_before, c);
    tie_carry += tie_total;
    take_carry += take_total;
  }
}

// Called by every thread of a block of at least `slots` threads (one thread per gather slot),
// after a barrier that made `selected` (k chunks, increasing) and `wanted` (their bits)
// visible. Hits keep their slot and clear their bit; misses go to the free slots in slot order
// and are written to `miss`; `counters` (may be null) count selections and hits.
template <typename Scan>
__device__ __forceinline__ void AssignGatherSlots(typename Scan::TempStorage& scan_storage,
                                                  int slots, int k, int n, const int* selected,
                                                  uint32_t* wanted, int* free_slots,
                                                  int32_t* slot_chunk, int32_t* miss,
                                                  unsigned long long* counters) {
  const int tid = threadIdx.x;
  int is_free = 0;
  if (tid < slots) {
    const int held = slot_chunk[tid];
    const bool hit = held >= 0 && held < n && (wanted[held >> 5] >> (held & 31) & 1u);
    is_free = !hit;
  }
  __syncthreads();  // every slot has read `wanted` before hits clear their bits
  if (tid < slots && !is_free) {
    const int held = slot_chunk[tid];
    atomicAnd(&wanted[held >> 5], ~(1u << (held & 31)));
  }
  int free_before = 0, free_total = 0;
  Scan(scan_storage).ExclusiveSum(is_free, free_before, free_total);
  if (is_free) {
    free_slots[free_before] = tid;
    slot_chunk[tid] = -1;
  }
  __syncthreads();
  // Misses, in index order, into the free slots in slot order.
  const int chunk = tid < k ? selected[tid] : -1;
  const int is_miss = chunk >= 0 && (wanted[chunk >> 5] >> (chunk & 31) & 1u);
  int miss_before = 0, miss_total = 0;
  Scan(scan_storage).ExclusiveSum(is_miss, miss_before, miss_total);
  if (is_miss) {
    const int slot = free_slots[miss_before];
    slot_chunk[slot] = chunk;
    miss[slot] = chunk;
  }
  if (tid == 0 && counters) {
    atomicAdd(&counters[0], static_cast<unsigned long long>(k));
    atomicAdd(&counters[1], static_cast<unsigned long long>(k - miss_total));
  }
}

// ---- chunks drawn at random (select_sample) ---------------------------------------------------

// Chunks the selection of a KV head draws: the sequence's sample_chunks where its selectable
// chunks outnumber its budget (the CPU policy's DrawnChunks), else none.
__device__ __forceinline__ int SkvDrawnChunks(const SkvLayout& l, const SkvSequenceInfo& info,
                                              int selectable) {
  return l.slot_log_weight && selectable > info.budget_chunks ? min(info.sample_chunks, l.max_sample)
                                                                : 0;
}

// Word w of the bitmap of the chunks c in [0, n) for which live(c) holds (the selectable ones).
template <typename Live>
__device__ __forceinline__ uint32_t SkvLiveWord(int n, int w, Live&& live) {
  uint32_t bits = 0;
  const int first = 32 * w, last = min(n, first + 32);
  for (int c = first; c < last; ++c) bits |= (live(c) ? 1u : 0u) << (c - first);
  return bits;
}

// The same from a select kernel's keys (0: not selectable).
__device__ __forceinline__ uint32_t SkvKeysLiveWord(const uint32_t* keys, int n, int w) {
  return SkvLiveWord(n, w, [&](int c) { return keys[c] != 0u; });
}

// The seed of a selection's draw, as the CPU policy forms it: the layer (among the compressed
// ones), the KV head (the model's: SkvLayout::first_head + the layout's) and the tokens held,
// the new one included.
__device__ __forceinline__ uint64_t SkvSampleSeed(int layer, int head, int64_t tokens) {
  return (static_cast<uint64_t>(layer) << 48) ^ (static_cast<uint64_t>(head) << 40) ^
         static_cast<uint64_t>(tokens);
}

// Output i (from 0) of the splitmix64 generator seeded `seed`, the CPU policy's: its state
// advances by one constant per output, so each output is computed on its own.
__device__ __forceinline__ uint64_t SkvSplitMix(uint64_t seed, int i) {
  uint64_t z = seed + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Dynamic shared memory of the draw (SkvFinishSelection's `scratch`): a count per bitmap word
// and three ints per drawn chunk.
__host__ __device__ constexpr int64_t SkvSampleSharedBytes(int capacity_chunks, int max_sample) {
  return max_sample > 0 ? 4ll * ((capacity_chunks + 31) / 32 + 1) + 12ll * max_sample : 0;
}

// Draws `count` chunks uniformly without replacement from the pool (the chunks whose bits
// pool_word(w) sets, w in [0, words)) exactly as the CPU policy does: a partial Fisher-Yates
// shuffle of the pool in increasing order, step i swapping positions i and
// j_i = i + SkvSplitMix(seed, i) mod (pool - i), and the first `count` positions kept. Returns
// the pool's size; the chunks end in drawn[0, min(count, pool)) and are not yet marked anywhere.
// Every thread calls it (it contains barriers; the last makes `drawn` visible). `scratch`:
// words + 1 + count ints.
//
// The shuffle is resolved in parallel. Step i leaves position i for good (later steps touch
// positions above it), so the chunk drawn at step i is what position j_i holds before it: what
// the latest earlier step e with j_e = j_i put there (the value position e held before step e),
// or j_i itself. Position e held, before step e, what the latest earlier step with target e put
// there, or e: a chain of strictly earlier steps, followed to its end.
template <typename Scan, typename PoolWord>
__device__ __forceinline__ int SkvDrawSample(typename Scan::TempStorage& scan_storage,
                                             PoolWord&& pool_word, int words, int count,
                                             uint64_t seed, int* scratch, int* drawn) {
  int* word_before = scratch;         // [words + 1] pool members in the words before
  int* target = scratch + words + 1;  // [count] j_i
  int* previous = target + count;     // [count] the latest earlier step whose target is i, or -1
  const int tid = threadIdx.x;
  int pool = 0;
  for (int base = 0; base < words; base += blockDim.x) {
    const int w = base + tid;
    const int own = w < words ? __popc(pool_word(w)) : 0;
    int before = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(own, before, total);
    if (w < words) word_before[w] = pool + before;
    pool += total;
    __syncthreads();  // the scan's storage is used again
  }
  const int draws = min(count, pool);
  for (int i = tid; i < draws; i += blockDim.x) {
    target[i] = i + static_cast<int>(SkvSplitMix(seed, i) % static_cast<uint64_t>(pool - i));
  }
  if (tid == 0) word_before[words] = pool;
  __syncthreads();
  for (int i = tid; i < draws; i += blockDim.x) {
    int to_i = -1, same_target = -1;
    for (int e = 0; e < i; ++e) {
      if (target[e] == i) to_i = e;
      if (target[e] == target[i]) same_target = e;
    }
    previous[i] = to_i;
    drawn[i] = same_target;
  }
  __syncthreads();
  for (int i = tid; i < draws; i += blockDim.x) {
    int position = target[i];
    if (int e = drawn[i]; e >= 0) {
      while (previous[e] >= 0) e = previous[e];
      position = e;
    }
    // The position-th pool member: its word by binary search, then its bit.
    int low = 0, high = words - 1;
    while (low < high) {
      const int mid = (low + high + 1) / 2;
      if (word_before[mid] <= position) low = mid;
      else high = mid - 1;
    }
    const uint32_t bits = pool_word(low);
    drawn[i] = 32 * low + static_cast<int>(__fns(bits, 0, position - word_before[low] + 1));
  }
  __syncthreads();
  return pool;
}

// The chunks whose bits `wanted` sets, increasing, into `list`; returns their count. Every thread
// calls it (it contains barriers; the last makes `list` visible).
template <typename Scan>
__device__ __forceinline__ int SkvListWanted(typename Scan::TempStorage& scan_storage,
                                             const uint32_t* wanted, int words, int* list) {
  int listed = 0;
  for (int base = 0; base < words; base += blockDim.x) {
    const int w = base + threadIdx.x;
    uint32_t bits = w < words ? wanted[w] : 0u;
    int before = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(__popc(bits), before, total);
    for (int at = listed + before; bits != 0u; bits &= bits - 1u) list[at++] = 32 * w + __ffs(bits) - 1;
    listed += total;
    __syncthreads();
  }
  return listed;
}

// The end of every select kernel's selection of (row, KV head), after a barrier that made
// `selected` (the `ranked` chunks kept, increasing) and `wanted` (their bits) visible: under
// select_sample (drawn > 0) `drawn` chunks more drawn from the chunks whose bits live_word(w)
// sets less the ranked ones, seeded by (layer, head, tokens held); the gather slots assigned
// (AssignGatherSlots, one thread per slot); with layout.slot_log_weight each slot's weight
// written. `scratch` holds SkvSampleSharedBytes of shared memory. Every thread calls it.
template <typename Scan, typename LiveWord>
__device__ __forceinline__ void SkvFinishSelection(
    typename Scan::TempStorage& scan_storage, const SkvDecodeParams& p, const SkvRowMeta& m,
    const SkvSequenceInfo& info, int h, int ranked, int drawn, LiveWord&& live_word,
    int* selected, uint32_t* wanted, int* free_slots, int* scratch, int32_t* slot_chunk,
    int32_t* miss) {
  const SkvLayout& l = p.layout;
  const int words = (l.capacity_chunks + 31) / 32;
  int* drawn_chunks = scratch + words + 1 + 2 * l.max_sample;  // [max_sample]
  int k = ranked, draws = 0;
  float log_weight = 0.0f;
  if (drawn > 0) {
    const int pool = SkvDrawSample<Scan>(
        scan_storage, [&](int w) { return live_word(w) & ~wanted[w]; }, words, drawn,
        SkvSampleSeed(p.layer, l.first_head + h, static_cast<int64_t>(m.position) + 1), scratch,
        drawn_chunks);
    draws = min(drawn, pool);
    for (int i = threadIdx.x; i < draws; i += blockDim.x) {
      atomicOr(&wanted[drawn_chunks[i] >> 5], 1u << (drawn_chunks[i] & 31));
    }
    __syncthreads();
    k = SkvListWanted<Scan>(scan_storage, wanted, words, selected);
    if (draws > 0) {
      log_weight = static_cast<float>(log(static_cast<double>(pool) / static_cast<double>(draws)));
    }
  }
  AssignGatherSlots<Scan>(scan_storage, info.budget_chunks, k, m.num_chunks, selected, wanted,
                          free_slots, slot_chunk, miss, l.SequenceCounters(m.seq));
  if (!l.slot_log_weight) return;
  __syncthreads();  // every slot's chunk is written
  float* weight = l.slot_log_weight + l.HeadIndex(m.seq, p.layer, h) * l.max_budget;
  for (int s = threadIdx.x; s < info.budget_chunks; s += blockDim.x) {
    const int chunk = slot_chunk[s];
    bool was_drawn = false;
    for (int i = 0; i < draws; ++i) was_drawn = was_drawn || drawn_chunks[i] == chunk;
    weight[s] = chunk >= 0 && was_drawn ? log_weight : 0.0f;
  }
}

}  // namespace shadowkv::cuda
