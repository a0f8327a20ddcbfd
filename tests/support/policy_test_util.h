// Test helpers for KV policies: random per-layer q/k/v streams, a driver that runs a policy
// through prefill and decode with the CPU attention op, and a reference over chosen tokens.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "kv/kv_policy.h"
#include "ops/cpu/attention.h"

namespace shadowkv::kv::testing {

inline KvGeometry SmallGeometry(int num_layers = 2, int num_query_heads = 4, int num_kv_heads = 2,
                                int head_dim = 16, int64_t max_context = 8192) {
  KvGeometry geometry;
  geometry.num_layers = num_layers;
  geometry.num_query_heads = num_query_heads;
  geometry.num_kv_heads = num_kv_heads;
  geometry.head_dim = head_dim;
  geometry.max_context = max_context;
  return geometry;
}

inline AttentionShape ShapeOf(const KvGeometry& geometry) {
  return {geometry.num_query_heads, geometry.num_kv_heads, geometry.head_dim,
          1.0f / std::sqrt(static_cast<float>(geometry.head_dim))};
}

// A new sequence of the policy `config` names on `geometry`; where the policy or the sequence
// cannot be made, a failed expectation naming the error and nullptr. The sequence does not need
// its policy; `policy_out`, where given, keeps it.
inline std::unique_ptr<SequenceKv> NewSequence(const KvPolicyConfig& config,
                                               const KvGeometry& geometry,
                                               std::unique_ptr<KvPolicy>* policy_out = nullptr) {
  auto policy = MakeKvPolicy(config, geometry);
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  if (!policy.ok()) return nullptr;
  auto sequence = (*policy)->NewSequence();
  EXPECT_TRUE(sequence.ok()) << sequence.status().ToString();
  if (!sequence.ok()) return nullptr;
  if (policy_out) *policy_out = std::move(*policy);
  return std::move(*sequence);
}

// Every token's post-RoPE query, key and value at every layer.
struct TokenStream {
  KvGeometry geometry;
  int64_t num_tokens = 0;
  std::vector<std::vector<float>> keys;     // [layer][token * kv_width]
  std::vector<std::vector<float>> values;   // [layer][token * kv_width]
  std::vector<std::vector<float>> queries;  // [layer][token * q_width]
};

// Normal(0, 1) entries; value element 0 of each KV head is replaced by the token's position so
// tests can read back which tokens a policy kept.
inline TokenStream RandomStream(const KvGeometry& geometry, int64_t num_tokens, uint32_t seed) {
  TokenStream stream;
  stream.geometry = geometry;
  stream.num_tokens = num_tokens;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(rng);
    return v;
  };
  for (int l = 0; l < geometry.num_layers; ++l) {
    stream.keys.push_back(fill(num_tokens * geometry.kv_width()));
    stream.values.push_back(fill(num_tokens * geometry.kv_width()));
    stream.queries.push_back(fill(num_tokens * geometry.q_width()));
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int h = 0; h < geometry.num_kv_heads; ++h) {
        stream.values[l][t * geometry.kv_width() + h * geometry.head_dim] = static_cast<float>(t);
      }
    }
  }
  return stream;
}

inline TokenBlock BlockOf(const TokenStream& stream, int layer, int64_t first, int64_t count) {
  TokenBlock block;
  block.num_tokens = static_cast<int>(count);
  block.first_position = first;
  const int64_t kv_width = stream.geometry.kv_width();
  block.keys = stream.keys[layer].data() + first * kv_width;
  block.keys_pre_rope = block.keys;  // these policies never read pre-RoPE keys
  block.values = stream.values[layer].data() + first * kv_width;
  block.queries = stream.queries[layer].data() + first * stream.geometry.q_width();
  return block;
}

// Feeds tokens [from, to) of every layer as one block (Append, Prepare, attention).
// Writes the outputs into out[layer][token * q_width].
inline void StepPolicy(SequenceKv& sequence, const TokenStream& stream, int64_t from, int64_t to,
                       ThreadPool& pool, std::vector<std::vector<float>>& out) {
  const KvGeometry& geometry = stream.geometry;
  const int q_width = geometry.q_width();
  for (int l = 0; l < geometry.num_layers; ++l) {
    const TokenBlock block = BlockOf(stream, l, from, to - from);
    ASSERT_TRUE(sequence.Append(l, block).ok());
    AttentionInput input;
    ASSERT_TRUE(sequence.Prepare(l, block.queries, block.num_tokens, &input).ok());
    out[l].resize(stream.num_tokens * q_width);
    AttentionJob job{block.queries, out[l].data() + from * q_width, block.num_tokens, from, &input};
    RunAttention(ShapeOf(geometry), std::span<const AttentionJob>(&job, 1), pool);
  }
}

// Prefills [0, prompt) in chunks of `chunk`, finishes the prefill, then decodes up to `end`
// (-1: the whole stream) one token at a time. Returns every token's attention output per layer.
inline std::vector<std::vector<float>> RunPolicy(SequenceKv& sequence, const TokenStream& stream,
                                                 int64_t prompt, int64_t chunk, int64_t end = -1) {
  if (end < 0) end = stream.num_tokens;
  ThreadPool pool(2);
  std::vector<std::vector<float>> out(stream.geometry.num_layers);
  for (int64_t from = 0; from < prompt; from += chunk) {
    StepPolicy(sequence, stream, from, std::min(prompt, from + chunk), pool, out);
  }
  for (int l = 0; l < stream.geometry.num_layers; ++l) {
    EXPECT_TRUE(sequence.FinishPrefill(l).ok());
  }
  for (int64_t t = prompt; t < end; ++t) StepPolicy(sequence, stream, t, t + 1, pool, out);
  return out;
}

// Positions of the tokens a prepared input shows KV head `kv_head` (read from the value tags).
inline std::vector<int64_t> PositionsOf(const AttentionInput& input, int kv_head) {
  std::vector<int64_t> positions;
  for (const auto& s : input.heads[kv_head]) {
    for (int t = 0; t < s.num_tokens; ++t) {
      positions.push_back(static_cast<int64_t>(s.values[static_cast<int64_t>(t) * s.row_stride]));
    }
  }
  return positions;
}

// fp64 attention of the query at `position` over exactly the tokens `positions[kv_head]`.
inline std::vector<float> ReferenceOver(const TokenStream& stream, int layer, int64_t position,
                                        const std::vector<std::vector<int64_t>>& positions) {
  const KvGeometry& geometry = stream.geometry;
  const int d = geometry.head_dim, width = geometry.kv_width();
  std::vector<std::vector<float>> keys(geometry.num_kv_heads), values(geometry.num_kv_heads);
  AttentionInput input;
  input.Reset(geometry.num_kv_heads);
  for (int h = 0; h < geometry.num_kv_heads; ++h) {
    for (int64_t t : positions[h]) {
      const float* k = stream.keys[layer].data() + t * width + h * d;
      const float* v = stream.values[layer].data() + t * width + h * d;
      keys[h].insert(keys[h].end(), k, k + d);
      values[h].insert(values[h].end(), v, v + d);
    }
    input.heads[h].push_back(
        {keys[h].data(), values[h].data(), static_cast<int32_t>(positions[h].size()), d, false, 0});
  }
  std::vector<float> out(geometry.q_width());
  const float* q = stream.queries[layer].data() + position * geometry.q_width();
  ReferenceAttention(ShapeOf(geometry), AttentionJob{q, out.data(), 1, position, &input});
  return out;
}

inline void ExpectClose(std::span<const float> actual, std::span<const float> expected,
                        float tolerance = 2e-5f) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], tolerance * (1.0f + std::fabs(expected[i])))
        << "element " << i;
  }
}

// Bytes of `tokens` exact fp32 keys and values over every layer.
inline int64_t ExactBytes(const KvGeometry& geometry, int64_t tokens) {
  return 2 * tokens * geometry.kv_width() * geometry.num_layers *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace shadowkv::kv::testing
