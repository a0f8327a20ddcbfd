// Tests of the sampler: greedy, top-k/top-p support sets, seeded reproducibility, validation.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <set>

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
