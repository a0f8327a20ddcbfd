// Causal flash attention for prefill chunks: queries of a chunk against every key of their
// sequence so far (earlier chunks and the chunk itself), tiled, online softmax, bf16 tensor cores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/common/kv_cache_view.cuh"

namespace shadowkv::cuda {

// One sequence's chunk. Query i sits at position first_position + i and sees the keys at
// positions [0, first_position + i] (with a window, the last `window` of them), which must
// already be in the cache.
struct PrefillSequence {
  int32_t first_row = 0;  // row of query 0 in queries / out
  int32_t num_queries = 0;
  int32_t first_position = 0;
  int32_t slot = 0;
};

struct PrefillAttentionParams {
  const __nv_bfloat16* queries = nullptr;  // [rows, num_query_heads * head_dim] post-RoPE
  KvCacheView cache;
  int layer = 0;
  const PrefillSequence* sequences = nullptr;  // [num_sequences], device memory
  int num_sequences = 0;
  int max_queries = 0;  // largest num_queries among the sequences (sizes the grid)
  __nv_bfloat16* out = nullptr;  // [rows, num_query_heads * head_dim]
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;    // 16, 32, 64, 96, 128 or 256
  float scale = 0.0f;  // the model's softmax scale (usually 1/sqrt(head_dim))
  int window = 0;      // > 0: a query at position p sees only keys [p - window + 1, p]
};

bool PrefillAttentionSupports(int head_dim);

cudaError_t LaunchPrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
