// Device code shared by the ShadowKV select kernels: the gather-slot assignment that follows
// the top-K choice (hits keep their slot, misses fill the free slots in slot order), and the
// block-wide pieces of a top-K by radix select.
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

}  // namespace shadowkv::cuda
