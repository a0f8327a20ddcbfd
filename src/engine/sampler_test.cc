// Tests of the sampler: greedy, top-k/top-p support sets, seeded reproducibility, validation, and
// SampleAt's counter-based draws (reproducible per (seed, draw), softmax-distributed over draws).
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "support/sampling_stats.h"

namespace shadowkv {
namespace {

TEST(SamplerTest, GreedyPicksArgmaxLowestIdOnTies) {
  Sampler sampler(SamplingParams{});
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(sampler.Sample(logits), 1);
}

TEST(SamplerTest, TopKOneIsGreedy) {
  SamplingParams p;
  p.temperature = 5.0f;
  p.top_k = 1;
  Sampler sampler(p);
  std::vector<float> logits = {0.0f, 0.5f, 3.0f, 1.0f};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sampler.Sample(logits), 2);
}

TEST(SamplerTest, TopPKeepsTheNucleusOnly) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.5f;
  p.seed = 7;
  Sampler sampler(p);
  // Probabilities ~ {0.64, 0.24, 0.09, 0.03}: the nucleus for 0.5 is {0}; for 0.8 it is {0, 1}.
  std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  for (int i = 0; i < 100; ++i) EXPECT_EQ(sampler.Sample(logits), 0);
  p.top_p = 0.8f;
  Sampler wider(p);
  std::set<int> seen;
  for (int i = 0; i < 300; ++i) seen.insert(wider.Sample(logits));
  EXPECT_EQ(seen, (std::set<int>{0, 1}));
}

TEST(SamplerTest, SameSeedSameSequence) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  Sampler a(p), b(p);
  std::vector<float> logits(100);
  for (int i = 0; i < 100; ++i) logits[i] = static_cast<float>(i % 7) * 0.3f;
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.Sample(logits), b.Sample(logits));
}

TEST(SamplerTest, SampleIsSampleAtWithItsOwnCounter) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 40;
  p.top_p = 0.9f;
  p.seed = 5;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(500);
  for (float& v : logits) v = normal(rng);
  Sampler sampler(p);
  for (uint64_t draw = 0; draw < 64; ++draw) {
    EXPECT_EQ(sampler.Sample(logits), SampleAt(logits, p, draw)) << "draw " << draw;
  }
  EXPECT_EQ(sampler.draws(), 64u);
}

// SampleAt's noise depends on (seed, draw, id) only: calls in any order give the same ids, and
// over draws 0..n-1 the ids follow the (truncated) softmax, with and without a cut.
TEST(SampleAtTest, DrawsAreReproducibleAndSoftmaxDistributed) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.2f, -3.0f, 0.0f, 1.5f};
  for (int top_k : {0, 5}) {
    for (float top_p : {1.0f, 0.8f}) {
      SamplingParams p;
      p.temperature = 1.5f;
      p.top_k = top_k;
      p.top_p = top_p;
      p.seed = 99;
      const std::vector<int32_t> candidates = SamplingCandidates(logits, p);
      const std::vector<double> want = testing::TruncatedSoftmax(logits, candidates, 1.5f);
      const int n = 20000;
      std::vector<double> counts(logits.size(), 0.0);
      std::vector<int32_t> forward(n);
      for (int d = 0; d < n; ++d) counts[forward[d] = SampleAt(logits, p, d)] += 1.0;
      for (int d = n - 1; d >= n - 200; --d) ASSERT_EQ(SampleAt(logits, p, d), forward[d]);
      int df = 0;
      const double chi = testing::ChiSquare(counts, want, &df);
      EXPECT_LT(chi, testing::ChiSquareBound(df))
          << "top_k " << top_k << " top_p " << top_p << ": " << candidates.size() << " candidates";
      // Another seed: other draws (the same distribution).
      SamplingParams other = p;
      other.seed = 100;
      int same = 0;
      for (int d = 0; d < 200; ++d) same += SampleAt(logits, other, d) == forward[d];
      EXPECT_LT(same, 150);
    }
  }
}

TEST(SampleAtTest, CandidatesAreTheTopKThenTheNucleus) {
  // Probabilities at T = 1 ~ {0.64, 0.24, 0.09, 0.03} for logits {3, 2, 1, 0}.
  const std::vector<float> logits = {1.0f, 3.0f, 0.0f, 2.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  EXPECT_EQ(SamplingCandidates(logits, p), (std::vector<int32_t>{1, 3, 0, 2}));
  p.top_k = 2;
  EXPECT_EQ(SamplingCandidates(logits, p), (std::vector<int32_t>{1, 3}));
  p.top_k = 0;
  p.top_p = 0.8f;
  EXPECT_EQ(SamplingCandidates(logits, p), (std::vector<int32_t>{1, 3}));
  p.top_p = 0.5f;
  EXPECT_EQ(SamplingCandidates(logits, p), (std::vector<int32_t>{1}));
  // top_p within the top-k set: of {3, 2, 1} the masses are {0.67, 0.24, 0.09}.
  p.top_k = 3;
  p.top_p = 0.95f;
  EXPECT_EQ(SamplingCandidates(logits, p), (std::vector<int32_t>{1, 3, 0}));
}

TEST(SampleAtTest, TopKOneAndTemperatureZeroAreGreedy) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(1000);
  for (float& v : logits) v = normal(rng);
  SamplingParams p;
  p.temperature = 3.0f;
  p.top_k = 1;
  p.seed = 11;
  for (uint64_t draw = 0; draw < 100; ++draw) {
    EXPECT_EQ(SampleAt(logits, p, draw), Argmax(logits));
    EXPECT_EQ(SampleAt(logits, SamplingParams{}, draw), Argmax(logits));
  }
}

TEST(SamplerTest, RejectsImpossibleSettings) {
  SamplingParams p;
  p.temperature = -1.0f;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.top_p = 0.0f;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.top_k = -3;
  EXPECT_FALSE(p.Validate().ok());
  EXPECT_TRUE(SamplingParams{}.Validate().ok());
}

}  // namespace
}  // namespace shadowkv
