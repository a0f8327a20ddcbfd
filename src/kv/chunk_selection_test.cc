// Tests of landmarks, outliers, scoring, top-k and gather slots against hand cases and naive code.
#include "kv/chunk_selection.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace shadowkv::kv {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

TEST(ChunkSelectionTest, LandmarkIsTheMeanOfTheChunk) {
  // Two chunks of 2 tokens, head_dim 3, read through a row stride of 5 (another head beside).
  const std::vector<float> keys = {1,  2, 3, 9, 9,  //
                                   3,  4, 5, 9, 9,  //
                                   -1, 0, 2, 9, 9,  //
                                   1,  0, 4, 9, 9};
  std::vector<float> landmarks(6);
  ComputeLandmarks(keys.data(), 5, 2, 2, 3, landmarks.data());
  const std::vector<float> expected = {2, 3, 4, 0, 0, 3};
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(landmarks[i], expected[i]);
}

TEST(ChunkSelectionTest, MinCosineOnHandCase) {
  // Chunk 0: keys (1,0) and (0,1): landmark (0.5,0.5), cos = 1/√2 for both.
  // Chunk 1: keys (2,0) twice: cos 1.
  const std::vector<float> keys = {1, 0, 0, 1, 2, 0, 2, 0};
  std::vector<float> landmarks(4), min_cos(2);
  ComputeLandmarks(keys.data(), 2, 2, 2, 2, landmarks.data());
  ChunkMinCosine(keys.data(), 2, landmarks.data(), 2, 2, 2, min_cos.data());
  EXPECT_NEAR(min_cos[0], 1.0 / std::sqrt(2.0), 1e-6);
  EXPECT_NEAR(min_cos[1], 1.0, 1e-6);
}

TEST(ChunkSelectionTest, ChunkWithAStrayKeyIsTheOutlier) {
  // 10 chunks of 8 keys all near direction e0; in chunk 6 one key points along −e3.
  const int head_dim = 16, chunk = 8, chunks = 10;
  auto keys = Random(static_cast<size_t>(chunks) * chunk * head_dim, 4, 0.05f);
  for (int t = 0; t < chunks * chunk; ++t) keys[t * head_dim] += 3.0f;
  float* stray = keys.data() + (6 * chunk + 5) * head_dim;
  std::fill(stray, stray + head_dim, 0.0f);
  stray[3] = -3.0f;
  std::vector<float> landmarks(chunks * head_dim), min_cos(chunks);
  ComputeLandmarks(keys.data(), head_dim, chunks, chunk, head_dim, landmarks.data());
  ChunkMinCosine(keys.data(), head_dim, landmarks.data(), chunks, chunk, head_dim, min_cos.data());
  EXPECT_EQ(PickOutlierChunks(min_cos, 1), std::vector<int32_t>({6}));
  EXPECT_LT(min_cos[6], 0.5f);
}

TEST(ChunkSelectionTest, OutliersAreLowestWithIndexTieBreak) {
  const std::vector<float> min_cos = {0.9f, 0.2f, 0.5f, 0.2f, 0.1f, 0.95f};
  EXPECT_EQ(PickOutlierChunks(min_cos, 3), std::vector<int32_t>({1, 3, 4}));
  EXPECT_EQ(PickOutlierChunks(min_cos, 2), std::vector<int32_t>({1, 4}));  // 1 before 3
  EXPECT_EQ(PickOutlierChunks(min_cos, 0), std::vector<int32_t>());
  EXPECT_EQ(PickOutlierChunks(min_cos, 10).size(), 6u);
}

TEST(ChunkSelectionTest, OutlierCountRule) {
  EXPECT_EQ(ResolveOutlierChunks(-1, 2048, 10000), 48);  // the paper's setting
  EXPECT_EQ(ResolveOutlierChunks(-1, 1024, 10000), 24);
  EXPECT_EQ(ResolveOutlierChunks(-1, 256, 10000), 6);
  EXPECT_EQ(ResolveOutlierChunks(-1, 16, 10000), 1);  // round(0.375) = 0, but at least one
  EXPECT_EQ(ResolveOutlierChunks(-1, 16, 0), 0);
  EXPECT_EQ(ResolveOutlierChunks(-1, 2048, 30), 30);  // capped at the chunks
  EXPECT_EQ(ResolveOutlierChunks(0, 2048, 100), 0);
  EXPECT_EQ(ResolveOutlierChunks(7, 2048, 100), 7);
}

// Naive fp64 version of ScoreLandmarks.
std::vector<double> NaiveScores(const std::vector<float>& q, int num_queries, int64_t stride,
                                int group, const std::vector<float>& landmarks, int num_landmarks,
                                int head_dim) {
  std::vector<double> best(num_landmarks, -1.0);
  for (int g = 0; g < group; ++g) {
    std::vector<double> sum(num_landmarks, 0.0);
    for (int i = 0; i < num_queries; ++i) {
      const float* qi = q.data() + i * stride + g * head_dim;
      std::vector<double> logits(num_landmarks);
      double max_logit = -1e300, total = 0;
      for (int l = 0; l < num_landmarks; ++l) {
        double dot = 0;
        for (int d = 0; d < head_dim; ++d) dot += double(qi[d]) * landmarks[l * head_dim + d];
        logits[l] = dot / std::sqrt(double(head_dim));
        max_logit = std::max(max_logit, logits[l]);
      }
      for (auto& x : logits) total += (x = std::exp(x - max_logit));
      for (int l = 0; l < num_landmarks; ++l) sum[l] += logits[l] / total;
    }
    for (int l = 0; l < num_landmarks; ++l) best[l] = std::max(best[l], sum[l]);
  }
  return best;
}

void CheckScores(int num_queries, int group, int num_landmarks, int head_dim = 64) {
  const int64_t stride = 3 * group * head_dim;  // this KV head's group inside wider rows
  auto q = Random(num_queries * stride, 10 + num_queries, 1.5f);
  auto landmarks = Random(num_landmarks * head_dim, 20 + num_landmarks, 1.5f);
  std::vector<float> scores(num_landmarks);
  ScoreScratch scratch;
  ScoreLandmarks(q.data(), num_queries, stride, group, landmarks.data(), num_landmarks, head_dim,
                 &scratch, scores.data());
  auto expected = NaiveScores(q, num_queries, stride, group, landmarks, num_landmarks, head_dim);
  for (int l = 0; l < num_landmarks; ++l) {
    ASSERT_NEAR(scores[l], expected[l], 2e-5 * expected[l] + 1e-9) << "landmark " << l;
  }
  // Top-k against a full sort of the reference scores.
  std::vector<float> order;
  std::vector<int32_t> selected;
  const int k = num_landmarks / 4;
  SelectTopK(scores, k, &order, &selected);
  std::vector<int32_t> all(num_landmarks);
  for (int i = 0; i < num_landmarks; ++i) all[i] = i;
  std::sort(all.begin(), all.end(), [&](int a, int b) { return expected[a] > expected[b]; });
  std::vector<int32_t> reference(all.begin(), all.begin() + k);
  std::sort(reference.begin(), reference.end());
  EXPECT_EQ(selected, reference);
}

TEST(ChunkSelectionTest, DecodeScoresMatchNaive) { CheckScores(1, 3, 300); }
TEST(ChunkSelectionTest, MultiQueryScoresMatchNaive) { CheckScores(45, 3, 200); }
TEST(ChunkSelectionTest, SingleHeadGroupScoresMatchNaive) { CheckScores(2, 1, 77); }
TEST(ChunkSelectionTest, OddHeadDimScoresMatchNaive) { CheckScores(1, 4, 101, 20); }
TEST(ChunkSelectionTest, LongLandmarkListScoresMatchNaive) { CheckScores(1, 7, 5000, 128); }

TEST(ChunkSelectionTest, SoftmaxSurvivesLargeLogits) {
  // A landmark far ahead of the rest: its softmax weight must be ~1, others ~0, no NaN.
  const int head_dim = 4;
  std::vector<float> q = {100, 0, 0, 0};
  std::vector<float> landmarks = {1, 0, 0, 0, -1, 0, 0, 0, 0, 5, 0, 0};
  std::vector<float> scores(3);
  ScoreScratch scratch;
  ScoreLandmarks(q.data(), 1, head_dim, 1, landmarks.data(), 3, head_dim, &scratch, scores.data());
  EXPECT_NEAR(scores[0], 1.0f, 1e-6);
  EXPECT_NEAR(scores[1], 0.0f, 1e-6);
  EXPECT_NEAR(scores[2], std::exp(-50.0), 1e-12);
}

TEST(ChunkSelectionTest, TopKBreaksTiesByLowerIndex) {
  const std::vector<float> scores = {0.5f, 0.7f, 0.5f, 0.1f, 0.7f, 0.5f};
  std::vector<float> order;
  std::vector<int32_t> selected;
  SelectTopK(scores, 3, &order, &selected);
  EXPECT_EQ(selected, std::vector<int32_t>({0, 1, 4}));
  SelectTopK(scores, 4, &order, &selected);
  EXPECT_EQ(selected, std::vector<int32_t>({0, 1, 2, 4}));
  SelectTopK(scores, 5, &order, &selected);
  EXPECT_EQ(selected, std::vector<int32_t>({0, 1, 2, 4, 5}));
  SelectTopK(scores, 10, &order, &selected);
  EXPECT_EQ(selected.size(), 6u);
  SelectTopK(scores, 0, &order, &selected);
  EXPECT_TRUE(selected.empty());
}

TEST(ChunkSelectionTest, SuccessorsFollowTheirLeadersWithinTheBudget) {
  // Hand case, chunks 0..7 all selectable: leaders by score 4 (0.9), 1 (0.8), 2 (0.7), 7 (0.6).
  const std::vector<float> scores = {0.1f, 0.8f, 0.7f, 0.2f, 0.9f, 0.3f, 0.0f, 0.6f};
  const std::vector<int32_t> chunks = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> shifted, values;
  std::vector<int32_t> selected;
  auto select = [&](const std::vector<float>& s, const std::vector<int32_t>& c, int64_t k) {
    SelectTopKWithSuccessors(s, c, k, &shifted, &values, &selected);
    return selected;
  };
  EXPECT_EQ(select(scores, chunks, 2), std::vector<int32_t>({4, 5}));  // top chunk, next one
  EXPECT_EQ(select(scores, chunks, 4), std::vector<int32_t>({1, 2, 4, 5}));
  EXPECT_EQ(select(scores, chunks, 5), std::vector<int32_t>({1, 2, 3, 4, 5}));  // 2's successor
  EXPECT_EQ(select(scores, chunks, 3), std::vector<int32_t>({1, 4, 5}));        // 1's successor cut
  EXPECT_EQ(select({0.1f, 0.2f, 0.9f}, {0, 1, 2}, 2), std::vector<int32_t>({1, 2}));  // no 3
  // Chunk 5 is an outlier (not in the list): item 4 (chunk 6) is not chunk 4's successor.
  EXPECT_EQ(select({0.1f, 0.2f, 0.3f, 0.4f, 0.9f, 0.5f}, {0, 1, 2, 3, 4, 6}, 2),
            std::vector<int32_t>({4, 5}));  // items 4 and 5: chunk 4 and the next best, 6
  EXPECT_EQ(select({0.1f, 0.2f, 0.3f, 0.4f, 0.9f, 0.5f}, {0, 1, 2, 3, 4, 5}, 2),
            std::vector<int32_t>({4, 5}));
  EXPECT_EQ(select({0.1f, 0.2f, 0.3f, 0.6f, 0.9f, 0.5f}, {0, 1, 2, 3, 4, 6}, 2),
            std::vector<int32_t>({3, 4}));  // chunk 6 does not follow chunk 4: 3 is next best
  EXPECT_TRUE(select(scores, chunks, 0).empty());
  EXPECT_EQ(select(scores, chunks, 20).size(), scores.size());
}

TEST(ChunkSelectionTest, PerHeadScoresAreTheRowsWhoseMaxIsTheScore) {
  const int group = 3, head_dim = 32, num_landmarks = 50, stride = group * head_dim;
  for (int num_queries : {1, 4}) {
    auto q = Random(num_queries * stride, 60 + num_queries, 1.5f);
    auto landmarks = Random(num_landmarks * head_dim, 61, 1.5f);
    std::vector<float> scores(num_landmarks), rows(group * num_landmarks);
    ScoreScratch scratch;
    ScoreLandmarks(q.data(), num_queries, stride, group, landmarks.data(), num_landmarks, head_dim,
                   &scratch, scores.data());
    ScoreLandmarksPerHead(q.data(), num_queries, stride, group, landmarks.data(), num_landmarks,
                          head_dim, &scratch, rows.data());
    for (int g = 0; g < group; ++g) {
      // Row g is head g scored as a group of one.
      const std::vector<float> head_queries(q.begin() + g * head_dim, q.end());
      auto expected =
          NaiveScores(head_queries, num_queries, stride, 1, landmarks, num_landmarks, head_dim);
      for (int l = 0; l < num_landmarks; ++l) {
        ASSERT_NEAR(rows[g * num_landmarks + l], expected[l], 2e-5 * expected[l] + 1e-9);
      }
    }
    for (int l = 0; l < num_landmarks; ++l) {
      float best = rows[l];
      for (int g = 1; g < group; ++g) best = std::max(best, rows[g * num_landmarks + l]);
      ASSERT_EQ(best, scores[l]) << "landmark " << l;
    }
  }
}

// Naive fp64 exact chunk scores: per query head softmax over every candidate token, summed over
// queries, summed over each chunk's tokens, max over the group.
std::vector<double> NaiveExactScores(const std::vector<float>& q, int num_queries, int64_t stride,
                                     int group, const std::vector<float>& keys, int num_chunks,
                                     int chunk, int head_dim) {
  const int tokens = num_chunks * chunk;
  std::vector<double> best(num_chunks, -1.0);
  for (int g = 0; g < group; ++g) {
    std::vector<double> mass(num_chunks, 0.0);
    for (int i = 0; i < num_queries; ++i) {
      const float* qi = q.data() + i * stride + g * head_dim;
      std::vector<double> logits(tokens);
      double top = -1e300, total = 0;
      for (int t = 0; t < tokens; ++t) {
        double dot = 0;
        for (int d = 0; d < head_dim; ++d) dot += double(qi[d]) * keys[t * head_dim + d];
        logits[t] = dot / std::sqrt(double(head_dim));
        top = std::max(top, logits[t]);
      }
      for (auto& x : logits) total += (x = std::exp(x - top));
      for (int t = 0; t < tokens; ++t) mass[t / chunk] += logits[t] / total;
    }
    for (int c = 0; c < num_chunks; ++c) best[c] = std::max(best[c], mass[c]);
  }
  return best;
}

TEST(ChunkSelectionTest, ExactChunkScoresMatchNaive) {
  const int group = 3, head_dim = 64, chunk = 8, num_chunks = 37;
  const int64_t stride = 2 * group * head_dim;
  for (int num_queries : {1, 5}) {
    auto q = Random(num_queries * stride, 70 + num_queries, 1.5f);
    auto keys = Random(num_chunks * chunk * head_dim, 71, 1.5f);
    std::vector<float> scores(num_chunks);
    ScoreScratch scratch;
    ScoreChunksExact(q.data(), num_queries, stride, group, keys.data(), num_chunks, chunk, head_dim,
                     &scratch, scores.data());
    auto expected =
        NaiveExactScores(q, num_queries, stride, group, keys, num_chunks, chunk, head_dim);
    for (int c = 0; c < num_chunks; ++c) {
      ASSERT_NEAR(scores[c], expected[c], 2e-5 * expected[c] + 1e-8) << "chunk " << c;
    }
  }
  // A chunk of one token is a landmark of itself: the exact scores equal the landmark scores.
  auto q = Random(stride, 72, 1.5f);
  auto keys = Random(20 * head_dim, 73, 1.5f);
  std::vector<float> exact(20), landmark(20);
  ScoreScratch scratch;
  ScoreChunksExact(q.data(), 1, stride, group, keys.data(), 20, 1, head_dim, &scratch,
                   exact.data());
  ScoreLandmarks(q.data(), 1, stride, group, keys.data(), 20, head_dim, &scratch, landmark.data());
  EXPECT_EQ(exact, landmark);
}

TEST(ChunkSelectionTest, RoundRobinTakesEachHeadsBestInTurn) {
  // Head 0 ranks 0,1,2,3,4,5; head 1 ranks 0,3,4,1,5,2 (by score).
  const std::vector<float> scores = {0.9f, 0.8f, 0.7f, 0.6f, 0.5f, 0.4f,  //
                                     0.9f, 0.3f, 0.1f, 0.8f, 0.7f, 0.2f};
  std::vector<int32_t> order, selected;
  auto select = [&](std::span<const float> s, int group, int64_t items, int64_t k) {
    SelectRoundRobinOverHeads(s, group, items, k, &order, &selected);
    return selected;
  };
  // Round 1: head 0 takes 0, head 1's best (0) is taken, so 3. Round 2: 1, then 4.
  EXPECT_EQ(select(scores, 2, 6, 1), std::vector<int32_t>({0}));
  EXPECT_EQ(select(scores, 2, 6, 2), std::vector<int32_t>({0, 3}));
  EXPECT_EQ(select(scores, 2, 6, 3), std::vector<int32_t>({0, 1, 3}));
  EXPECT_EQ(select(scores, 2, 6, 4), std::vector<int32_t>({0, 1, 3, 4}));
  EXPECT_EQ(select(scores, 2, 6, 5), std::vector<int32_t>({0, 1, 2, 3, 4}));
  EXPECT_EQ(select(scores, 2, 6, 9).size(), 6u);
  EXPECT_TRUE(select(scores, 2, 6, 0).empty());
  // The max over the group would take 0, 1, 3 for k = 3 too, but for k = 2 it takes {0, 1}.
  // Ties within a head: lower index first.
  const std::vector<float> ties = {0.5f, 0.5f, 0.5f, 0.1f};
  EXPECT_EQ(select(ties, 1, 4, 2), std::vector<int32_t>({0, 1}));
  // Against a naive version on random scores.
  auto random = Random(4 * 40, 80);
  for (int64_t k : {1, 7, 13, 40}) {
    auto got = select(random, 4, 40, k);
    std::vector<std::vector<int32_t>> ranked(4);
    for (int g = 0; g < 4; ++g) {
      for (int i = 0; i < 40; ++i) ranked[g].push_back(i);
      std::stable_sort(ranked[g].begin(), ranked[g].end(),
                       [&](int a, int b) { return random[g * 40 + a] > random[g * 40 + b]; });
    }
    std::vector<int32_t> expected;
    std::vector<bool> taken(40, false);
    for (int round = 0; static_cast<int64_t>(expected.size()) < k; ++round) {
      for (int g = 0; g < 4 && static_cast<int64_t>(expected.size()) < k; ++g) {
        for (int32_t item : ranked[g]) {
          if (!taken[item]) {
            taken[item] = true;
            expected.push_back(item);
            break;
          }
        }
      }
    }
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(got, expected) << "k " << k;
  }
}

TEST(ChunkSelectionTest, MassBoundsAroundTheBudget) {
  EXPECT_EQ(MassSelectionBounds(8, 100).floor, 2);
  EXPECT_EQ(MassSelectionBounds(8, 100).cap, 16);
  EXPECT_EQ(MassSelectionBounds(2, 100).floor, 1);  // never below one chunk
  EXPECT_EQ(MassSelectionBounds(2, 100).cap, 4);
  EXPECT_EQ(MassSelectionBounds(8, 10).cap, 10);  // no more than there are
  EXPECT_EQ(MassSelectionBounds(8, 1).floor, 1);
  EXPECT_EQ(MassSelectionBounds(8, 1).cap, 1);
  EXPECT_EQ(MassSelectionBounds(8, 0).floor, 0);
}

TEST(ChunkSelectionTest, MassTakesTheFewestChunksHoldingTheShare) {
  // Total 10: chunk 1 holds 4, chunk 3 holds 3, chunk 2 holds 2, chunk 0 holds 1.
  const std::vector<float> scores = {1, 4, 2, 3};
  std::vector<int32_t> order, selected;
  auto select = [&](std::span<const float> s, double mass, int64_t floor, int64_t cap) {
    SelectByMass(s, mass, {floor, cap}, &order, &selected);
    return selected;
  };
  EXPECT_EQ(select(scores, 0.3, 1, 4), std::vector<int32_t>({1}));
  EXPECT_EQ(select(scores, 0.5, 1, 4), std::vector<int32_t>({1, 3}));
  EXPECT_EQ(select(scores, 0.7, 1, 4), std::vector<int32_t>({1, 3}));  // exactly at the share
  EXPECT_EQ(select(scores, 0.71, 1, 4), std::vector<int32_t>({1, 2, 3}));
  EXPECT_EQ(select(scores, 1.0, 1, 4), std::vector<int32_t>({0, 1, 2, 3}));
  EXPECT_EQ(select(scores, 0.3, 3, 4), std::vector<int32_t>({1, 2, 3}));  // the floor binds
  EXPECT_EQ(select(scores, 0.9, 1, 2), std::vector<int32_t>({1, 3}));     // the cap binds
  // Scaling every score leaves the choice alone (only shares count).
  EXPECT_EQ(select(std::vector<float>{10, 40, 20, 30}, 0.5, 1, 4), std::vector<int32_t>({1, 3}));
  // Ties: lower index first; a zero total takes the floor.
  EXPECT_EQ(select(std::vector<float>{2, 2, 2, 2}, 0.5, 1, 4), std::vector<int32_t>({0, 1}));
  EXPECT_EQ(select(std::vector<float>{0, 0, 0, 0}, 0.5, 2, 4), std::vector<int32_t>({0, 1}));
  EXPECT_TRUE(select(scores, 0.5, 0, 0).empty());
}

TEST(ChunkSelectionTest, GatherSlotsCountHitsAndReuseSlots) {
  GatherSlots slots;
  slots.Resize(3, 10);
  std::vector<GatherSlots::Fill> misses;
  const std::vector<int32_t> first = {1, 2, 3};
  EXPECT_EQ(slots.Assign(first, &misses), 0);
  EXPECT_EQ(misses.size(), 3u);
  EXPECT_EQ(slots.Assign(first, &misses), 3);  // same selection: all hits, nothing to fetch
  EXPECT_TRUE(misses.empty());
  const int32_t slot_of_two = slots.slot_of_item(2);
  const int32_t slot_of_one = slots.slot_of_item(1);
  const std::vector<int32_t> second = {2, 3, 7};
  EXPECT_EQ(slots.Assign(second, &misses), 2);  // overlap {2, 3}
  ASSERT_EQ(misses.size(), 1u);
  EXPECT_EQ(misses[0].item, 7);
  EXPECT_EQ(misses[0].slot, slot_of_one);  // 7 takes the slot 1 left
  EXPECT_EQ(slots.slot_of_item(2), slot_of_two);
  EXPECT_EQ(slots.slot_of_item(1), -1);
  // Growing keeps what is held.
  slots.Resize(4, 12);
  const std::vector<int32_t> third = {2, 3, 7, 11};
  EXPECT_EQ(slots.Assign(third, &misses), 3);
  ASSERT_EQ(misses.size(), 1u);
  EXPECT_EQ(misses[0].slot, 3);
  EXPECT_EQ(slots.item_in_slot(3), 11);
}

}  // namespace
}  // namespace shadowkv::kv
