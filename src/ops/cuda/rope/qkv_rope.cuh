// After the fused QKV projection: bias, per-head QK norm, RoPE (fp32, true positions) and the
// KV-cache append.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/common/kv_cache_view.cuh"

namespace shadowkv::cuda {

struct QkvRopeParams {
  // [rows, (num_query_heads + 2 * num_kv_heads) * head_dim]: q | k | v of each row, as the
  // projection wrote them (fp32, pre-RoPE, no bias yet).
  const float* qkv = nullptr;
  const float* bias = nullptr;      // [(num_query_heads + 2 * num_kv_heads) * head_dim] or null
  // qwen3: RMSNorm of each query and key head (after the bias, before RoPE and before the
  // pre-RoPE key copy) with these [head_dim] weights; both null for none. Needs head_dim / 2 a
  // power of two below 32 or a multiple of 32 that divides the kernel's block of 256 (head_dim
  // 2, 4, 8, 16, 32, 64, 128, 256 or 512).
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f;
  const float* inv_freq = nullptr;  // [rotary_dim / 2] angle per position of each pair (Rope's)
  const int32_t* positions = nullptr;  // [rows] true position of each row's token
  const int32_t* slots = nullptr;      // [rows] KV-cache slot of each row's sequence
  __nv_bfloat16* queries = nullptr;    // [rows, num_query_heads * head_dim] rotated queries
  KvCacheView cache;                   // rotated keys and values land at (slot, layer, position)
  int layer = 0;
  int rows = 0;
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;    // even
  int rotary_dim = 0;  // even, at most head_dim; later dims pass through
  bool halves = false;  // rotate (x[i], x[i + rotary_dim/2]) instead of (x[2i], x[2i+1])
  // Optional, for ShadowKV: the cache row of each token (null: its position), and a copy of the
  // keys before RoPE (after the bias), token-major [slots, layers, keys_pre_capacity,
  // num_kv_heads * head_dim] at row keys_pre_rows[i] (null: the position).
  const int32_t* cache_rows = nullptr;
  __nv_bfloat16* keys_pre = nullptr;
  int64_t keys_pre_capacity = 0;
  const int32_t* keys_pre_rows = nullptr;
};

// True when the QK norm (q_norm / k_norm) can run at this head dim (see QkvRopeParams::q_norm).
bool QkvRopeNormSupports(int head_dim);

cudaError_t LaunchQkvRope(const QkvRopeParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
