// What the attention op reads: runs of exact keys/values per KV head, as a KV policy prepared them.
#pragma once

#include <cstdint>
#include <vector>

namespace shadowkv {

// A run of exact post-RoPE keys/values of one KV head. Row t: keys + t * row_stride.
struct KvSegment {
  const float* keys = nullptr;    // [num_tokens, row_stride], first head_dim floats used
  const float* values = nullptr;  // [num_tokens, row_stride]
  int32_t num_tokens = 0;
  int32_t row_stride = 0;
  // When causal, row t sits at position first_position + t and is hidden from queries at
  // earlier positions (the segment holding the tokens just appended). Otherwise every row
  // precedes every query.
  bool causal = false;
  int64_t first_position = 0;
  // Added to each row's score (q·k times the attention scale) before the softmax: every row
  // stands for e^log_weight rows, as a uniform sample of a larger set does when weighted by the
  // set's size over the sample's. 0 for rows that stand for themselves.
  float log_weight = 0.0f;
};

// What the attention op reads for one layer of one sequence.
struct AttentionInput {
  std::vector<std::vector<KvSegment>> heads;  // [num_kv_heads][segments]

  void Reset(int num_kv_heads) {
    heads.resize(num_kv_heads);
    for (auto& segments : heads) segments.clear();
  }
  int64_t num_tokens(int kv_head) const {
    int64_t total = 0;
    for (const auto& s : heads[kv_head]) total += s.num_tokens;
    return total;
  }
};

}  // namespace shadowkv
