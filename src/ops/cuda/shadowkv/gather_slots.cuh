// Device code shared by both ShadowKV select kernels: the gather-slot assignment that follows
// the top-K choice (hits keep their slot, misses fill the free slots in slot order).
#pragma once

#include <cstdint>

#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {

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
