// Tests of the CPU attention op against the per-query fp64 reference, incl. causal segments.
#include "ops/cpu/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace shadowkv {
namespace {

std::vector<float> RandomVector(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Checks RunAttention against ReferenceAttention for one layout of segments.
void CheckAgainstReference(int num_queries, int64_t first_position, int prefix_tokens,
                           int num_threads) {
  std::mt19937 rng(num_queries * 7919 + prefix_tokens);
  AttentionShape shape{6, 2, 16, 0.25f};
  const int width = shape.num_kv_heads * shape.head_dim;
  const int q_width = shape.num_query_heads * shape.head_dim;
  const int total = prefix_tokens + num_queries;
  auto keys = RandomVector(static_cast<size_t>(total) * width, rng);
  auto values = RandomVector(static_cast<size_t>(total) * width, rng);
  auto queries = RandomVector(static_cast<size_t>(num_queries) * q_width, rng);

  AttentionInput input;
  input.Reset(shape.num_kv_heads);
  for (int h = 0; h < shape.num_kv_heads; ++h) {
    // A non-causal prefix split in two segments, then the causal tail holding the queries' keys.
    const int split = prefix_tokens / 3;
    const int64_t base = h * shape.head_dim;
    input.heads[h].push_back({keys.data() + base, values.data() + base, split, width, false, 0});
    input.heads[h].push_back({keys.data() + base + split * width,
                              values.data() + base + split * width, prefix_tokens - split, width,
                              false, 0});
    input.heads[h].push_back({keys.data() + base + prefix_tokens * width,
                              values.data() + base + prefix_tokens * width, num_queries, width, true,
                              first_position});
  }
  std::vector<float> out(queries.size()), expected(queries.size());
  AttentionJob job{queries.data(), out.data(), num_queries, first_position, &input};
  AttentionJob ref_job = job;
  ref_job.out = expected.data();
  ThreadPool pool(num_threads);
  RunAttention(shape, std::span<const AttentionJob>(&job, 1), pool);
  ReferenceAttention(shape, ref_job);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], expected[i], 1e-5f * (1.0f + std::fabs(expected[i]))) << "element " << i;
  }
}

TEST(AttentionTest, DecodeMatchesReference) { CheckAgainstReference(1, 40, 40, 2); }
TEST(AttentionTest, PrefillChunkMatchesReference) { CheckAgainstReference(150, 30, 30, 3); }
TEST(AttentionTest, FirstChunkIsCausalOnly) { CheckAgainstReference(70, 0, 0, 1); }

TEST(AttentionTest, SingleKeyReturnsItsValue) {
  AttentionShape shape{2, 1, 4, 1.0f};
  std::vector<float> k = {1, 2, 3, 4}, v = {5, 6, 7, 8}, q(8, 0.5f), out(8);
  AttentionInput input;
  input.Reset(1);
  input.heads[0].push_back({k.data(), v.data(), 1, 4, true, 9});
  AttentionJob job{q.data(), out.data(), 1, 9, &input};
  ThreadPool pool(1);
  RunAttention(shape, std::span<const AttentionJob>(&job, 1), pool);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out[h * 4 + c], v[c]);
}

// A segment with log_weight ln(n) attends as n copies of its rows: the same output from one
// weighted segment as from n unweighted segments over the same rows, for a decode query and for
// a block of queries (the BLAS path).
void CheckWeightedRowsAsCopies(int num_queries) {
  std::mt19937 rng(31 + num_queries);
  AttentionShape shape{4, 2, 16, 0.25f};
  const int width = shape.num_kv_heads * shape.head_dim;
  const int prefix = 24, sampled = 5, copies = 3;
  auto keys = RandomVector(static_cast<size_t>(prefix + sampled) * width, rng);
  auto values = RandomVector(keys.size(), rng);
  auto queries = RandomVector(static_cast<size_t>(num_queries) * shape.num_query_heads *
                                  shape.head_dim, rng);
  AttentionInput weighted, repeated;
  weighted.Reset(shape.num_kv_heads);
  repeated.Reset(shape.num_kv_heads);
  for (int h = 0; h < shape.num_kv_heads; ++h) {
    const int64_t base = h * shape.head_dim, tail = base + prefix * width;
    const KvSegment exact{keys.data() + base, values.data() + base, prefix, width, false, 0};
    const KvSegment sample{keys.data() + tail, values.data() + tail, sampled, width, false, 0};
    weighted.heads[h] = {exact, sample};
    weighted.heads[h][1].log_weight = std::log(static_cast<float>(copies));
    repeated.heads[h] = {exact};
    for (int c = 0; c < copies; ++c) repeated.heads[h].push_back(sample);
  }
  std::vector<float> out(queries.size()), expected(queries.size());
  AttentionJob job{queries.data(), out.data(), num_queries, prefix + sampled, &weighted};
  AttentionJob copies_job{queries.data(), expected.data(), num_queries, prefix + sampled,
                          &repeated};
  ThreadPool pool(2);
  RunAttention(shape, std::span<const AttentionJob>(&job, 1), pool);
  RunAttention(shape, std::span<const AttentionJob>(&copies_job, 1), pool);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], expected[i], 1e-5f * (1.0f + std::fabs(expected[i]))) << "element " << i;
  }
  // The weight changes the output (the check above is not vacuous).
  weighted.heads[0][1].log_weight = 0.0f;
  std::vector<float> unweighted(queries.size());
  job.out = unweighted.data();
  RunAttention(shape, std::span<const AttentionJob>(&job, 1), pool);
  double change = 0.0;
  for (size_t i = 0; i < out.size(); ++i) change += std::fabs(unweighted[i] - out[i]);
  EXPECT_GT(change, 1e-3);
}

TEST(AttentionTest, WeightedRowsAttendAsCopiesInDecode) { CheckWeightedRowsAsCopies(1); }
TEST(AttentionTest, WeightedRowsAttendAsCopiesInABlock) { CheckWeightedRowsAsCopies(20); }

}  // namespace
}  // namespace shadowkv
