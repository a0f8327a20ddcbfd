// Tests of the ShadowKV policy: equivalence with full attention, selection, hits, graduation.
#include "kv/shadowkv_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include "core/fp8.h"
#include "kv/policies.h"
#include "ops/cpu/attention.h"

namespace shadowkv::kv {
namespace {

KvGeometry TestGeometry(int rotary_dim = 64) {
  KvGeometry g;
  g.num_layers = 2;
  g.num_query_heads = 9;
  g.num_kv_heads = 3;
  g.head_dim = 64;
  g.max_context = 4096;
  g.rope.rotary_dim = rotary_dim;
  g.rope.theta_base = 10000.0f;
  return g;
}

// Deterministic per-token q/k/v: pre-RoPE keys of rank `key_rank` (0: full), RoPE'd for real.
// abs_values: every value replaced by its magnitude (everything else as without it).
class TokenStream {
 public:
  TokenStream(const KvGeometry& g, int key_rank, uint32_t seed, bool abs_values = false)
      : g_(g), rope_(g.rope), key_rank_(key_rank), seed_(seed), abs_values_(abs_values) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (key_rank_ > 0) {
      mixing_.resize(static_cast<size_t>(g.num_layers) * key_rank_ * g.kv_width());
      for (auto& x : mixing_) x = normal(rng) / std::sqrt(static_cast<float>(key_rank_));
    }
  }

  struct Token {
    std::vector<float> pre, post, values, queries;
  };

  Token Make(int layer, int64_t position) const {
    std::mt19937 rng(seed_ * 7919u + layer * 1000003u + static_cast<uint32_t>(position));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int width = g_.kv_width();
    Token t{
        std::vector<float>(width), {}, std::vector<float>(width), std::vector<float>(g_.q_width())};
    if (key_rank_ > 0) {
      std::vector<float> u(key_rank_);
      for (auto& x : u) x = normal(rng);
      const float* m = mixing_.data() + static_cast<size_t>(layer) * key_rank_ * width;
      for (int j = 0; j < width; ++j) {
        float sum = 0;
        for (int k = 0; k < key_rank_; ++k) sum += u[k] * m[k * width + j];
        t.pre[j] = sum;
      }
    } else {
      for (auto& x : t.pre) x = normal(rng);
    }
    t.post = t.pre;
    rope_.Apply(t.post.data(), g_.num_kv_heads, g_.head_dim, position);
    for (auto& x : t.values) x = abs_values_ ? std::fabs(normal(rng)) : normal(rng);
    for (auto& x : t.queries) x = normal(rng);
    rope_.Apply(t.queries.data(), g_.num_query_heads, g_.head_dim, position);
    return t;
  }

  const KvGeometry& geometry() const { return g_; }

 private:
  KvGeometry g_;
  Rope rope_;
  int key_rank_;
  uint32_t seed_;
  bool abs_values_;
  std::vector<float> mixing_;  // [layer][key_rank, kv_width]
};

// Drives one sequence through the seam as the forward pass does, keeping each layer's output.
class Runner {
 public:
  Runner(const KvPolicy& policy, const TokenStream& stream) : stream_(stream), pool_(1) {
    auto sequence = policy.NewSequence();
    EXPECT_TRUE(sequence.ok()) << sequence.status().ToString();
    if (sequence.ok()) sequence_ = std::move(sequence).value();
  }

  // Appends `count` tokens at every layer, attends, and (last prompt block) finishes prefill.
  void Step(int count, bool finish_prefill = false) {
    const KvGeometry& g = stream_.geometry();
    outputs_.assign(g.num_layers, {});
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::vector<float> pre, post, values, queries;
      for (int i = 0; i < count; ++i) {
        auto t = stream_.Make(layer, position_ + i);
        pre.insert(pre.end(), t.pre.begin(), t.pre.end());
        post.insert(post.end(), t.post.begin(), t.post.end());
        values.insert(values.end(), t.values.begin(), t.values.end());
        queries.insert(queries.end(), t.queries.begin(), t.queries.end());
      }
      TokenBlock block{count, position_, pre.data(), post.data(), values.data(), queries.data()};
      ASSERT_TRUE(sequence_->Append(layer, block).ok());
      AttentionInput input;
      ASSERT_TRUE(sequence_->Prepare(layer, queries.data(), count, &input).ok());
      outputs_[layer].resize(queries.size());
      AttentionShape shape{g.num_query_heads, g.num_kv_heads, g.head_dim,
                           1.0f / std::sqrt(static_cast<float>(g.head_dim))};
      AttentionJob job{queries.data(), outputs_[layer].data(), count, position_, &input};
      RunAttention(shape, std::span<const AttentionJob>(&job, 1), pool_);
      if (finish_prefill) {
        ASSERT_TRUE(sequence_->FinishPrefill(layer).ok());
      }
    }
    position_ += count;
  }

  // Appends the stream's token at `position` to one layer (with `queries`, or the token's own
  // when null) and prepares its attention input, without attending.
  void AppendOne(int layer, int position, const float* queries, AttentionInput* input) {
    auto t = stream_.Make(layer, position);
    const float* q = queries != nullptr ? queries : t.queries.data();
    TokenBlock block{1, position, t.pre.data(), t.post.data(), t.values.data(), q};
    ASSERT_TRUE(sequence_->Append(layer, block).ok());
    ASSERT_TRUE(sequence_->Prepare(layer, q, 1, input).ok());
  }

  SequenceKv& sequence() { return *sequence_; }
  ShadowKvSequence& shadow() { return dynamic_cast<ShadowKvSequence&>(*sequence_); }
  const std::vector<std::vector<float>>& outputs() const { return outputs_; }

 private:
  const TokenStream& stream_;
  ThreadPool pool_;
  std::unique_ptr<SequenceKv> sequence_;
  int64_t position_ = 0;
  std::vector<std::vector<float>> outputs_;  // [layer][count * q_width] of the last step
};

std::unique_ptr<KvPolicy> MakePolicy(const KvPolicyConfig& config, const KvGeometry& g) {
  auto policy = MakeKvPolicy(config, g);
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  return policy.ok() ? std::move(policy).value() : nullptr;
}

// Largest |a − b| relative to the largest |b|, over every layer.
double RelativeError(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  double worst = 0, scale = 0;
  for (size_t l = 0; l < a.size(); ++l) {
    for (size_t i = 0; i < a[l].size(); ++i) {
      worst = std::max(worst, double(std::fabs(a[l][i] - b[l][i])));
      scale = std::max(scale, double(std::fabs(b[l][i])));
    }
  }
  return worst / scale;
}

KvPolicyConfig ShadowConfig(int chunk, int window, int64_t outliers, int rank = 0) {
  KvPolicyConfig c;
  c.policy = "shadowkv";
  c.chunk_size = chunk;
  c.local_window = window;
  c.outlier_chunks = outliers;
  c.rank = rank;
  c.budget_tokens = 100000;  // every chunk fits
  return c;
}

struct EquivalenceCase {
  int chunk, window, prompt;
  int64_t outliers;
  int key_rank, rank;  // rank 0: full (kv_width)
  int basis_groups = 1;
};

void CheckEquivalence(const EquivalenceCase& c) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, c.key_rank, 17);
  KvPolicyConfig full_config;
  auto full = MakePolicy(full_config, g);
  KvPolicyConfig shadow_config =
      ShadowConfig(c.chunk, c.window, c.outliers, c.rank ? c.rank : g.kv_width());
  shadow_config.basis_groups = c.basis_groups;
  auto shadow = MakePolicy(shadow_config, g);
  ASSERT_TRUE(full && shadow);
  Runner expected(*full, stream), actual(*shadow, stream);
  // Prompt in two blocks, the second finishing prefill.
  const int first_block = c.prompt / 3;
  for (Runner* r : {&expected, &actual}) r->Step(first_block);
  EXPECT_LT(RelativeError(actual.outputs(), expected.outputs()), 1e-6);
  for (Runner* r : {&expected, &actual}) r->Step(c.prompt - first_block, true);
  EXPECT_LT(RelativeError(actual.outputs(), expected.outputs()), 1e-6);
  EXPECT_EQ(actual.shadow().Inspect(0).compressed, c.prompt >= c.window + c.chunk);
  const int64_t chunks_after_prefill = actual.shadow().Inspect(0).num_chunks;
  // Decode steps (graduating several chunks), a multi-token turn, then more decode.
  auto compare = [&](int count) {
    for (Runner* r : {&expected, &actual}) r->Step(count);
    EXPECT_LT(RelativeError(actual.outputs(), expected.outputs()), 1e-4)
        << "after " << actual.sequence().num_tokens() << " tokens";
  };
  for (int step = 0; step < 3 * c.chunk + 2; ++step) compare(1);
  compare(2 * c.chunk + 3);
  for (int step = 0; step < c.chunk; ++step) compare(1);
  EXPECT_GT(actual.shadow().Inspect(1).num_chunks, chunks_after_prefill + 3);
  EXPECT_EQ(actual.sequence().num_tokens(), expected.sequence().num_tokens());
}

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

// Chunk `c`'s rows of one KV head from the stream: [chunk, head_dim] post-RoPE keys or values.
std::vector<float> ChunkRows(const TokenStream& stream, int layer, int h, int chunk_size,
                             int64_t chunk, bool values) {
  const KvGeometry& g = stream.geometry();
  std::vector<float> rows;
  for (int t = 0; t < chunk_size; ++t) {
    auto token = stream.Make(layer, chunk * chunk_size + t);
    const auto& source = values ? token.values : token.post;
    rows.insert(rows.end(), source.begin() + h * g.head_dim, source.begin() + (h + 1) * g.head_dim);
  }
  return rows;
}

TEST(ShadowKvTest, RebuiltKeysAreRopedAtTheirPositions) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 5);
  KvPolicyConfig config = ShadowConfig(8, 32, 2, g.kv_width());
  config.budget_tokens = 64;  // 8 chunks of 33
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  for (int layer = 0; layer < g.num_layers; ++layer) {
    AttentionInput input;
    ASSERT_NO_FATAL_FAILURE(runner.AppendOne(layer, 300, nullptr, &input));
    const auto info = runner.shadow().Inspect(layer);
    for (int h = 0; h < g.num_kv_heads; ++h) {
      ASSERT_EQ(input.heads[h].size(), 3u);  // outliers, gathered, window
      const KvSegment& gathered = input.heads[h][1];
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
      const KvSegment& outliers = input.heads[h][0];
      ASSERT_EQ(outliers.num_tokens, 16);
      for (size_t k = 0; k < 2; ++k) {
        auto keys = ChunkRows(stream, layer, h, 8, info.outlier_chunks[h][k], false);
        for (int i = 0; i < 8 * 64; ++i) ASSERT_EQ(outliers.keys[k * 8 * 64 + i], keys[i]);
      }
    }
  }
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

std::set<int64_t> AsSet(const std::vector<int32_t>& chunks) {
  return std::set<int64_t>(chunks.begin(), chunks.end());
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
  const int64_t tokens = 4000;
  // Per layer: A 3968x32, B 32x192, 496 landmarks x 192 minus outliers, window, gather.
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
int64_t TotalLandmarks(ShadowKvSequence& sequence, int num_layers) {
  int64_t total = 0;
  for (int layer = 0; layer < num_layers; ++layer) {
    for (const auto& chunks : sequence.Inspect(layer).landmark_chunks) total += chunks.size();
  }
  return total;
}

TEST(ShadowKvTest, GatheredValuesAreExactOrTheDequantisedFp8Runs) {
  // fp8_values 0: every value bit-exact. 1: the gathered chunks hold exactly the codec's
  // dequantised run (one scale per chunk and KV head), outliers and the window stay exact.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 5);
  for (int fp8 : {0, 1}) {
    SCOPED_TRACE(fp8 ? "fp8 values" : "fp32 values");
    KvPolicyConfig config = ShadowConfig(8, 32, 2, g.kv_width());
    config.budget_tokens = 64;  // 8 chunks of 33
    config.fp8_values = fp8;
    auto policy = MakePolicy(config, g);
    Runner runner(*policy, stream);
    runner.Step(300, true);
    int64_t quantised = 0;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      AttentionInput input;
      ASSERT_NO_FATAL_FAILURE(runner.AppendOne(layer, 300, nullptr, &input));
      const auto info = runner.shadow().Inspect(layer);
      for (int h = 0; h < g.num_kv_heads; ++h) {
        ASSERT_EQ(input.heads[h].size(), 3u);  // outliers, gathered, window
        const KvSegment& gathered = input.heads[h][1];
        for (size_t slot = 0; slot < 8; ++slot) {
          auto values = ChunkRows(stream, layer, h, 8, info.gathered_chunks[h][slot], true);
          auto expected = values;
          if (fp8) RoundTripFp8Run(expected.data(), 8 * 64);
          for (int i = 0; i < 8 * 64; ++i) {
            ASSERT_EQ(gathered.values[slot * 8 * 64 + i], expected[i]) << "slot " << slot;
            quantised += expected[i] != values[i];
          }
        }
        const KvSegment& outliers = input.heads[h][0];
        for (size_t k = 0; k < 2; ++k) {
          auto values = ChunkRows(stream, layer, h, 8, info.outlier_chunks[h][k], true);
          for (int i = 0; i < 8 * 64; ++i) ASSERT_EQ(outliers.values[k * 8 * 64 + i], values[i]);
        }
        const KvSegment& window = input.heads[h][2];
        ASSERT_EQ(window.num_tokens, info.exact_tokens);
        for (int t = 0; t < window.num_tokens; ++t) {
          const auto exact = stream.Make(layer, info.exact_first_position + t).values;
          for (int i = 0; i < 64; ++i) {
            ASSERT_EQ(window.values[t * window.row_stride + i], exact[h * 64 + i]);
          }
        }
      }
    }
    if (fp8) {
      EXPECT_GT(quantised, 2 * 3 * 8 * 8 * 64 / 2);  // most values changed by the rounding
    } else {
      EXPECT_EQ(quantised, 0);
    }
  }
}

TEST(ShadowKvTest, Fp8ValuesAttendWithinTheFormatsBound) {
  // Full rank and every chunk selected, so fp32 and FP8 values see the same keys and the same
  // attention weights p_i. e4m3 rounds a scaled value to half a step: at most 2^-4 of it in the
  // normal range, 2^-10 of the run's scale (amax / 448) below it. So each output element moves by
  // at most sum_i p_i (2^-4 |v_i| + 2^-10 amax / 448) <= 2^-4 (attention over |V|) +
  // 2^-10 max|v| / 448, plus fp32 rounding of the attention itself. The attention over |V| is the
  // same policy run on the same stream with every value replaced by its magnitude.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 61), magnitudes(g, 0, 61, /*abs_values=*/true);
  KvPolicyConfig config = ShadowConfig(8, 32, 3, g.kv_width());
  auto exact_policy = MakePolicy(config, g);
  config.fp8_values = 1;
  auto fp8_policy = MakePolicy(config, g);
  ASSERT_TRUE(exact_policy && fp8_policy);
  Runner exact(*exact_policy, stream), fp8(*fp8_policy, stream),
      bound_runner(*exact_policy, magnitudes);
  float max_value = 0.0f;
  for (int layer = 0; layer < g.num_layers; ++layer) {
    for (int64_t t = 0; t < 300 + 30; ++t) {
      for (float v : magnitudes.Make(layer, t).values) max_value = std::max(max_value, v);
    }
  }
  const double floor_term = max_value / 448.0 / 1024.0;
  double worst_ratio = 0.0, worst_error = 0.0;
  auto check = [&](const char* when) {
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const auto& a = fp8.outputs()[layer];
      const auto& b = exact.outputs()[layer];
      const auto& m = bound_runner.outputs()[layer];
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        const double error = std::fabs(double(a[i]) - double(b[i]));
        const double bound = 0.0625 * m[i] + floor_term + 1e-4 * m[i] + 1e-6;
        ASSERT_LE(error, bound) << when << ", layer " << layer << " element " << i;
        worst_ratio = std::max(worst_ratio, error / bound);
        worst_error = std::max(worst_error, error);
      }
    }
  };
  for (Runner* r : {&exact, &fp8, &bound_runner}) r->Step(300, true);
  check("prefill");  // prefill attends exactly: nothing is quantised yet
  EXPECT_EQ(worst_error, 0.0);
  for (int step = 0; step < 30; ++step) {  // decode, graduating chunks into FP8 runs
    for (Runner* r : {&exact, &fp8, &bound_runner}) r->Step(1);
    check("decode");
  }
  EXPECT_GT(worst_error, 0.0);  // the FP8 values were read
  EXPECT_LT(worst_ratio, 1.0);
  EXPECT_GT(fp8.shadow().Inspect(0).num_chunks, 33);
}

TEST(ShadowKvTest, Fp8MemoryIsCountedInItsStoredSize) {
  // Per value run (8 x 64) 516 bytes instead of 2048; per landmark 68 bytes instead of 256;
  // memory() and EstimateMemory agree, after prefill and after graduation.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 41);
  KvPolicyConfig config = ShadowConfig(8, 32, -1, 48);
  config.budget_tokens = 64;
  std::vector<std::unique_ptr<KvPolicy>> policies;
  for (auto [values, landmarks] : {std::pair{0, 0}, {1, 0}, {0, 1}, {1, 1}}) {
    config.fp8_values = values;
    config.fp8_landmarks = landmarks;
    policies.push_back(MakePolicy(config, g));
    ASSERT_TRUE(policies.back());
  }
  std::vector<std::unique_ptr<Runner>> runners;
  for (auto& policy : policies) runners.push_back(std::make_unique<Runner>(*policy, stream));
  auto check = [&](bool estimate) {
    const MemoryUsage base = runners[0]->sequence().memory();
    const int64_t landmarks = TotalLandmarks(runners[0]->shadow(), g.num_layers);
    ASSERT_GT(landmarks, 0);
    EXPECT_EQ(base.slow_bytes, landmarks * 8 * 64 * 4);
    for (size_t i = 0; i < runners.size(); ++i) {
      const bool fp8_values = i == 1 || i == 3, fp8_landmarks = i >= 2;
      EXPECT_EQ(TotalLandmarks(runners[i]->shadow(), g.num_layers), landmarks);
      const MemoryUsage m = runners[i]->sequence().memory();
      EXPECT_EQ(m.slow_bytes, fp8_values ? landmarks * (8 * 64 + 4) : base.slow_bytes) << i;
      EXPECT_EQ(m.fast_bytes,
                fp8_landmarks ? base.fast_bytes - landmarks * (64 * 4 - (64 + 4)) : base.fast_bytes)
          << i;
      if (estimate) {
        const MemoryUsage e = policies[i]->EstimateMemory(300);
        EXPECT_EQ(m.fast_bytes, e.fast_bytes) << i;
        EXPECT_EQ(m.slow_bytes, e.slow_bytes) << i;
      }
    }
  };
  for (auto& r : runners) r->Step(300, true);
  check(true);
  for (int step = 0; step < 40; ++step) {
    for (auto& r : runners) r->Step(1);
  }
  check(false);
  // FP8 values with fp32 landmarks select the same chunks, so they fetch the same runs, each
  // 516 bytes.
  const int64_t fetched = runners[0]->sequence().stats().bytes_fetched;
  EXPECT_GT(fetched, 0);
  EXPECT_EQ(runners[1]->sequence().stats().chunk_hits, runners[0]->sequence().stats().chunk_hits);
  EXPECT_EQ(runners[1]->sequence().stats().bytes_fetched * 2048, fetched * 516);
}

TEST(ShadowKvTest, Fp8FileStoreMatchesRam) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 43);
  KvPolicyConfig config = ShadowConfig(8, 16, 2, 48);
  config.budget_tokens = 64;
  config.fp8_values = 1;
  const auto directory = std::filesystem::temp_directory_path() /
                         ("skv_policy_fp8_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  KvPolicyConfig file_config = config;
  file_config.value_store_path = directory.string();
  auto ram_policy = MakePolicy(config, g);
  auto file_policy = MakePolicy(file_config, g);
  KvPolicyConfig exact_config = config;
  exact_config.fp8_values = 0;
  auto exact_policy = MakePolicy(exact_config, g);
  Runner ram(*ram_policy, stream), file(*file_policy, stream), exact(*exact_policy, stream);
  for (Runner* r : {&ram, &file, &exact}) r->Step(200, true);
  bool differs_from_exact = false;
  for (int step = 0; step < 24; ++step) {
    for (Runner* r : {&ram, &file, &exact}) r->Step(1);
    ASSERT_EQ(ram.outputs(), file.outputs()) << "step " << step;  // bit for bit
    differs_from_exact |= ram.outputs() != exact.outputs();
  }
  EXPECT_TRUE(differs_from_exact);
  EXPECT_EQ(file.sequence().memory().slow_bytes, ram.sequence().memory().slow_bytes);
  EXPECT_EQ(ram.sequence().memory().slow_bytes,
            TotalLandmarks(ram.shadow(), g.num_layers) * (8 * 64 + 4));
  EXPECT_TRUE(std::filesystem::is_empty(directory));
  std::filesystem::remove_all(directory);
}

// Keys with no rotation, one value per dimension 0 and 1 and small noise elsewhere (so the basis
// is well defined); the queries read dimension 1 only.
std::vector<float> NearTieKey(const KvGeometry& g, float x0, float x1, std::mt19937& rng) {
  std::normal_distribution<float> noise(0.0f, 0.01f);
  std::vector<float> key(g.kv_width());
  for (int j = 0; j < g.kv_width(); ++j) {
    const int d = j % g.head_dim;
    key[j] = d == 0 ? x0 : d == 1 ? x1 : noise(rng);
  }
  return key;
}

TEST(ShadowKvTest, Fp8LandmarksAreRoundedAtCompressionAndGraduation) {
  // A near tie that the rounding decides. Chunk 3 (a prompt chunk) has landmark (1, 0.49, ~0):
  // scale 1/448, and 0.49 * 448 = 219.5 rounds to 224 (steps of 16 there): 0.5. Chunk 11 (made
  // by graduation) has (1.54, 0.51, ~0): scale 1.54/448, 0.51 * 448 / 1.54 = 148.4 rounds to 144:
  // 0.495. Every other landmark reads 0 in dimension 1. The query e1 picks (K = 1) chunk 11 from
  // fp32 landmarks (0.51 > 0.49) and chunk 3 from rounded ones (0.5 > 0.495); had either chunk
  // not been rounded, chunk 11 would still win (0.51 > 0.5, 0.495 > 0.49).
  const KvGeometry g = TestGeometry(/*rotary_dim=*/0);
  for (int fp8 : {0, 1}) {
    SCOPED_TRACE(fp8 ? "fp8 landmarks" : "fp32 landmarks");
    KvPolicyConfig config = ShadowConfig(8, 8, 0, 16);
    config.budget_tokens = 8;
    config.fp8_landmarks = fp8;
    auto policy = MakePolicy(config, g);
    auto sequence = std::move(policy->NewSequence()).value();
    auto& shadow = dynamic_cast<ShadowKvSequence&>(*sequence);
    std::mt19937 rng(7);
    auto key_at = [&](int64_t position) {
      if (position / 8 == 3) return NearTieKey(g, 1.0f, 0.49f, rng);
      if (position / 8 == 11) return NearTieKey(g, 1.54f, 0.51f, rng);
      return NearTieKey(g, 1.0f, 0.0f, rng);
    };
    std::vector<std::vector<float>> keys;  // [position][kv_width], the same for every layer
    for (int64_t p = 0; p < 104; ++p) keys.push_back(key_at(p));
    std::vector<float> query(g.q_width(), 0.0f);
    for (int q = 0; q < g.num_query_heads; ++q) query[q * g.head_dim + 1] = 1.0f;
    const std::vector<float> values(104 * g.kv_width(), 1.0f);
    // Prompt: 10 chunks and a window of 8.
    std::vector<float> prompt;
    for (int64_t p = 0; p < 88; ++p) prompt.insert(prompt.end(), keys[p].begin(), keys[p].end());
    for (int layer = 0; layer < g.num_layers; ++layer) {
      TokenBlock block{88, 0, prompt.data(), prompt.data(), values.data(), nullptr};
      ASSERT_TRUE(sequence->Append(layer, block).ok());
      ASSERT_TRUE(sequence->FinishPrefill(layer).ok());
    }
    // Decode 88..103: 80-87 graduate as chunk 10 at 95, 88-95 as chunk 11 at 103.
    for (int64_t p = 88; p < 104; ++p) {
      for (int layer = 0; layer < g.num_layers; ++layer) {
        TokenBlock block{1, p, keys[p].data(), keys[p].data(), values.data(), query.data()};
        ASSERT_TRUE(sequence->Append(layer, block).ok());
        AttentionInput input;
        ASSERT_TRUE(sequence->Prepare(layer, query.data(), 1, &input).ok());
      }
    }
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const auto info = shadow.Inspect(layer);
      ASSERT_EQ(info.num_chunks, 12);
      for (int h = 0; h < g.num_kv_heads; ++h) {
        ASSERT_EQ(info.landmark_chunks[h].size(), 12u);
        EXPECT_EQ(info.gathered_chunks[h], std::vector<int32_t>({fp8 ? 3 : 11}))
            << "layer " << layer << " head " << h;
      }
    }
  }
}

TEST(ShadowKvTest, Fp8LandmarksPickTheSameChunksOnAClearCase) {
  // Random RoPE'd keys; the query of every head is the sum of the unit landmarks of three chunks,
  // which then score about |L| (2.8) against about 0.6 for the others, far beyond the rounding
  // (at most 2^-4 of each landmark element). Both forms pick those three chunks.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 77);
  const std::vector<int64_t> targets = {4, 17, 29};
  for (int fp8 : {0, 1}) {
    SCOPED_TRACE(fp8 ? "fp8 landmarks" : "fp32 landmarks");
    KvPolicyConfig config = ShadowConfig(8, 32, 0, 32);
    config.budget_tokens = 24;  // K = 3 of 33 chunks
    config.fp8_landmarks = fp8;
    auto policy = MakePolicy(config, g);
    Runner runner(*policy, stream);
    runner.Step(300, true);
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::vector<float> query(g.q_width(), 0.0f);
      for (int h = 0; h < g.num_kv_heads; ++h) {
        std::vector<double> direction(g.head_dim, 0.0);
        for (int64_t c : targets) {
          auto keys = ChunkRows(stream, layer, h, 8, c, false);
          std::vector<double> mean(g.head_dim, 0.0);
          double norm = 0.0;
          for (int t = 0; t < 8; ++t)
            for (int i = 0; i < g.head_dim; ++i) mean[i] += keys[t * g.head_dim + i] / 8.0;
          for (double x : mean) norm += x * x;
          for (int i = 0; i < g.head_dim; ++i) direction[i] += mean[i] / std::sqrt(norm);
        }
        for (int q = 0; q < g.group_size(); ++q)
          for (int i = 0; i < g.head_dim; ++i)
            query[(h * g.group_size() + q) * g.head_dim + i] = static_cast<float>(direction[i]);
      }
      AttentionInput input;
      ASSERT_NO_FATAL_FAILURE(runner.AppendOne(layer, 300, query.data(), &input));
      const auto info = runner.shadow().Inspect(layer);
      for (int h = 0; h < g.num_kv_heads; ++h) {
        EXPECT_EQ(AsSet(info.gathered_chunks[h]), std::set<int64_t>(targets.begin(), targets.end()))
            << "layer " << layer << " head " << h;
      }
    }
  }
}

}  // namespace
}  // namespace shadowkv::kv
