// KvCacheView: where the device-side full KV cache keeps each token's key and value vectors.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#if defined(__CUDACC__)
#define SKV_HOST_DEVICE __host__ __device__
#else
#define SKV_HOST_DEVICE
#endif

namespace shadowkv::cuda {

// Keys and values alike: [slots, layers, kv_heads, capacity, head_dim] bf16. One sequence owns a
// slot; the tokens of one (slot, layer, KV head) are contiguous, so attention reads each head's
// keys as one run. Rows past a slot's length are unwritten (garbage, possibly NaN): kernels
// must never let them reach an output, not even multiplied by zero.
struct KvCacheView {
  __nv_bfloat16* keys = nullptr;
  __nv_bfloat16* values = nullptr;
  int num_slots = 0;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t capacity = 0;  // tokens per slot

  // Element offset of token 0 of (slot, layer, kv_head).
  SKV_HOST_DEVICE int64_t HeadOffset(int slot, int layer, int kv_head) const {
    return ((static_cast<int64_t>(slot) * num_layers + layer) * num_kv_heads + kv_head) *
           capacity * head_dim;
  }
};

}  // namespace shadowkv::cuda
