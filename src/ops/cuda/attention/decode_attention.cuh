// Decode attention over the full KV cache: split-KV, the GQA query heads of a KV head sharing
// every K/V load, bf16 cache, fp32 softmax and accumulation, then a combine over the splits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/common/kv_cache_view.cuh"

namespace shadowkv::cuda {

constexpr int kDecodeMaxSplits = 64;       // splits per (row, KV head) at most
constexpr int kDecodeMinSplitTokens = 32;  // a split reads at least this many keys
constexpr int kDecodeHeadsPerBlock = 8;    // query heads of a GQA group one block serves
constexpr int kDecodeMaxGroup = 32;        // query heads per KV head at most

// Blocks per (split, KV head, row): a group of more than kDecodeHeadsPerBlock query heads is
// served by several blocks, each reading the KV head's keys and values.
__host__ __device__ constexpr int DecodeGroupBlocks(int group) {
  return (group + kDecodeHeadsPerBlock - 1) / kDecodeHeadsPerBlock;
}
// Blocks per (split, row): every KV head's, the grid's y extent and what DecodeNumSplits counts.
__host__ __device__ constexpr int DecodeHeadBlocks(int num_query_heads, int num_kv_heads) {
  return num_kv_heads * DecodeGroupBlocks(num_query_heads / num_kv_heads);
}

struct DecodeAttentionParams {
  const __nv_bfloat16* queries = nullptr;  // [rows, num_query_heads * head_dim] post-RoPE
  KvCacheView cache;
  int layer = 0;
  const int32_t* slots = nullptr;  // [rows] KV-cache slot of each row's sequence
  // [rows] the query's position: it sees keys [0, position], or with a window the last `window`
  // of them, [position - window + 1, position].
  const int32_t* positions = nullptr;
  // Per (row, query head, split): the split's normalised output and log2-sum-exp2 of its scaled
  // scores. [rows, num_query_heads, num_splits, head_dim] and [rows, num_query_heads, num_splits].
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  __nv_bfloat16* out = nullptr;  // [rows, num_query_heads * head_dim]
  int rows = 0;
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;    // 16, 32, 64, 96, 128 or 256
  int num_splits = 1;  // in [1, kDecodeMaxSplits]; a row seeing L keys uses splits of
                       // max(kDecodeMinSplitTokens, ceil(L / num_splits) rounded up to 16) keys
  float scale = 0.0f;  // the model's softmax scale (usually 1/sqrt(head_dim))
  int window = 0;      // > 0: sliding-window attention over the last `window` keys; 0: all keys
  // Keys that stand for several (ShadowKV's chunks drawn at random), or null: none. Row r's keys
  // [weight_first[r], weight_first[r] + weight_runs · weight_run) form runs of weight_run keys,
  // and run j of KV head h adds key_log_weight[((slots[r] · cache layers + layer) · kv heads + h)
  // · weight_runs + j] to their scores (after the scale): a key of weight w counts as e^w copies
  // of itself. Keys outside the runs have weight 0.
  const float* key_log_weight = nullptr;
  const int32_t* weight_first = nullptr;  // [rows]
  int weight_runs = 0;
  int weight_run = 0;
};

// True when the kernel is built for this head_dim and group size (query heads per KV head).
bool DecodeAttentionSupports(int head_dim, int group_size);

// Splits per (row, KV head) for `rows` rows; `target_blocks` is 8 per multiprocessor. With
// groups above kDecodeHeadsPerBlock, pass DecodeHeadBlocks(query heads, KV heads). The
// kernel keeps 3 blocks per multiprocessor resident, so the count is the largest that
// fills at most two such waves (whole waves: no idle tail). It does not depend on the lengths,
// so a captured graph stays valid as sequences grow.
int DecodeNumSplits(int rows, int num_kv_heads, int target_blocks);

cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
