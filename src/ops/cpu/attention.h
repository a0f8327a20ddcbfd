// Exact attention over what a KV policy prepared (plain segments), on the CPU with BLAS tiles.
#pragma once

#include <cstdint>
#include <span>

#include "core/attention_input.h"
#include "core/thread_pool.h"

namespace shadowkv {

// One sequence's attention work at one layer.
struct AttentionJob {
  const float* queries = nullptr;  // [num_queries, num_query_heads * head_dim] post-RoPE
  float* out = nullptr;            // [num_queries, num_query_heads * head_dim]
  int num_queries = 0;
  int64_t first_position = 0;  // position of query 0 (queries are consecutive)
  const AttentionInput* input = nullptr;
};

struct AttentionShape {
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 0.0f;  // usually 1/sqrt(head_dim)
  // > 0: sliding-window attention, a query at position p sees only rows at positions above
  // p - window. Only causal (positioned) segments are masked by it, so a windowed layer's
  // policy must place every row in a causal segment (the full policy does).
  int64_t window = 0;
};

// Runs every job (softmax(q·kᵀ·scale, causal where a segment says so)·v), spreading
// (job, KV head, query block) tasks over the pool.
void RunAttention(const AttentionShape& shape, std::span<const AttentionJob> jobs,
                  ThreadPool& pool);

// Straightforward per-query reference (fp64 accumulation), for tests.
void ReferenceAttention(const AttentionShape& shape, const AttentionJob& job);

}  // namespace shadowkv
