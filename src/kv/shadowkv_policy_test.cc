// Tests of the ShadowKV policy: equivalence with full attention, selection, hits, graduation.
#include "kv/shadowkv_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include "kv/policies.h"
#include "support/shadowkv_test_util.h"

namespace shadowkv::kv {
namespace {

using namespace shadowkv_testing;

TEST(ShadowKvTest, ExactLayersAttendLikeFullAttentionAndOthersAreCompressed) {
  // A small budget and rank: compressed layers differ from full attention, exact ones do not.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 23);
  auto full = MakePolicy(KvPolicyConfig{}, g);
  KvPolicyConfig config = ShadowConfig(8, 16, 1, 16);
  config.budget_tokens = 32;
  config.exact_layers = 1;
  auto shadow = MakePolicy(config, g);
  ASSERT_TRUE(full && shadow);
  Runner expected(*full, stream), actual(*shadow, stream);
  for (Runner* r : {&expected, &actual}) r->Step(300, true);
  EXPECT_FALSE(actual.shadow().Inspect(0).compressed);
  EXPECT_TRUE(actual.shadow().Inspect(1).compressed);
  for (int step = 0; step < 20; ++step) {
    for (Runner* r : {&expected, &actual}) r->Step(1);
    EXPECT_LT(RelativeError({actual.outputs()[0]}, {expected.outputs()[0]}), 1e-6);
    EXPECT_GT(RelativeError({actual.outputs()[1]}, {expected.outputs()[1]}), 1e-3);
  }
  EXPECT_FALSE(actual.shadow().Inspect(0).compressed);  // still exact after 20 more tokens
  config.exact_layers = -1;
  EXPECT_FALSE(MakeKvPolicy(config, g).ok());
}

TEST(ShadowKvTest, FullRankFullBudgetEqualsFullAttention) {
  CheckEquivalence({8, 32, 300, 0, 0, 0});
}
TEST(ShadowKvTest, EquivalentWithOutliers) { CheckEquivalence({8, 32, 301, 5, 0, 0}); }
TEST(ShadowKvTest, EquivalentWithDefaultOutliersAndSmallChunks) {
  CheckEquivalence({4, 10, 297, -1, 0, 0});
}
TEST(ShadowKvTest, EquivalentWithoutLocalWindow) { CheckEquivalence({16, 0, 300, 2, 0, 0}); }
TEST(ShadowKvTest, OneBasisPerKvHeadAtFullRankEqualsFullAttention) {
  // Three basis groups (one per KV head, as three tensor-parallel ranks), each at full rank.
  CheckEquivalence({8, 32, 300, 3, 0, 0, 3});
}
TEST(ShadowKvTest, BasisGroupsMustDivideTheKvHeads) {
  const KvGeometry g = TestGeometry();  // 3 KV heads
  KvPolicyConfig config = ShadowConfig(8, 32, 0);
  config.basis_groups = 2;
  const auto two = MakeKvPolicy(config, g);
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("3 KV heads"), std::string::npos) << two.status().message();
  config.basis_groups = 0;
  EXPECT_FALSE(MakeKvPolicy(config, g).ok());
  config.basis_groups = 3;
  EXPECT_TRUE(MakeKvPolicy(config, g).ok());
}
TEST(ShadowKvTest, LowRankKeysAreExactAtTheirRank) {
  // Keys of rank 24 are rebuilt exactly from a rank-24 factorisation.
  CheckEquivalence({8, 32, 300, 3, 24, 24});
}

TEST(ShadowKvTest, ShortPromptCompressesOnceItCan) {
  // 20 prompt tokens: no chunk at FinishPrefill; compression happens during generation.
  CheckEquivalence({8, 32, 20, 1, 0, 0});
}

TEST(ShadowKvTest, RebuiltKeysAreRopedAtTheirPositions) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 5);
  KvPolicyConfig config = ShadowConfig(8, 32, 2, g.kv_width());
  config.budget_tokens = 64;  // 8 chunks of 33
  ForEachHeadAtFirstDecode(
      stream, config,
      [&](int layer, int h, const std::vector<KvSegment>& segments, const ShadowKvLayerInfo& info) {
        const KvSegment& gathered = segments[1];
        ASSERT_EQ(info.gathered_chunks[h].size(), 8u);
        ASSERT_EQ(gathered.num_tokens, 64);
        for (size_t slot = 0; slot < 8; ++slot) {
          const int64_t chunk = info.gathered_chunks[h][slot];
          auto keys = ChunkRows(stream, layer, h, 8, chunk, false);
          auto values = ChunkRows(stream, layer, h, 8, chunk, true);
          for (int i = 0; i < 8 * 64; ++i) {
            ASSERT_NEAR(gathered.keys[slot * 8 * 64 + i], keys[i], 1e-4) << "chunk " << chunk;
            ASSERT_EQ(gathered.values[slot * 8 * 64 + i], values[i]);
          }
        }
        // The outlier segment holds the exact rows of the outlier chunks.
        const KvSegment& outliers = segments[0];
        ASSERT_EQ(outliers.num_tokens, 16);
        for (size_t k = 0; k < 2; ++k) {
          auto keys = ChunkRows(stream, layer, h, 8, info.outlier_chunks[h][k], false);
          for (int i = 0; i < 8 * 64; ++i) ASSERT_EQ(outliers.keys[k * 8 * 64 + i], keys[i]);
        }
      });
}

// Naive selection for one KV head at the first decode step: outliers by min-cosine, landmarks as
// means, softmax per query head, max over the group, top-k (fp64 throughout).
std::set<int64_t> NaiveSelection(const TokenStream& stream, int layer, int h, int chunk_size,
                                 int64_t num_chunks, int64_t outliers, int64_t k,
                                 const std::vector<float>& queries,
                                 std::set<int64_t>* outlier_set) {
  const KvGeometry& g = stream.geometry();
  const int d = g.head_dim;
  std::vector<std::vector<double>> landmarks(num_chunks, std::vector<double>(d, 0.0));
  std::vector<std::pair<double, int64_t>> min_cos;
  for (int64_t c = 0; c < num_chunks; ++c) {
    auto keys = ChunkRows(stream, layer, h, chunk_size, c, false);
    for (int t = 0; t < chunk_size; ++t)
      for (int i = 0; i < d; ++i) landmarks[c][i] += keys[t * d + i] / chunk_size;
    double lowest = 2.0;
    for (int t = 0; t < chunk_size; ++t) {
      double dot = 0, nk = 0, nl = 0;
      for (int i = 0; i < d; ++i) {
        dot += landmarks[c][i] * keys[t * d + i];
        nk += double(keys[t * d + i]) * keys[t * d + i];
        nl += landmarks[c][i] * landmarks[c][i];
      }
      lowest = std::min(lowest, dot / std::sqrt(nk * nl));
    }
    min_cos.push_back({lowest, c});
  }
  std::sort(min_cos.begin(), min_cos.end());
  outlier_set->clear();
  for (int64_t i = 0; i < outliers; ++i) outlier_set->insert(min_cos[i].second);
  std::vector<double> best(num_chunks, -1.0);
  for (int q = 0; q < g.group_size(); ++q) {
    const float* query = queries.data() + (h * g.group_size() + q) * d;
    std::vector<double> logits(num_chunks, -1e300);
    double top = -1e300, total = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (outlier_set->count(c)) continue;
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += query[i] * landmarks[c][i];
      logits[c] = dot / std::sqrt(double(d));
      top = std::max(top, logits[c]);
    }
    for (int64_t c = 0; c < num_chunks; ++c)
      if (!outlier_set->count(c)) total += std::exp(logits[c] - top);
    for (int64_t c = 0; c < num_chunks; ++c)
      if (!outlier_set->count(c)) best[c] = std::max(best[c], std::exp(logits[c] - top) / total);
  }
  std::vector<int64_t> order;
  for (int64_t c = 0; c < num_chunks; ++c)
    if (!outlier_set->count(c)) order.push_back(c);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return best[a] > best[b]; });
  return std::set<int64_t>(order.begin(), order.begin() + k);
}

// Appends one decode token at every layer with `queries` (or the stream's own) and prepares.
void DecodeWith(Runner& runner, const TokenStream& stream, int64_t position,
                const std::vector<float>* queries = nullptr) {
  for (int layer = 0; layer < stream.geometry().num_layers; ++layer) {
    AttentionInput input;
    ASSERT_NO_FATAL_FAILURE(runner.AppendOne(layer, static_cast<int>(position),
                                             queries ? queries->data() : nullptr, &input));
  }
}

TEST(ShadowKvTest, SelectionMatchesNaiveLandmarkScoring) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 23);
  KvPolicyConfig config = ShadowConfig(8, 32, 4, 32);  // low rank: selection does not need keys
  config.budget_tokens = 80;                           // K = 10 of 33 chunks
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  DecodeWith(runner, stream, 300);
  for (int layer = 0; layer < g.num_layers; ++layer) {
    const auto info = runner.shadow().Inspect(layer);
    ASSERT_EQ(info.num_chunks, 33);
    const auto queries = stream.Make(layer, 300).queries;
    for (int h = 0; h < g.num_kv_heads; ++h) {
      std::set<int64_t> outliers;
      auto expected = NaiveSelection(stream, layer, h, 8, 33, 4, 10, queries, &outliers);
      EXPECT_EQ(AsSet(info.outlier_chunks[h]), outliers) << "layer " << layer << " head " << h;
      EXPECT_EQ(AsSet(info.gathered_chunks[h]), expected) << "layer " << layer << " head " << h;
      EXPECT_EQ(info.landmark_chunks[h].size(), 29u);
    }
  }
}

TEST(ShadowKvTest, OutlierIsTheChunkWithAStrayKey) {
  // No rotation, every key near +e0 except one key of chunk 5 in KV head 1.
  const KvGeometry g = TestGeometry(/*rotary_dim=*/0);
  KvPolicyConfig config = ShadowConfig(8, 8, 1, 16);
  auto policy = MakePolicy(config, g);
  auto sequence = std::move(policy->NewSequence()).value();
  const int tokens = 8 * 10 + 8;
  std::mt19937 rng(3);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  std::vector<float> keys(tokens * g.kv_width()), values(keys.size(), 1.0f);
  for (int t = 0; t < tokens; ++t)
    for (int j = 0; j < g.kv_width(); ++j)
      keys[t * g.kv_width() + j] = (j % 64 == 0 ? 3 : 0) + noise(rng);
  float* stray = keys.data() + (5 * 8 + 2) * g.kv_width() + 64;
  std::fill(stray, stray + 64, 0.0f);
  stray[7] = 3.0f;
  for (int layer = 0; layer < g.num_layers; ++layer) {
    TokenBlock block{tokens, 0, keys.data(), keys.data(), values.data(), nullptr};
    ASSERT_TRUE(sequence->Append(layer, block).ok());
    ASSERT_TRUE(sequence->FinishPrefill(layer).ok());
    const auto info = dynamic_cast<ShadowKvSequence&>(*sequence).Inspect(layer);
    EXPECT_EQ(info.outlier_chunks[1], std::vector<int32_t>({5}));
    const auto& landmarks = info.landmark_chunks[1];
    EXPECT_EQ(std::count(landmarks.begin(), landmarks.end(), 5), 0);
    EXPECT_EQ(landmarks.size(), 9u);
  }
}

TEST(ShadowKvTest, HitsCountTheOverlapOfConsecutiveSelections) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 31);
  KvPolicyConfig config = ShadowConfig(8, 32, 2, 64);
  config.budget_tokens = 96;  // K = 12 of 31 landmarks
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);  // 36 exact tokens: the next three steps graduate nothing
  const auto first_queries = stream.Make(0, 300).queries;
  DecodeWith(runner, stream, 300, &first_queries);
  const PolicyStats after_first = runner.sequence().stats();
  const int64_t selections = 2 * 3 * 12;  // layers x KV heads x K
  EXPECT_EQ(after_first.chunk_selections, selections);
  EXPECT_EQ(after_first.chunk_hits, 0);
  EXPECT_EQ(after_first.bytes_fetched, selections * 8 * 64 * 4);

  // The same query again: every chunk is a hit and nothing is fetched.
  DecodeWith(runner, stream, 301, &first_queries);
  const PolicyStats after_second = runner.sequence().stats();
  EXPECT_EQ(after_second.chunk_selections - after_first.chunk_selections, selections);
  EXPECT_EQ(after_second.chunk_hits - after_first.chunk_hits, selections);
  EXPECT_EQ(after_second.bytes_fetched, after_first.bytes_fetched);

  // A new query: hits are the overlap of the two selections.
  std::vector<std::vector<std::set<int64_t>>> before(2);
  for (int layer = 0; layer < 2; ++layer)
    for (const auto& chunks : runner.shadow().Inspect(layer).gathered_chunks)
      before[layer].push_back(AsSet(chunks));
  DecodeWith(runner, stream, 302);
  int64_t overlap = 0;
  for (int layer = 0; layer < 2; ++layer) {
    const auto info = runner.shadow().Inspect(layer);
    for (int h = 0; h < 3; ++h) {
      for (int64_t chunk : AsSet(info.gathered_chunks[h])) overlap += before[layer][h].count(chunk);
    }
  }
  const PolicyStats after_third = runner.sequence().stats();
  EXPECT_GT(overlap, 0);
  EXPECT_LT(overlap, selections);
  EXPECT_EQ(after_third.chunk_hits - after_second.chunk_hits, overlap);
  EXPECT_EQ(after_third.bytes_fetched - after_second.bytes_fetched,
            (selections - overlap) * 8 * 64 * 4);
  ASSERT_EQ(runner.sequence().layer_stats().size(), 2u);
  EXPECT_EQ(runner.sequence().layer_stats()[0].prepare_calls, 4);
}

TEST(ShadowKvTest, GraduationKeepsTheWindowBoundedAndFileStoreMatchesRam) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 41);
  KvPolicyConfig config = ShadowConfig(8, 32, -1, 48);
  config.budget_tokens = 64;
  const auto directory =
      std::filesystem::temp_directory_path() / ("skv_policy_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  KvPolicyConfig file_config = config;
  file_config.value_store_path = directory.string();
  auto ram_policy = MakePolicy(config, g);
  auto file_policy = MakePolicy(file_config, g);
  Runner ram(*ram_policy, stream), file(*file_policy, stream);
  for (Runner* r : {&ram, &file}) r->Step(300, true);
  // 33 chunks, 36 exact tokens; O = round(64/1024*24) = 2 outliers per head.
  EXPECT_EQ(ram.shadow().Inspect(0).num_chunks, 33);
  EXPECT_EQ(ram.shadow().Inspect(0).exact_tokens, 36);
  EXPECT_EQ(ram.shadow().Inspect(0).outlier_chunks[0].size(), 2u);
  const MemoryUsage estimate = ram_policy->EstimateMemory(300);
  EXPECT_EQ(ram.sequence().memory().fast_bytes, estimate.fast_bytes);
  EXPECT_EQ(ram.sequence().memory().slow_bytes, estimate.slow_bytes);
  EXPECT_EQ(estimate.slow_bytes, 2LL * 31 * 8 * g.kv_width() * 4);  // layers x landmark chunks

  for (int step = 0; step < 5 * 8; ++step) {
    for (Runner* r : {&ram, &file}) r->Step(1);
    ASSERT_EQ(ram.outputs(), file.outputs()) << "step " << step;  // bit for bit
    const auto info = ram.shadow().Inspect(1);
    EXPECT_GE(info.exact_tokens, 32);
    EXPECT_LT(info.exact_tokens, 32 + 8);
  }
  const auto info = ram.shadow().Inspect(1);
  EXPECT_EQ(info.num_chunks, 38);
  EXPECT_EQ(info.exact_tokens, 36);
  EXPECT_EQ(info.exact_first_position, 304);
  EXPECT_EQ(info.landmark_chunks[0].size(), 36u);
  EXPECT_EQ(info.landmark_chunks[0].back(), 37);
  EXPECT_EQ(ram.sequence().memory().slow_bytes, 2LL * 36 * 8 * g.kv_width() * 4);
  EXPECT_EQ(file.sequence().memory().slow_bytes, ram.sequence().memory().slow_bytes);
  EXPECT_TRUE(std::filesystem::is_empty(directory));  // the backing file is unlinked
  std::filesystem::remove_all(directory);
}

TEST(ShadowKvTest, FastTierIsSmallerThanFullAtLongContext) {
  const KvGeometry g = TestGeometry();
  auto full = MakePolicy(KvPolicyConfig{}, g);
  KvPolicyConfig config;
  config.policy = "shadowkv";
  auto shadow = MakePolicy(config, g);
  const int64_t tokens = 16000;
  // The defaults, per layer: A 15968x48, B 48x192, 1996 landmarks x 192 minus outliers, window,
  // gather slots of the 512-token budget floor.
  const MemoryUsage m = shadow->EstimateMemory(tokens);
  EXPECT_LT(m.fast_bytes * 3, full->EstimateMemory(tokens).fast_bytes);
  EXPECT_GT(m.slow_bytes, 0);
  // Too short to chunk (fewer than window + chunk tokens): exact K, pre-RoPE K and V only.
  EXPECT_EQ(shadow->EstimateMemory(39).fast_bytes, 3LL * 39 * g.kv_width() * 4 * g.num_layers);
  EXPECT_EQ(shadow->EstimateMemory(39).slow_bytes, 0);
}

TEST(ShadowKvTest, ImpossibleSettingsAreClearErrors) {
  const KvGeometry g = TestGeometry();
  KvPolicyConfig config;
  config.policy = "shadowkv";
  config.rank = 400;
  auto too_high = MakeKvPolicy(config, g);
  ASSERT_FALSE(too_high.ok());
  EXPECT_EQ(too_high.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(too_high.status().message().find("400"), std::string::npos);
  EXPECT_NE(too_high.status().message().find("192"), std::string::npos);

  config.rank = 0;
  config.budget_tokens = 4;
  auto tiny_budget = MakeKvPolicy(config, g);
  ASSERT_FALSE(tiny_budget.ok());
  EXPECT_NE(tiny_budget.status().message().find("below one chunk"), std::string::npos);

  config.budget_tokens = 0;
  config.chunk_size = 0;
  EXPECT_FALSE(MakeKvPolicy(config, g).ok());

  config.chunk_size = 8;
  config.value_store_path = "/nonexistent/skv";
  EXPECT_FALSE(MakeKvPolicy(config, g).ok());

  // A fractional budget that is below one chunk for this context fails at FinishPrefill.
  config.value_store_path.clear();
  config.budget_min_tokens = 0;
  config.budget_fraction = 0.01;
  auto policy = MakePolicy(config, g);
  auto sequence = std::move(policy->NewSequence()).value();
  TokenStream stream(g, 0, 1);
  auto token = stream.Make(0, 0);
  std::vector<float> rows;
  for (int t = 0; t < 100; ++t) rows.insert(rows.end(), token.pre.begin(), token.pre.end());
  TokenBlock block{100, 0, rows.data(), rows.data(), rows.data(), nullptr};
  ASSERT_TRUE(sequence->Append(0, block).ok());
  const Status finish = sequence->FinishPrefill(0);
  ASSERT_FALSE(finish.ok());
  EXPECT_EQ(finish.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(finish.message().find("below one chunk"), std::string::npos);
}

TEST(ShadowKvTest, SequencesOnSeparateThreadsMatchSerialRuns) {
  // One policy, three sequences driven concurrently: nothing may be shared between them.
  const KvGeometry g = TestGeometry();
  KvPolicyConfig config = ShadowConfig(8, 16, 2, 48);
  config.budget_tokens = 48;
  auto policy = MakePolicy(config, g);
  std::vector<std::unique_ptr<TokenStream>> streams;
  for (uint32_t seed : {101u, 202u, 303u})
    streams.push_back(std::make_unique<TokenStream>(g, 0, seed));
  auto drive = [&](int i, std::vector<std::vector<float>>* last) {
    Runner runner(*policy, *streams[i]);
    runner.Step(120 + 17 * i, true);
    for (int step = 0; step < 12; ++step) runner.Step(1);
    *last = runner.outputs();
  };
  std::vector<std::vector<std::vector<float>>> serial(3), threaded(3);
  for (int i = 0; i < 3; ++i) drive(i, &serial[i]);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) threads.emplace_back(drive, i, &threaded[i]);
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(serial[i], threaded[i]) << "sequence " << i;
}

// --- FP8 values and landmarks ---

// Landmarks summed over every layer and KV head.
}  // namespace
}  // namespace shadowkv::kv
