// Tests of the SnapKV policy: equal to full attention without pressure, selection against an
// fp64 reference and hand-made cases (strong key, pooling, GQA averaging), memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

KvPolicyConfig SnapConfig(int64_t budget, int window, int kernel, const std::string& pooling) {
  KvPolicyConfig config;
  config.policy = "snapkv";
  config.budget_tokens = budget;
  config.snap_window = window;
  config.snap_kernel = kernel;
  config.snap_pooling = pooling;
  return config;
}

// fp64 SnapKV selection for one layer and KV head, written from the method's description:
// positions kept from the prefix, in position order.
std::vector<int64_t> NaiveSelection(const TokenStream& stream, int layer, int kv_head,
                                    int64_t prompt, int window, int kernel, bool max_pool,
                                    int64_t keep) {
  const KvGeometry& g = stream.geometry;
  const int64_t prefix = prompt - window;
  const int group = g.group_size();
  std::vector<double> score(prefix, 0.0);
  for (int qh = kv_head * group; qh < (kv_head + 1) * group; ++qh) {
    for (int64_t i = prefix; i < prompt; ++i) {
      const float* q = stream.queries[layer].data() + i * g.q_width() + qh * g.head_dim;
      std::vector<double> logits(i + 1);
      for (int64_t t = 0; t <= i; ++t) {
        const float* k = stream.keys[layer].data() + t * g.kv_width() + kv_head * g.head_dim;
        double dot = 0;
        for (int d = 0; d < g.head_dim; ++d) dot += double{q[d]} * k[d];
        logits[t] = dot / std::sqrt(double{1.0} * g.head_dim);
      }
      const double top = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (double& x : logits) sum += (x = std::exp(x - top));
      for (int64_t t = 0; t < prefix; ++t) score[t] += logits[t] / sum / group;
    }
  }
  std::vector<double> pooled(prefix);
  for (int64_t t = 0; t < prefix; ++t) {
    double acc = max_pool ? -1.0 : 0.0;
    for (int64_t j = t - kernel / 2; j <= t + kernel / 2; ++j) {
      const double x = (j >= 0 && j < prefix) ? score[j] : (max_pool ? -1.0 : 0.0);
      acc = max_pool ? std::max(acc, x) : acc + x;
    }
    pooled[t] = max_pool ? acc : acc / kernel;
  }
  std::vector<int64_t> order(prefix);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return pooled[a] > pooled[b]; });
  order.resize(keep);
  std::sort(order.begin(), order.end());
  return order;
}

TEST(SnapKvPolicyTest, UnlimitedBudgetMatchesFull) {
  const KvGeometry geometry = SmallGeometry(2, 6, 2, 16);
  const TokenStream stream = RandomStream(geometry, 130, 11);
  KvPolicyConfig full_config;
  auto full = NewSequence(full_config, geometry);
  auto snap = NewSequence(SnapConfig(1000, 32, 7, "max"), geometry);
  const auto expected = testing::RunPolicy(*full, stream, 100, 37);
  const auto actual = testing::RunPolicy(*snap, stream, 100, 37);
  for (int l = 0; l < geometry.num_layers; ++l) testing::ExpectClose(actual[l], expected[l]);
  EXPECT_EQ(snap->num_tokens(), 130);
  EXPECT_EQ(snap->stats().attended_tokens, full->stats().attended_tokens);
}

void CheckAgainstNaive(const std::string& pooling) {
  const KvGeometry geometry = SmallGeometry(2, 4, 2, 16);
  const int64_t prompt = 300, budget = 96, generated = 8;
  const int window = 32, kernel = 7;
  const TokenStream stream = RandomStream(geometry, prompt + generated, 5);
  auto snap = NewSequence(SnapConfig(budget, window, kernel, pooling), geometry);
  testing::RunPolicy(*snap, stream, prompt, 128);
  ThreadPool pool(1);
  for (int l = 0; l < geometry.num_layers; ++l) {
    AttentionInput input;
    ASSERT_TRUE(snap->Prepare(l, stream.queries[l].data(), 1, &input).ok());
    std::vector<std::vector<int64_t>> expected(geometry.num_kv_heads);
    for (int h = 0; h < geometry.num_kv_heads; ++h) {
      expected[h] =
          NaiveSelection(stream, l, h, prompt, window, kernel, pooling == "max", budget - window);
      for (int64_t t = prompt - window; t < prompt + generated; ++t) expected[h].push_back(t);
      EXPECT_EQ(PositionsOf(input, h), expected[h]) << "layer " << l << " head " << h;
    }
    // The last decode step's output is attention over exactly those tokens.
    const int64_t last = prompt + generated - 1;
    std::vector<float> out(geometry.q_width());
    AttentionJob job{stream.queries[l].data() + last * geometry.q_width(), out.data(), 1, last,
                     &input};
    RunAttention(testing::ShapeOf(geometry), std::span<const AttentionJob>(&job, 1), pool);
    testing::ExpectClose(out, testing::ReferenceOver(stream, l, last, expected));
  }
  EXPECT_EQ(snap->num_tokens(), prompt + generated);
}

TEST(SnapKvPolicyTest, MaxPoolSelectionMatchesReference) { CheckAgainstNaive("max"); }
TEST(SnapKvPolicyTest, AvgPoolSelectionMatchesReference) { CheckAgainstNaive("avg"); }

// A prompt of zero keys except where a test places one; the window's queries all equal.
struct HandMade {
  KvGeometry geometry;
  TokenStream stream;
  HandMade(int num_query_heads, int64_t prompt) {
    geometry = SmallGeometry(1, num_query_heads, 1, 4);
    stream = RandomStream(geometry, prompt, 1);
    std::fill(stream.keys[0].begin(), stream.keys[0].end(), 0.0f);
    std::fill(stream.queries[0].begin(), stream.queries[0].end(), 0.0f);
  }
  void SetKey(int64_t position, int dim, float x) { stream.keys[0][position * 4 + dim] = x; }
  void SetQueries(int query_head, int dim, float x) {
    for (int64_t t = 0; t < stream.num_tokens; ++t) {
      stream.queries[0][t * geometry.q_width() + query_head * 4 + dim] = x;
    }
  }
  std::vector<int64_t> Kept(const KvPolicyConfig& config) {
    auto snap = NewSequence(config, geometry);
    testing::RunPolicy(*snap, stream, stream.num_tokens, 40);
    AttentionInput input;
    EXPECT_TRUE(snap->Prepare(0, stream.queries[0].data(), 1, &input).ok());
    auto positions = PositionsOf(input, 0);
    positions.resize(positions.size() - config.snap_window);  // the window, always kept
    return positions;
  }
};

TEST(SnapKvPolicyTest, StronglyAttendedKeySurvives) {
  HandMade m(1, 64);
  m.SetKey(20, 0, 1.0f);
  m.SetQueries(0, 0, 12.0f);  // logit 6 at position 20, 0 elsewhere
  m.SetKey(45, 1, 1.0f);
  m.SetQueries(0, 1, 6.0f);  // logit 3 at position 45
  // Budget: window of 8 plus 2 prefix tokens, no pooling: exactly the two keys, by weight.
  EXPECT_EQ(m.Kept(SnapConfig(10, 8, 1, "max")), (std::vector<int64_t>{20, 45}));
  EXPECT_EQ(m.Kept(SnapConfig(9, 8, 1, "max")), (std::vector<int64_t>{20}));
}

TEST(SnapKvPolicyTest, PoolingSpreadsToNeighbours) {
  HandMade m(1, 64);
  m.SetKey(20, 0, 1.0f);
  m.SetQueries(0, 0, 12.0f);
  // Max pooling with kernel 7 gives positions 17..23 the weight of 20; seven slots take them.
  std::vector<int64_t> neighbours = {17, 18, 19, 20, 21, 22, 23};
  EXPECT_EQ(m.Kept(SnapConfig(15, 8, 7, "max")), neighbours);
  // Average pooling spreads too: the window around 20 outweighs any window without it.
  EXPECT_EQ(m.Kept(SnapConfig(15, 8, 7, "avg")), neighbours);
  // Without pooling, the other six slots go to the equal-weight zero keys, earliest first.
  EXPECT_EQ(m.Kept(SnapConfig(15, 8, 1, "max")), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 20}));
}

TEST(SnapKvPolicyTest, QueryHeadsOfAKvHeadAreAveraged) {
  // Two query heads share the KV head. Head 0 gives position A=10 weight ~0.6 and B=30 ~0.3;
  // head 1 gives B ~0.5. The largest single weight is A's, but the group's mean favours B.
  HandMade m(2, 64);
  m.SetKey(10, 0, 1.0f);
  m.SetKey(30, 1, 1.0f);
  m.SetQueries(0, 0, 2.0f * std::log(372.0f));
  m.SetQueries(0, 1, 2.0f * std::log(186.0f));
  m.SetQueries(1, 1, 2.0f * std::log(63.0f));
  EXPECT_EQ(m.Kept(SnapConfig(9, 8, 1, "max")), (std::vector<int64_t>{30}));
}

TEST(SnapKvPolicyTest, MemoryHoldsTheBudgetAfterPrefill) {
  const KvGeometry geometry = SmallGeometry(3, 4, 2, 16);
  const int64_t prompt = 1000, budget = 128, generated = 20;
  const TokenStream stream = RandomStream(geometry, prompt + generated, 3);
  std::unique_ptr<KvPolicy> policy;
  auto snap = NewSequence(SnapConfig(budget, 32, 7, "max"), geometry, &policy);
  testing::RunPolicy(*snap, stream, prompt, 250);
  // RunPolicy decoded `generated` tokens after the prefill; a fresh run measures the prefill.
  auto fresh = NewSequence(SnapConfig(budget, 32, 7, "max"), geometry);
  ThreadPool pool(1);
  std::vector<std::vector<float>> out(geometry.num_layers);
  testing::StepPolicy(*fresh, stream, 0, prompt, pool, out);
  const int64_t before = fresh->memory().fast_bytes;
  for (int l = 0; l < geometry.num_layers; ++l) ASSERT_TRUE(fresh->FinishPrefill(l).ok());
  const int64_t after = fresh->memory().fast_bytes;
  EXPECT_GE(before, ExactBytes(geometry, prompt));
  EXPECT_EQ(after, ExactBytes(geometry, budget));
  EXPECT_EQ(policy->EstimateMemory(prompt).fast_bytes, ExactBytes(geometry, budget));
  EXPECT_EQ(snap->memory().fast_bytes, ExactBytes(geometry, budget + generated));
  std::printf(
      "snapkv memory, %lld-token prompt, budget %lld: %lld bytes before compression, "
      "%lld after (full: %lld)\n",
      static_cast<long long>(prompt), static_cast<long long>(budget),
      static_cast<long long>(before), static_cast<long long>(after),
      static_cast<long long>(ExactBytes(geometry, prompt)));
  // Prefill prepares read every token so far; decode step i reads the budget plus i + 1.
  int64_t attended = 0;
  for (int64_t from = 0; from < prompt; from += 250) attended += from + 250;
  for (int64_t i = 0; i < generated; ++i) attended += budget + i + 1;
  EXPECT_EQ(snap->stats().attended_tokens, attended * geometry.num_layers);
}

TEST(SnapKvPolicyTest, RejectsABudgetThatTheWindowFills) {
  auto policy = MakeKvPolicy(SnapConfig(32, 32, 7, "max"), SmallGeometry());
  ASSERT_FALSE(policy.ok());
  EXPECT_EQ(policy.status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace shadowkv::kv
