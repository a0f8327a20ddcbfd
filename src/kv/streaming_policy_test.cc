// Tests of the StreamingLLM policy: equal to full attention without pressure, exactly the sinks
// and the recent window after many appends, bounded memory.
#include <gtest/gtest.h>

#include "support/policy_test_util.h"

namespace shadowkv::kv {
namespace {

using testing::ExactBytes;
using testing::NewSequence;
using testing::PositionsOf;
using testing::RandomStream;
using testing::SmallGeometry;
using testing::TokenStream;

KvPolicyConfig StreamingConfig(int64_t budget, int sinks) {
  KvPolicyConfig config;
  config.policy = "streaming";
  config.budget_tokens = budget;
  config.sink_tokens = sinks;
  return config;
}

std::vector<int64_t> SinksAndRecent(int sinks, int64_t recent_first, int64_t end) {
  std::vector<int64_t> positions;
  for (int64_t t = 0; t < sinks; ++t) positions.push_back(t);
  for (int64_t t = recent_first; t < end; ++t) positions.push_back(t);
  return positions;
}

TEST(StreamingPolicyTest, UnlimitedBudgetMatchesFull) {
  const KvGeometry geometry = SmallGeometry(2, 4, 2, 16);
  const TokenStream stream = RandomStream(geometry, 140, 21);
  auto full = NewSequence(KvPolicyConfig{}, geometry);
  auto streaming = NewSequence(StreamingConfig(140, 4), geometry);
  const auto expected = testing::RunPolicy(*full, stream, 100, 33);
  const auto actual = testing::RunPolicy(*streaming, stream, 100, 33);
  for (int l = 0; l < geometry.num_layers; ++l) testing::ExpectClose(actual[l], expected[l]);
  EXPECT_GE(streaming->memory().fast_bytes, ExactBytes(geometry, 140));
}

TEST(StreamingPolicyTest, KeepsSinksAndRecentTokensWithBoundedMemory) {
  const KvGeometry geometry = SmallGeometry(2, 4, 2, 16);
  const int64_t prompt = 200, budget = 64, generated = 300;
  const int sinks = 4;
  const int64_t recent = budget - sinks;
  const TokenStream stream = RandomStream(geometry, prompt + generated, 8);
  auto streaming = NewSequence(StreamingConfig(budget, sinks), geometry);
  ThreadPool pool(1);
  std::vector<std::vector<float>> out(geometry.num_layers);
  testing::StepPolicy(*streaming, stream, 0, prompt, pool, out);
  for (int l = 0; l < geometry.num_layers; ++l) ASSERT_TRUE(streaming->FinishPrefill(l).ok());
  // Compaction runs once half the recent window is dead, so at most T + recent/2 rows live.
  const int64_t bound = ExactBytes(geometry, budget + recent / 2);
  int64_t peak = streaming->memory().fast_bytes;
  for (int64_t t = prompt; t < prompt + generated; ++t) {
    for (int l = 0; l < geometry.num_layers; ++l) {
      const TokenBlock block = testing::BlockOf(stream, l, t, 1);
      ASSERT_TRUE(streaming->Append(l, block).ok());
      AttentionInput input;
      ASSERT_TRUE(streaming->Prepare(l, block.queries, 1, &input).ok());
      const auto expected = SinksAndRecent(sinks, t + 1 - recent, t + 1);
      for (int h = 0; h < geometry.num_kv_heads; ++h) {
        ASSERT_EQ(PositionsOf(input, h), expected) << "token " << t << " layer " << l;
      }
      if (t % 50 == 0) {
        std::vector<float> actual(geometry.q_width());
        AttentionJob job{block.queries, actual.data(), 1, t, &input};
        RunAttention(testing::ShapeOf(geometry), std::span<const AttentionJob>(&job, 1), pool);
        testing::ExpectClose(actual, testing::ReferenceOver(stream, l, t, {expected, expected}));
      }
    }
    peak = std::max(peak, streaming->memory().fast_bytes);
  }
  EXPECT_EQ(streaming->num_tokens(), prompt + generated);
  EXPECT_GE(peak, ExactBytes(geometry, budget));
  EXPECT_LE(peak, bound);
  std::printf("streaming memory, budget %lld after %lld tokens: peak %lld bytes (full: %lld)\n",
              static_cast<long long>(budget), static_cast<long long>(prompt + generated),
              static_cast<long long>(peak),
              static_cast<long long>(ExactBytes(geometry, prompt + generated)));
  // Decode steps read exactly the budget.
  EXPECT_EQ(streaming->stats().attended_tokens,
            geometry.num_layers * (prompt + generated * budget));
}

TEST(StreamingPolicyTest, PromptBlockAfterPrefillKeepsEveryQueryWindow) {
  // A second turn appends many tokens at once: its first query must still see its own window.
  const KvGeometry geometry = SmallGeometry(1, 2, 1, 16);
  const int64_t prompt = 150, budget = 40, turn = 70;
  const int sinks = 4;
  const int64_t recent = budget - sinks;
  const TokenStream stream = RandomStream(geometry, prompt + turn, 9);
  auto streaming = NewSequence(StreamingConfig(budget, sinks), geometry);
  testing::RunPolicy(*streaming, stream, prompt, 64, prompt);
  const TokenBlock block = testing::BlockOf(stream, 0, prompt, turn);
  ASSERT_TRUE(streaming->Append(0, block).ok());
  AttentionInput input;
  ASSERT_TRUE(streaming->Prepare(0, block.queries, turn, &input).ok());
  EXPECT_EQ(PositionsOf(input, 0), SinksAndRecent(sinks, prompt + 1 - recent, prompt + turn));
  std::vector<float> out(turn * geometry.q_width());
  AttentionJob job{block.queries, out.data(), static_cast<int>(turn), prompt, &input};
  ThreadPool pool(1);
  RunAttention(testing::ShapeOf(geometry), std::span<const AttentionJob>(&job, 1), pool);
  const auto first_window = SinksAndRecent(sinks, prompt + 1 - recent, prompt + 1);
  testing::ExpectClose(std::span<const float>(out.data(), geometry.q_width()),
                       testing::ReferenceOver(stream, 0, prompt, {first_window}));
  // Finishing that turn's prefill enforces the budget again.
  ASSERT_TRUE(streaming->FinishPrefill(0).ok());
  ASSERT_TRUE(streaming->Prepare(0, block.queries, 1, &input).ok());
  EXPECT_EQ(PositionsOf(input, 0), SinksAndRecent(sinks, prompt + turn - recent, prompt + turn));
}

TEST(StreamingPolicyTest, ShortPromptStaysExact) {
  const KvGeometry geometry = SmallGeometry(1, 2, 1, 8);
  const TokenStream stream = RandomStream(geometry, 30, 2);
  auto streaming = NewSequence(StreamingConfig(64, 4), geometry);
  testing::RunPolicy(*streaming, stream, 30, 30);
  AttentionInput input;
  ASSERT_TRUE(streaming->Prepare(0, stream.queries[0].data(), 1, &input).ok());
  EXPECT_EQ(PositionsOf(input, 0), SinksAndRecent(4, 4, 30));
}

}  // namespace
}  // namespace shadowkv::kv
