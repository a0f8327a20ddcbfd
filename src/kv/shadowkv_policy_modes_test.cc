// Tests of ShadowKV's rank from the spectrum and its chunk selection modes at the policy level.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kv/policies.h"
#include "kv/shadowkv_policy.h"
#include "support/shadowkv_test_util.h"

namespace shadowkv::kv {
namespace {

using namespace shadowkv_testing;

const std::vector<std::string> kModes = {"landmarks", "rerank", "heads", "mass"};

TEST(ShadowKvModesTest, EveryModeAtFullBudgetAndRankEqualsFullAttention) {
  for (const std::string& mode : kModes) {
    SCOPED_TRACE(mode);
    CheckEquivalence({8, 32, 300, 2, 0, 0, 1, mode});
  }
}

TEST(ShadowKvModesTest, RankEnergyOneIsTheFullWidthAndExact) {
  CheckEquivalence({8, 32, 300, 2, 0, 0, 1, "landmarks", 1.0});
  CheckEquivalence({8, 32, 300, 3, 0, 0, 3, "rerank", 1.0});  // one basis per KV head
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 3);
  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  config.rank_energy = 1.0;
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  for (int layer = 0; layer < g.num_layers; ++layer) {
    EXPECT_EQ(runner.shadow().Inspect(layer).rank, g.kv_width());
  }
}

TEST(ShadowKvModesTest, RankFromTheSpectrumFollowsTheKeysOwnRank) {
  // Keys of rank 24: 99% of their energy needs 24 directions (a multiple of 8) and those
  // rebuild them exactly, so attention at full budget is full attention's.
  CheckEquivalence({8, 32, 300, 3, 24, 0, 1, "landmarks", 0.99});
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 24, 17);
  KvPolicyConfig config = ShadowConfig(8, 32, 3);
  config.rank_energy = 0.99;
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  const MemoryUsage estimate = policy->EstimateMemory(300);
  for (int layer = 0; layer < g.num_layers; ++layer) {
    EXPECT_EQ(runner.shadow().Inspect(layer).rank, 24) << "layer " << layer;
  }
  // The estimate assumes the cap (the width): an upper bound of what the layers hold.
  EXPECT_LT(runner.sequence().memory().fast_bytes, estimate.fast_bytes);
  config.rank_max = 16;  // the cap binds
  auto capped = MakePolicy(config, g);
  Runner capped_runner(*capped, stream);
  capped_runner.Step(300, true);
  EXPECT_EQ(capped_runner.shadow().Inspect(1).rank, 16);
  EXPECT_EQ(capped_runner.sequence().memory().fast_bytes, capped->EstimateMemory(300).fast_bytes);
  config.rank_max = 200;  // above the width of 192
  const auto too_wide = MakeKvPolicy(config, g);
  ASSERT_FALSE(too_wide.ok());
  EXPECT_NE(too_wide.status().message().find("192"), std::string::npos);
}

// One wide KV head (Gemma 3's 256): the default rank is half the head (128), not the ratio's
// 40 or rank_min's 48; the published rule has no floor; the head floor also bounds the energy
// rule from below.
TEST(ShadowKvModesTest, WideKvHeadsKeepHalfTheirWidth) {
  KvGeometry g = TestGeometry();
  g.num_query_heads = 4;
  g.num_kv_heads = 1;
  g.head_dim = 256;
  g.rope.rotary_dim = 256;
  TokenStream stream(g, 16, 5);
  auto rank_of = [&](const KvPolicyConfig& config) {
    auto policy = MakePolicy(config, g);
    Runner runner(*policy, stream);
    runner.Step(600, true);
    return runner.shadow().Inspect(0).rank;
  };
  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  config.rank_min = 48;
  config.rank_head_ratio = 0.5;  // the defaults' floors
  EXPECT_EQ(rank_of(config), 128);
  config.rank_head_ratio = 0.0;
  EXPECT_EQ(rank_of(config), 48);
  config.rank_min = 0;
  EXPECT_EQ(rank_of(config), 40);  // the ratio alone: 256 / 6.4
  config.rank_head_ratio = 0.5;
  config.rank_energy = 0.99;  // keys of rank 16: the spectrum alone would keep 16
  EXPECT_EQ(rank_of(config), 128);
  config.rank_max = 64;  // an explicit cap binds over the floor
  EXPECT_EQ(rank_of(config), 64);
  KvPolicyConfig paper;
  paper.policy = "shadowkv";
  paper.paper = 1;
  EXPECT_EQ(rank_of(paper), 40);  // the published rule: no floor
  KvPolicyConfig defaults;
  defaults.policy = "shadowkv";
  EXPECT_EQ(rank_of(defaults), 128);
}

// Sparse budget, full rank: each mode through prefill, decode steps that graduate chunks and a
// multi-token turn. At every step each KV head attends its outliers, the chunks its gather slots
// hold (their keys and values exactly the stream's, rebuilt or reused) and the window; the
// attended count is what the policy reports.
// With `rerank_rank` > 0 the re-rank scores candidates with that many components, and the
// kept chunks must still hold their exact (full-rank) keys. With `exact_keys` the rank is 16 of
// the keys' 192 dimensions, and the gathered keys come from the key store: the stream's keys
// bit for bit.
void CheckSparseMode(const std::string& mode, int rerank_rank = 0, bool exact_keys = false) {
  SCOPED_TRACE(mode);
  SCOPED_TRACE(rerank_rank);
  SCOPED_TRACE(exact_keys);
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 29);
  KvPolicyConfig config = ShadowConfig(8, 32, 2, exact_keys ? 16 : g.kv_width());
  config.exact_keys = exact_keys ? 1 : 0;
  const float key_tolerance = exact_keys ? 0.0f : 1e-4f;
  config.budget_tokens = 64;  // K = 8 chunks
  config.selection = mode;
  config.rerank_factor = 2;
  config.rerank_rank = rerank_rank;
  config.select_mass = 0.5;
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  int64_t position = 300;
  int64_t partly_filled = 0;  // head steps that left some gather slots empty
  for (int step = 0; step < 24; ++step) {
    const int count = step == 12 ? 9 : 1;
    if (count == 1) {
      for (int layer = 0; layer < g.num_layers; ++layer) {
        const PolicyStats before = runner.sequence().layer_stats()[layer];
        AttentionInput input;
        ASSERT_NO_FATAL_FAILURE(
            runner.AppendOne(layer, static_cast<int>(position), nullptr, &input));
        PolicyStats added = runner.sequence().layer_stats()[layer];
        added -= before;
        const auto info = runner.shadow().Inspect(layer);
        int64_t attended = 0;
        for (int h = 0; h < g.num_kv_heads; ++h) {
          const auto& segments = input.heads[h];
          ASSERT_GE(segments.size(), 3u);
          std::vector<int64_t> held;
          for (int64_t chunk : info.gathered_chunks[h]) {
            if (chunk >= 0) held.push_back(chunk);
          }
          const std::set<int64_t> distinct(held.begin(), held.end());
          ASSERT_EQ(distinct.size(), held.size());
          for (int64_t chunk : held) {
            ASSERT_EQ(AsSet(info.outlier_chunks[h]).count(chunk), 0u);
            ASSERT_LT(chunk, info.num_chunks);
          }
          partly_filled += held.size() < info.gathered_chunks[h].size();
          if (mode == "mass") {
            ASSERT_GE(held.size(), 2u);   // floor K/4
            ASSERT_LE(held.size(), 16u);  // cap 2K
          } else {
            ASSERT_EQ(held.size(), 8u);
          }
          // The gathered segments, in slot order, hold the chunks' exact rows.
          size_t next = 0;
          int row = 0;
          for (size_t s = 1; s + 1 < segments.size(); ++s) {
            for (int t = 0; t < segments[s].num_tokens; ++t, ++row) {
              if (row == 8) {
                row = 0;
                ++next;
              }
              ASSERT_LT(next, held.size());
              const auto keys = ChunkRows(stream, layer, h, 8, held[next], false);
              const auto values = ChunkRows(stream, layer, h, 8, held[next], true);
              for (int d = 0; d < g.head_dim; ++d) {
                ASSERT_NEAR(segments[s].keys[t * g.head_dim + d], keys[row * g.head_dim + d],
                            key_tolerance);
                ASSERT_EQ(segments[s].values[t * g.head_dim + d], values[row * g.head_dim + d]);
              }
            }
          }
          ASSERT_EQ(next + 1, held.size());
          ASSERT_TRUE(segments.back().causal);
          attended += input.num_tokens(h);
        }
        EXPECT_EQ(added.attended_tokens, attended / g.num_kv_heads);
      }
    } else {
      // A multi-token turn (its queries select together), appended and prepared at each layer.
      for (int layer = 0; layer < g.num_layers; ++layer) {
        const TokenStream::Block tokens = stream.MakeBlock(layer, position, count);
        const TokenBlock block = tokens.View();
        ASSERT_TRUE(runner.sequence().Append(layer, block).ok());
        AttentionInput input;
        ASSERT_TRUE(runner.sequence().Prepare(layer, tokens.queries.data(), count, &input).ok());
        ASSERT_TRUE(input.heads[0].back().causal);
      }
    }
    position += count;
  }
  EXPECT_GT(runner.shadow().Inspect(0).num_chunks, 33 + 3);  // chunks graduated
  EXPECT_GT(runner.sequence().stats().chunk_hits, 0);        // reuse still counted
  // Only "mass" selects fewer chunks than it has slots (then in several runs of slots).
  if (mode == "mass") {
    EXPECT_GT(partly_filled, 0);
  } else {
    EXPECT_EQ(partly_filled, 0);
  }
}

TEST(ShadowKvModesTest, LandmarksSparseStepsHoldExactChunks) { CheckSparseMode("landmarks"); }
TEST(ShadowKvModesTest, RerankSparseStepsHoldExactChunks) { CheckSparseMode("rerank"); }
TEST(ShadowKvModesTest, RerankAtALowerRankStillHoldsExactChunks) { CheckSparseMode("rerank", 8); }
TEST(ShadowKvModesTest, HeadsSparseStepsHoldExactChunks) { CheckSparseMode("heads"); }
TEST(ShadowKvModesTest, MassSparseStepsHoldExactChunks) { CheckSparseMode("mass"); }
TEST(ShadowKvModesTest, ExactKeysAtALowRankHoldTheStreamsKeys) {
  for (const std::string& mode : kModes) CheckSparseMode(mode, 0, true);
}

// The re-ranked policy of the exact-key tests: rank 16 of the keys' 192 dimensions, K = 8.
KvPolicyConfig RerankAtRank16() {
  KvPolicyConfig config = ShadowConfig(8, 32, 2, 16);
  config.budget_tokens = 64;
  config.selection = "rerank";
  return config;
}

// RerankAtRank16 without exact keys, and with them as the re-rank's scores.
struct PlainAndStored {
  std::unique_ptr<KvPolicy> plain, stored;
};
PlainAndStored MakePlainAndStored(const KvGeometry& g) {
  KvPolicyConfig config = RerankAtRank16();
  PlainAndStored made;
  made.plain = MakePolicy(config, g);
  config.exact_keys = 1;
  made.stored = MakePolicy(config, g);
  return made;
}

// exact_keys with rerank_rank: the candidates are scored from keys rebuilt from the factors'
// first components, not from the key store, and the kept chunks are attended with their exact
// keys. At rank 16 with rerank_rank 16 the sequence keeps, step for step, the chunks of the
// sequence without exact keys (whose candidates are the same rank-16 keys), reads the store only
// for the chunks it misses (keys beside values: twice the plain sequence's bytes), and the keys
// it gathers are the stream's (CheckSparseMode).
TEST(ShadowKvModesTest, ExactKeysScoredFromTheFactorsKeepTheChunksOfTheFactorsScores) {
  ASSERT_NO_FATAL_FAILURE(CheckSparseMode("rerank", 16, true));
  ASSERT_NO_FATAL_FAILURE(CheckSparseMode("rerank", 8, true));  // fewer components than kept
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 41);
  const PlainAndStored policies = MakePlainAndStored(g);
  KvPolicyConfig config = RerankAtRank16();
  config.exact_keys = 1;
  config.rerank_rank = 16;
  auto factors = MakePolicy(config, g);
  Runner a(*policies.plain, stream), b(*factors, stream), c(*policies.stored, stream);
  for (Runner* runner : {&a, &b, &c}) runner->Step(300, true);
  int differs_from_stored = 0;
  for (int step = 0; step < 8; ++step) {
    for (Runner* runner : {&a, &b, &c}) runner->Step(1, false);
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const auto ia = a.shadow().Inspect(layer), ib = b.shadow().Inspect(layer),
                 ic = c.shadow().Inspect(layer);
      for (int h = 0; h < g.num_kv_heads; ++h) {
        ASSERT_EQ(AsSet(ib.gathered_chunks[h]), AsSet(ia.gathered_chunks[h]))
            << "step " << step << " layer " << layer << " head " << h;
        differs_from_stored += AsSet(ib.gathered_chunks[h]) != AsSet(ic.gathered_chunks[h]);
      }
    }
  }
  EXPECT_GT(differs_from_stored, 0)
      << "scores from the factors chose as the stored keys everywhere";
  EXPECT_EQ(b.sequence().memory().slow_bytes, c.sequence().memory().slow_bytes);
  EXPECT_EQ(b.sequence().stats().bytes_fetched, 2 * a.sequence().stats().bytes_fetched);
}

// exact_keys: the slow tier holds the keys beside the values (twice its bytes, as the estimate
// says), the fast tier is the same as without, and the bytes read per miss count both runs. The
// re-rank scores its candidates from the stored keys, so at rank 16 of 192 it keeps the chunks
// that a basis of every component (keys rebuilt exactly, up to rounding) keeps.
TEST(ShadowKvModesTest, ExactKeysDoubleTheSlowTierAndScoreTheRerank) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 31);
  const PlainAndStored policies = MakePlainAndStored(g);
  const KvPolicy& plain = *policies.plain;
  const KvPolicy& exact = *policies.stored;
  KvPolicyConfig config = RerankAtRank16();
  config.rank = g.kv_width();
  auto every_component = MakePolicy(config, g);
  Runner a(plain, stream), b(exact, stream), c(*every_component, stream);
  for (Runner* runner : {&a, &b, &c}) {
    runner->Step(300, true);
    for (int step = 0; step < 6; ++step) runner->Step(1, false);
  }
  const MemoryUsage ma = a.sequence().memory(), mb = b.sequence().memory();
  EXPECT_EQ(mb.fast_bytes, ma.fast_bytes);
  EXPECT_EQ(mb.slow_bytes, 2 * ma.slow_bytes);
  EXPECT_EQ(exact.EstimateMemory(300).slow_bytes, 2 * plain.EstimateMemory(300).slow_bytes);
  EXPECT_EQ(exact.EstimateMemory(300).fast_bytes, plain.EstimateMemory(300).fast_bytes);
  EXPECT_EQ(b.sequence().stats().chunk_selections, c.sequence().stats().chunk_selections);
  EXPECT_EQ(b.sequence().stats().bytes_fetched, 2 * c.sequence().stats().bytes_fetched);
  int differs_from_rank_16 = 0;
  for (int layer = 0; layer < g.num_layers; ++layer) {
    const auto ia = a.shadow().Inspect(layer), ib = b.shadow().Inspect(layer),
               ic = c.shadow().Inspect(layer);
    for (int h = 0; h < g.num_kv_heads; ++h) {
      EXPECT_EQ(AsSet(ib.gathered_chunks[h]), AsSet(ic.gathered_chunks[h]));
      differs_from_rank_16 += AsSet(ib.gathered_chunks[h]) != AsSet(ia.gathered_chunks[h]);
    }
  }
  EXPECT_GT(differs_from_rank_16, 0) << "rank-16 scores chose as the exact keys everywhere";
  config.exact_keys = 2;
  EXPECT_FALSE(MakeKvPolicy(config, g).ok());
}

// rerank_factor * K >= L (the default factor 4) or a candidate floor of L chunks or more:
// every landmark chunk is a candidate. The stream's keys have rank `key_rank` (0: full), the
// basis keeps every component, and the candidates are scored with `rerank_rank` of them (0:
// all). Gives, per (layer, KV head), whether the kept K are the chunks of highest exact
// attention mass (fp64 reference).
void RerankKeepsTheHighestExactMass(int key_rank, int rerank_rank, std::vector<bool>* kept_best,
                                    int rerank_factor = 4, int64_t rerank_min_tokens = 0) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, key_rank, 37);
  KvPolicyConfig config = ShadowConfig(8, 32, 4, g.kv_width());
  config.budget_tokens = 80;  // K = 10 of 29 landmark chunks; 4 * 10 >= 29
  config.selection = "rerank";
  config.rerank_rank = rerank_rank;
  config.rerank_factor = rerank_factor;
  config.rerank_min_tokens = rerank_min_tokens;
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  const int d = g.head_dim;
  kept_best->clear();
  for (int layer = 0; layer < g.num_layers; ++layer) {
    AttentionInput input;
    ASSERT_NO_FATAL_FAILURE(runner.AppendOne(layer, 300, nullptr, &input));
    const auto info = runner.shadow().Inspect(layer);
    const auto queries = stream.Make(layer, 300).queries;
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const auto& chunks = info.landmark_chunks[h];
      ASSERT_EQ(chunks.size(), 29u);
      std::vector<std::vector<float>> keys;
      for (int32_t c : chunks) keys.push_back(ChunkRows(stream, layer, h, 8, c, false));
      std::vector<double> best(chunks.size(), -1.0);
      for (int q = 0; q < g.group_size(); ++q) {
        const float* query = queries.data() + (h * g.group_size() + q) * d;
        std::vector<double> logits;
        for (const auto& rows : keys) {
          for (int t = 0; t < 8; ++t) {
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += double(query[i]) * rows[t * d + i];
            logits.push_back(dot / std::sqrt(double(d)));
          }
        }
        const double top = *std::max_element(logits.begin(), logits.end());
        double total = 0;
        for (double& x : logits) total += (x = std::exp(x - top));
        for (size_t c = 0; c < chunks.size(); ++c) {
          double mass = 0;
          for (int t = 0; t < 8; ++t) mass += logits[c * 8 + t] / total;
          best[c] = std::max(best[c], mass);
        }
      }
      std::vector<size_t> order(chunks.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return best[a] > best[b]; });
      std::set<int64_t> expected;
      for (int i = 0; i < 10; ++i) expected.insert(chunks[order[i]]);
      kept_best->push_back(AsSet(info.gathered_chunks[h]) == expected);
    }
  }
}

TEST(ShadowKvModesTest, RerankOverEveryChunkSelectsTheHighestExactMass) {
  std::vector<bool> kept_best;
  ASSERT_NO_FATAL_FAILURE(RerankKeepsTheHighestExactMass(0, 0, &kept_best));
  ASSERT_FALSE(kept_best.empty());
  for (bool best : kept_best) EXPECT_TRUE(best);
}

// With one candidate per kept chunk the re-rank can only keep the landmarks' K, which miss the
// best chunks somewhere; a floor of 232 candidate tokens (all 29 chunks) keeps the best
// everywhere, as a factor of 4 does.
TEST(ShadowKvModesTest, RerankFloorMakesEveryChunkACandidate) {
  std::vector<bool> factor_only, with_floor;
  ASSERT_NO_FATAL_FAILURE(RerankKeepsTheHighestExactMass(0, 0, &factor_only, 1, 0));
  ASSERT_NO_FATAL_FAILURE(RerankKeepsTheHighestExactMass(0, 0, &with_floor, 1, 29 * 8));
  ASSERT_FALSE(with_floor.empty());
  EXPECT_TRUE(std::count(factor_only.begin(), factor_only.end(), false) > 0)
      << "the landmarks alone kept the best chunks everywhere: the floor is not tested";
  for (bool best : with_floor) EXPECT_TRUE(best);
}

TEST(ShadowKvModesTest, RerankRankScoresWithTheLeadingComponents) {
  // Keys of rank 16: their first 16 components (largest eigenvalues first) are the keys
  // exactly, so scoring with 16 of the 192 keeps the best chunks everywhere...
  std::vector<bool> kept_best;
  ASSERT_NO_FATAL_FAILURE(RerankKeepsTheHighestExactMass(16, 16, &kept_best));
  ASSERT_FALSE(kept_best.empty());
  for (bool best : kept_best) EXPECT_TRUE(best);
  // ...and scoring with 8 misses them somewhere: the setting reaches the scores.
  ASSERT_NO_FATAL_FAILURE(RerankKeepsTheHighestExactMass(16, 8, &kept_best));
  EXPECT_NE(std::count(kept_best.begin(), kept_best.end(), false), 0);
}

TEST(ShadowKvModesTest, RerankRankIsAMultipleOfEightWithOneBasis) {
  const KvGeometry g = TestGeometry();
  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  config.rerank_rank = 12;
  const auto odd = MakeKvPolicy(config, g);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("rerank rank 12"), std::string::npos);
  config.rerank_rank = 16;
  EXPECT_TRUE(MakeKvPolicy(config, g).ok());
  config.basis_groups = 2;
  const auto grouped = MakeKvPolicy(config, g);
  ASSERT_FALSE(grouped.ok());
  EXPECT_NE(grouped.status().message().find("basis_groups"), std::string::npos);
}

TEST(ShadowKvModesTest, SuccessorsOnlyWithLandmarks) {
  const KvGeometry g = TestGeometry();
  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  config.select_successors = 1;
  EXPECT_TRUE(MakeKvPolicy(config, g).ok());
  config.selection = "mass";
  const auto refused = MakeKvPolicy(config, g);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("successors"), std::string::npos);
}

// The reuse tests' pair: `mode` at K = 8 chunks selecting every step, and the same with
// `interval` (and `drift`) as the first.
std::pair<KvPolicyConfig, KvPolicyConfig> ReuseConfigs(const std::string& mode, int interval,
                                                       double drift) {
  KvPolicyConfig every = ShadowConfig(8, 32, 2, TestGeometry().kv_width());
  every.budget_tokens = 64;  // K = 8 chunks
  every.selection = mode;
  every.rerank_factor = 2;
  KvPolicyConfig reusing = every;
  reusing.select_interval = interval;
  reusing.select_drift = drift;
  return {reusing, every};
}

// The chunks each KV head of `layer` holds in its gather slots.
std::vector<std::set<int64_t>> HeldChunks(Runner& r, int layer) {
  std::vector<std::set<int64_t>> sets;
  for (const auto& chunks : r.shadow().Inspect(layer).gathered_chunks) {
    sets.emplace_back(chunks.begin(), chunks.end());
    sets.back().erase(-1);
  }
  return sets;
}

// select_interval 3: the queries come from the stream, so a selecting step (decode steps 0, 3,
// 6, ... after the compression, and the multi-token turn) picks the chunks the same sequence at
// interval 1 picks at that step; the steps between keep the chunks gathered last, select,
// fetch and rebuild nothing, and attend as many tokens as that step plus the grown window.
void CheckSelectInterval(const std::string& mode) {
  SCOPED_TRACE(mode);
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 31);
  const auto [config, every] = ReuseConfigs(mode, 3, 0.0);
  auto sparse = MakePolicy(config, g);
  auto dense = MakePolicy(every, g);
  Runner a(*sparse, stream), b(*dense, stream);
  a.Step(300, true);
  b.Step(300, true);
  const auto held = HeldChunks;
  std::vector<std::vector<std::set<int64_t>>> last(g.num_layers);  // b's at the last selection
  int64_t position = 300;
  int reused = 0;
  for (int step = 0; step < 24; ++step) {
    const int count = step == 12 ? 5 : 1;
    const bool selects = count > 1 || (position - 300) % 3 == 0;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const PolicyStats before = a.sequence().layer_stats()[layer];
      if (count == 1) {
        AttentionInput in_a, in_b;
        ASSERT_NO_FATAL_FAILURE(a.AppendOne(layer, static_cast<int>(position), nullptr, &in_a));
        ASSERT_NO_FATAL_FAILURE(b.AppendOne(layer, static_cast<int>(position), nullptr, &in_b));
        // The window is exact on both sides and ends with the new token.
        for (int h = 0; h < g.num_kv_heads; ++h) {
          ASSERT_EQ(in_a.heads[h].back().num_tokens, in_b.heads[h].back().num_tokens);
        }
      } else {
        for (Runner* r : {&a, &b}) {
          const TokenStream::Block tokens = stream.MakeBlock(layer, position, count);
          ASSERT_TRUE(r->sequence().Append(layer, tokens.View()).ok());
          AttentionInput input;
          ASSERT_TRUE(r->sequence().Prepare(layer, tokens.queries.data(), count, &input).ok());
        }
      }
      PolicyStats added = a.sequence().layer_stats()[layer];
      added -= before;
      int64_t held_chunks = 0;
      for (const auto& set : held(a, layer)) held_chunks += static_cast<int64_t>(set.size());
      if (selects) {
        last[layer] = held(b, layer);
        EXPECT_EQ(held(a, layer), last[layer]) << "step " << step << ", layer " << layer;
        EXPECT_EQ(added.chunk_selections, held_chunks);
        if (mode != "mass") {
          EXPECT_EQ(held_chunks, 8 * g.num_kv_heads);
        }
      } else {
        ++reused;
        EXPECT_EQ(held(a, layer), last[layer]) << "step " << step << ", layer " << layer;
        EXPECT_EQ(added.chunk_selections, 0);
        EXPECT_EQ(added.bytes_fetched, 0);
        // Each head's 2 outlier chunks, the chunks it holds, and the window.
        const int64_t window = position + 1 - a.shadow().Inspect(layer).num_chunks * 8;
        EXPECT_EQ(added.attended_tokens,
                  ((2 * g.num_kv_heads + held_chunks) * 8 + window * g.num_kv_heads) /
                      g.num_kv_heads);
      }
    }
    position += count;
  }
  EXPECT_EQ(reused, 15 * g.num_layers);  // 24 steps: 9 select (8 decode, 1 turn), 15 reuse
}

TEST(ShadowKvModesTest, SelectIntervalReusesTheLastSelection) {
  for (const std::string& mode : kModes) CheckSelectInterval(mode);
  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  for (int interval : {0, 65}) {
    config.select_interval = interval;
    const auto refused = MakeKvPolicy(config, TestGeometry());
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("select interval"), std::string::npos);
  }
}

// select_drift 0.9 at interval 6: each step's queries are one fixed set rotated to the step's
// position (no drift), except steps 3-10 whose set is another one. A KV head selects at step 0,
// when its queries turn (3, 11) and when the interval runs out (9 = 3 + 6, 17 = 11 + 6), each
// time the chunks the interval-1 sequence on the same queries picks; between, it keeps them.
void CheckSelectDrift(const std::string& mode) {
  SCOPED_TRACE(mode);
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 37);
  const auto [config, every] = ReuseConfigs(mode, 6, 0.9);
  auto sparse = MakePolicy(config, g);
  auto dense = MakePolicy(every, g);
  Runner a(*sparse, stream), b(*dense, stream);
  a.Step(300, true);
  b.Step(300, true);
  const Rope rope(g.rope);
  const auto held = HeldChunks;
  const std::set<int> selecting = {0, 3, 9, 11, 17};
  std::vector<std::vector<std::set<int64_t>>> last(g.num_layers);
  for (int step = 0; step < 18; ++step) {
    const int position = 300 + step;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      // The stream's queries of position 5000 (or 6000), rotated back to 0 and on to `position`.
      const int64_t from = step >= 3 && step < 11 ? 6000 : 5000;
      std::vector<float> queries = stream.Make(layer, from).queries;
      rope.Unapply(queries.data(), g.num_query_heads, g.head_dim, from);
      rope.Apply(queries.data(), g.num_query_heads, g.head_dim, position);
      const PolicyStats before = a.sequence().layer_stats()[layer];
      AttentionInput in_a, in_b;
      ASSERT_NO_FATAL_FAILURE(a.AppendOne(layer, position, queries.data(), &in_a));
      ASSERT_NO_FATAL_FAILURE(b.AppendOne(layer, position, queries.data(), &in_b));
      PolicyStats added = a.sequence().layer_stats()[layer];
      added -= before;
      EXPECT_EQ(added.head_steps, g.num_kv_heads);
      if (selecting.count(step)) {
        last[layer] = held(b, layer);
        EXPECT_EQ(added.head_selections, g.num_kv_heads) << "step " << step;
        EXPECT_GT(added.chunk_selections, 0) << "step " << step;
      } else {
        EXPECT_EQ(added.head_selections, 0) << "step " << step;
        EXPECT_EQ(added.chunk_selections, 0) << "step " << step;
      }
      EXPECT_EQ(held(a, layer), last[layer]) << "step " << step << ", layer " << layer;
    }
  }
}

TEST(ShadowKvModesTest, SelectDriftSelectsWhenTheQueriesTurn) {
  for (const std::string& mode : kModes) CheckSelectDrift(mode);
  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  for (double drift : {-0.1, 1.5}) {
    config.select_drift = drift;
    const auto refused = MakeKvPolicy(config, TestGeometry());
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("select drift"), std::string::npos);
  }
}

// The head selections of each (decode step, layer) under `config` (re-ranked, K = 8 chunks, a
// 64-token budget, interval 6) where steps 3-10's queries are the others' turned by `turn`
// positions of the rotary embedding (a partial turn: their cosine with the others' is neither
// near 1 nor near 0).
void DriftSelections(const KvPolicyConfig& config, int turn, std::vector<int64_t>* out) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 37);
  auto policy = MakePolicy(config, g);
  Runner r(*policy, stream);
  r.Step(300, true);
  const Rope rope(g.rope);
  for (int step = 0; step < 18; ++step) {
    const int position = 300 + step;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::vector<float> queries = stream.Make(layer, 5000).queries;
      rope.Unapply(queries.data(), g.num_query_heads, g.head_dim, 5000);
      rope.Apply(queries.data(), g.num_query_heads, g.head_dim,
                 position + (step >= 3 && step < 11 ? turn : 0));
      const PolicyStats before = r.sequence().layer_stats()[layer];
      AttentionInput input;
      ASSERT_NO_FATAL_FAILURE(r.AppendOne(layer, position, queries.data(), &input));
      PolicyStats added = r.sequence().layer_stats()[layer];
      added -= before;
      out->push_back(added.head_selections);
    }
  }
}

// drift_small replaces drift where the sequence's budget (64 tokens here) is below
// drift_small_below, and only there.
TEST(ShadowKvModesTest, SmallBudgetsSelectAtTheirOwnDrift) {
  auto with = [](double drift, double small, int64_t below) {
    KvPolicyConfig config = ReuseConfigs("rerank", 6, drift).first;
    config.select_drift_small = small;
    config.drift_small_below = below;
    return config;
  };
  constexpr int kTurn = 3;
  std::vector<int64_t> tight, loose, small_tight, large_tight, small_loose;
  ASSERT_NO_FATAL_FAILURE(DriftSelections(with(0.9, 0.0, 0), kTurn, &tight));
  ASSERT_NO_FATAL_FAILURE(DriftSelections(with(0.3, 0.0, 0), kTurn, &loose));
  // The two thresholds decide differently on these queries, or the rest would show nothing.
  ASSERT_NE(tight, loose);
  ASSERT_NO_FATAL_FAILURE(DriftSelections(with(0.3, 0.9, 65), kTurn, &small_tight));
  ASSERT_NO_FATAL_FAILURE(DriftSelections(with(0.9, 0.3, 64), kTurn, &large_tight));
  ASSERT_NO_FATAL_FAILURE(DriftSelections(with(0.3, 0.9, 64), kTurn, &small_loose));
  EXPECT_EQ(small_tight, tight);  // 64 < 65: drift_small
  EXPECT_EQ(large_tight, tight);  // 64 is not below 64: drift
  EXPECT_EQ(small_loose, loose);

  KvPolicyConfig config = ShadowConfig(8, 32, 2);
  config.select_drift_small = 0.9;
  config.drift_small_below = 1024;
  auto refused = MakeKvPolicy(config, TestGeometry());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("needs drift on"), std::string::npos);
}

// select_sample 0.25 at K = 8 chunks: each selection ranks 6 chunks, exactly the 6 that the same
// stream's sequence at K = 6 without sampling selects, and draws 2 of the other selectable
// chunks, attended as their exact rows with the log weight ln(unranked / 2). The draw differs
// from selection to selection and is the same in a second run.
void CheckSampledChunks(const std::string& mode) {
  SCOPED_TRACE(mode);
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 37);
  KvPolicyConfig ranked_config = ShadowConfig(8, 32, 2, g.kv_width());
  ranked_config.selection = mode;
  ranked_config.rerank_min_tokens = 100000;  // every chunk a candidate, whatever K
  ranked_config.budget_tokens = 48;          // K = 6
  KvPolicyConfig sampled_config = ranked_config;
  sampled_config.budget_tokens = 64;  // K = 8, of them 2 drawn
  sampled_config.select_sample = 0.25;
  auto ranked_policy = MakePolicy(ranked_config, g);
  auto sampled_policy = MakePolicy(sampled_config, g);
  ASSERT_TRUE(ranked_policy && sampled_policy);
  Runner ranked(*ranked_policy, stream), sampled(*sampled_policy, stream),
      again(*sampled_policy, stream);
  for (Runner* r : {&ranked, &sampled, &again}) r->Step(300, true);
  std::set<std::set<int64_t>> draws;
  for (int position = 300; position < 306; ++position) {
    for (int layer = 0; layer < g.num_layers; ++layer) {
      AttentionInput ranked_input, sampled_input, again_input;
      ASSERT_NO_FATAL_FAILURE(ranked.AppendOne(layer, position, nullptr, &ranked_input));
      ASSERT_NO_FATAL_FAILURE(sampled.AppendOne(layer, position, nullptr, &sampled_input));
      ASSERT_NO_FATAL_FAILURE(again.AppendOne(layer, position, nullptr, &again_input));
      const auto info = sampled.shadow().Inspect(layer);
      const auto ranked_held = HeldChunks(ranked, layer);
      const auto sampled_held = HeldChunks(sampled, layer);
      EXPECT_EQ(sampled_held, HeldChunks(again, layer));
      for (int h = 0; h < g.num_kv_heads; ++h) {
        ASSERT_EQ(sampled_held[h].size(), 8u);
        ASSERT_EQ(ranked_held[h].size(), 6u);
        // The weighted rows: which held chunk each 8-row block is, by its exact keys.
        const auto landmarks = static_cast<double>(info.num_chunks) -
                               static_cast<double>(info.outlier_chunks[h].size());
        std::set<int64_t> drawn;
        for (const KvSegment& segment : sampled_input.heads[h]) {
          if (segment.log_weight == 0.0f) continue;
          EXPECT_NEAR(segment.log_weight, std::log((landmarks - 6.0) / 2.0), 1e-5);
          ASSERT_EQ(segment.num_tokens % 8, 0);
          for (int block = 0; block < segment.num_tokens / 8; ++block) {
            int64_t found = -1;
            for (int64_t chunk : sampled_held[h]) {
              const auto keys = ChunkRows(stream, layer, h, 8, chunk, false);
              const auto values = ChunkRows(stream, layer, h, 8, chunk, true);
              bool same = true;
              for (int i = 0; i < 8 * g.head_dim && same; ++i) {
                same = std::fabs(segment.keys[block * 8 * g.head_dim + i] - keys[i]) < 1e-4f &&
                       segment.values[block * 8 * g.head_dim + i] == values[i];
              }
              if (same) found = chunk;
            }
            ASSERT_GE(found, 0) << "a weighted block that is no held chunk's rows";
            drawn.insert(found);
          }
        }
        ASSERT_EQ(drawn.size(), 2u);
        std::set<int64_t> rest;
        std::set_difference(sampled_held[h].begin(), sampled_held[h].end(), drawn.begin(),
                            drawn.end(), std::inserter(rest, rest.begin()));
        EXPECT_EQ(rest, ranked_held[h]) << "layer " << layer << " head " << h;
        draws.insert(drawn);
        EXPECT_EQ(sampled_input.num_tokens(h), again_input.num_tokens(h));
        EXPECT_EQ(sampled_input.num_tokens(h), ranked_input.num_tokens(h) + 16);
      }
    }
  }
  EXPECT_GE(draws.size(), 4u);  // the draw changes from selection to selection
}

TEST(ShadowKvModesTest, LandmarksSampleTheRestOfTheBudgetWeighted) {
  CheckSampledChunks("landmarks");
}
TEST(ShadowKvModesTest, RerankSamplesTheRestOfTheBudgetWeighted) { CheckSampledChunks("rerank"); }

TEST(ShadowKvModesTest, PaperSettingIgnoresOtherDefaults) {
  // A config made in code with paper=1 runs the published method whatever else it says.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 11);
  KvPolicyConfig base;
  base.policy = "shadowkv";
  base.paper = 1;
  KvPolicyConfig changed = base;
  changed.rank_energy = 0.5;
  changed.selection = "heads";
  changed.chunk_size = 4;
  changed.budget_tokens = 40;
  auto paper = MakePolicy(base, g);
  auto forced = MakePolicy(changed, g);
  EXPECT_EQ(forced->config().selection, "landmarks");
  EXPECT_EQ(forced->config().chunk_size, 8);
  Runner a(*paper, stream), b(*forced, stream);
  for (Runner* r : {&a, &b}) r->Step(400, true);
  for (int step = 0; step < 3; ++step) {
    for (Runner* r : {&a, &b}) r->Step(1);
    EXPECT_EQ(a.outputs(), b.outputs());
  }
  // Rank 192 / 6.4 = 30 rounded up to 32; the budget floor of 256 tokens is 32 chunks.
  EXPECT_EQ(b.shadow().Inspect(0).rank, 32);
  EXPECT_EQ(b.shadow().Inspect(0).budget_chunks, 32);
}

}  // namespace
}  // namespace shadowkv::kv
