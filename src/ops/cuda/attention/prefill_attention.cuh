// Causal flash attention for prefill chunks: queries of a chunk against every key of their
// sequence so far (earlier chunks and the chunk itself), tiled, online softmax, bf16 tensor cores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/common/kv_cache_view.cuh"

namespace shadowkv::cuda {

// One sequence's chunk. Query i sits at position first_position + i and sees the keys at
// positions [0, first_position + i], which must already be in the cache.
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
  int head_dim = 0;  // 64 or 128
  float scale = 0.0f;
  // Which kernel (kPrefillVariant*); kPrefillVariantAuto takes the default. Every variant
  // computes the same function.
  int variant = -1;
};

constexpr int kPrefillVariantAuto = -1;
constexpr int kPrefillVariantSingleBuffered = 0;  // 64 rows, 4 warps, one K/V tile at a time
constexpr int kPrefillVariant128Rows2MTiles = 1;  // 4 warps x 32 rows, double-buffered
constexpr int kPrefillVariant64Rows = 2;          // 4 warps x 16 rows, double-buffered
constexpr int kPrefillVariant128Rows8Warps = 3;   // 8 warps x 16 rows, double-buffered
constexpr int kPrefillVariant128Rows32Keys = 4;   // variant 1 with 32-key tiles (fewer registers)
constexpr int kPrefillVariantFastSoftmax = 5;        // variant 1, scale folded in one FMA, ex2.approx
constexpr int kPrefillVariantFastSoftmax48Keys = 6;  // variant 5 with 48-key tiles
// The default: Hopper wgmma where the build has sm_90a code (CMAKE_CUDA_ARCHITECTURES=90a) and
// head dim is 128, else variant 5.
constexpr int kPrefillVariantWgmma = 7;
constexpr int kPrefillNumVariants = 8;

bool PrefillAttentionSupports(int head_dim);

cudaError_t LaunchPrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
