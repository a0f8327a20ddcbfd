// Tests of the Quest policy: equal to full attention without pressure, page choice against a
// naive reference (bounds from the raw keys), the queries' own page, dense layers, memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "support/policy_test_util.h"

namespace shadowkv::kv {
namespace {

using testing::ExactBytes;
using testing::NewSequence;
using testing::PositionsOf;
using testing::RandomStream;
using testing::SmallGeometry;
using testing::TokenStream;

KvPolicyConfig QuestConfig(int64_t budget, int page_size, int dense_layers) {
  KvPolicyConfig config;
  config.policy = "quest";
  config.budget_tokens = budget;
  config.quest_page_size = page_size;
  config.quest_dense_layers = dense_layers;
  return config;
}

std::vector<int64_t> Range(int64_t begin, int64_t end) {
  std::vector<int64_t> r(end - begin);
  std::iota(r.begin(), r.end(), begin);
  return r;
}

// Naive Quest for the `num_queries` queries ending at token `tokens - 1`: bounds of each page
// from the raw keys, upper-bound score per query head summed over queries, max over the GQA
// group, the top `budget_pages` of the pages before the queries' own, plus those.
// Returns the token positions per KV head, and whether the page of the last query was also
// among the top-scored pages if it had competed (to show the rule matters).
std::vector<int64_t> NaivePositions(const TokenStream& stream, int layer, int kv_head,
                                    int64_t tokens, int num_queries, int page_size,
                                    int64_t budget_pages, bool* own_page_would_lose) {
  const KvGeometry& g = stream.geometry;
  const int64_t num_pages = (tokens + page_size - 1) / page_size;
  const int64_t first_query_page = (tokens - num_queries) / page_size;
  std::vector<double> score(num_pages, -1e300);
  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t end = std::min(tokens, (p + 1) * page_size);
    for (int qh = kv_head * g.group_size(); qh < (kv_head + 1) * g.group_size(); ++qh) {
      double total = 0;
      for (int64_t i = tokens - num_queries; i < tokens; ++i) {
        const float* q = stream.queries[layer].data() + i * g.q_width() + qh * g.head_dim;
        for (int d = 0; d < g.head_dim; ++d) {
          double lo = 1e300, hi = -1e300;
          for (int64_t t = p * page_size; t < end; ++t) {
            const double k = stream.keys[layer][t * g.kv_width() + kv_head * g.head_dim + d];
            lo = std::min(lo, k);
            hi = std::max(hi, k);
          }
          total += std::max(q[d] * lo, q[d] * hi);
        }
      }
      score[p] = std::max(score[p], total);
    }
  }
  std::vector<int64_t> order(first_query_page);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return score[a] > score[b]; });
  const double threshold = score[order[budget_pages - 1]];
  *own_page_would_lose = score[num_pages - 1] < threshold;
  order.resize(budget_pages);
  std::sort(order.begin(), order.end());
  std::vector<int64_t> positions;
  for (int64_t p : order) {
    for (int64_t t = p * page_size; t < (p + 1) * page_size; ++t) positions.push_back(t);
  }
  for (int64_t t = first_query_page * page_size; t < tokens; ++t) positions.push_back(t);
  return positions;
}

TEST(QuestPolicyTest, UnlimitedBudgetMatchesFull) {
  const KvGeometry geometry = SmallGeometry(3, 4, 2, 16);
  const TokenStream stream = RandomStream(geometry, 150, 31);
  auto full = NewSequence(KvPolicyConfig{}, geometry);
  auto quest = NewSequence(QuestConfig(150, 16, 1), geometry);
  const auto expected = testing::RunPolicy(*full, stream, 110, 50);
  const auto actual = testing::RunPolicy(*quest, stream, 110, 50);
  for (int l = 0; l < geometry.num_layers; ++l) testing::ExpectClose(actual[l], expected[l]);
  EXPECT_EQ(quest->stats().attended_tokens, full->stats().attended_tokens);
}

TEST(QuestPolicyTest, PagesMatchNaiveReference) {
  const KvGeometry geometry = SmallGeometry(3, 6, 2, 16);
  const int64_t prompt = 203, generated = 12, second_turn = 5;
  const int page_size = 8, dense_layers = 1;
  const int64_t budget = 44;  // 5 pages
  const int64_t budget_pages = budget / page_size;
  const TokenStream stream = RandomStream(geometry, prompt + generated + second_turn, 17);
  auto quest = NewSequence(QuestConfig(budget, page_size, dense_layers), geometry);
  ThreadPool pool(1);
  std::vector<std::vector<float>> out(geometry.num_layers);
  testing::StepPolicy(*quest, stream, 0, prompt, pool, out);
  for (int l = 0; l < geometry.num_layers; ++l) ASSERT_TRUE(quest->FinishPrefill(l).ok());
  int own_page_rescued = 0;
  int64_t t = prompt;
  while (t < stream.num_tokens) {
    // Decode steps, then one multi-token block (a second turn) scored by summed queries.
    const int count = t < prompt + generated ? 1 : static_cast<int>(second_turn);
    for (int l = 0; l < geometry.num_layers; ++l) {
      const TokenBlock block = testing::BlockOf(stream, l, t, count);
      ASSERT_TRUE(quest->Append(l, block).ok());
      AttentionInput input;
      ASSERT_TRUE(quest->Prepare(l, block.queries, count, &input).ok());
      std::vector<std::vector<int64_t>> expected(geometry.num_kv_heads);
      for (int h = 0; h < geometry.num_kv_heads; ++h) {
        bool would_lose = false;
        expected[h] = l < dense_layers ? Range(0, t + count)
                                       : NaivePositions(stream, l, h, t + count, count, page_size,
                                                        budget_pages, &would_lose);
        own_page_rescued += would_lose;
        ASSERT_EQ(PositionsOf(input, h), expected[h]) << "token " << t << " layer " << l;
      }
      if (count == 1) {
        std::vector<float> actual(geometry.q_width());
        AttentionJob job{block.queries, actual.data(), 1, t, &input};
        RunAttention(testing::ShapeOf(geometry), std::span<const AttentionJob>(&job, 1), pool);
        testing::ExpectClose(actual, testing::ReferenceOver(stream, l, t, expected));
      }
    }
    t += count;
  }
  // The queries' own page is read even where its bound would not have made the top pages.
  EXPECT_GT(own_page_rescued, 0);
  // Sparse layers read the budget pages plus the last page per decode step, plus the two
  // pages that the second turn's five queries (positions 215..219) sit in.
  EXPECT_EQ(quest->stats().chunk_selections,
            (geometry.num_layers - dense_layers) * geometry.num_kv_heads *
                (generated * (budget_pages + 1) + (budget_pages + 2)));
}

TEST(QuestPolicyTest, DenseBeforeFinishPrefillAndMemoryLikeFull) {
  const KvGeometry geometry = SmallGeometry(2, 4, 2, 16);
  const int64_t prompt = 512;
  const TokenStream stream = RandomStream(geometry, prompt, 4);
  auto quest = NewSequence(QuestConfig(64, 16, 0), geometry);
  ThreadPool pool(1);
  std::vector<std::vector<float>> out(geometry.num_layers);
  testing::StepPolicy(*quest, stream, 0, prompt - 1, pool, out);
  // Not finished: a single query still reads everything.
  const TokenBlock block = testing::BlockOf(stream, 0, prompt - 1, 1);
  ASSERT_TRUE(quest->Append(0, block).ok());
  AttentionInput input;
  ASSERT_TRUE(quest->Prepare(0, block.queries, 1, &input).ok());
  EXPECT_EQ(PositionsOf(input, 0), Range(0, prompt));
  ASSERT_TRUE(quest->FinishPrefill(0).ok());
  ASSERT_TRUE(quest->Prepare(0, block.queries, 1, &input).ok());
  EXPECT_EQ(PositionsOf(input, 0).size(), 64u + 16u);
  // Every token stays: memory is the full cache plus two bound vectors per page.
  const int64_t kv_bytes = ExactBytes(geometry, prompt) - ExactBytes(geometry, 1) / 2;
  const int64_t bound_bytes = ExactBytes(geometry, prompt / 16);
  EXPECT_EQ(quest->memory().fast_bytes, kv_bytes + bound_bytes);
  std::printf("quest memory, %lld tokens: %lld bytes (full: %lld, page bounds: %lld)\n",
              static_cast<long long>(prompt), static_cast<long long>(quest->memory().fast_bytes),
              static_cast<long long>(ExactBytes(geometry, prompt)),
              static_cast<long long>(bound_bytes));
}

}  // namespace
}  // namespace shadowkv::kv
