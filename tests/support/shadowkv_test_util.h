// Shared fixtures of the ShadowKV policy tests (shadowkv_policy_test.cc and
// shadowkv_policy_fp8_test.cc): a deterministic token stream, a runner that feeds it to a policy
// and attends, and helpers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "kv/policies.h"
#include "kv/shadowkv_policy.h"
#include "ops/cpu/attention.h"

namespace shadowkv::kv::shadowkv_testing {

inline KvGeometry TestGeometry(int rotary_dim = 64) {
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

  // `count` consecutive tokens from `position`, rows concatenated, as one TokenBlock sees them.
  struct Block {
    int count = 0;
    int64_t position = 0;
    std::vector<float> pre, post, values, queries;
    TokenBlock View() const {
      return {count, position, pre.data(), post.data(), values.data(), queries.data()};
    }
  };
  Block MakeBlock(int layer, int64_t position, int count) const {
    Block b{count, position, {}, {}, {}, {}};
    for (int i = 0; i < count; ++i) {
      auto t = Make(layer, position + i);
      b.pre.insert(b.pre.end(), t.pre.begin(), t.pre.end());
      b.post.insert(b.post.end(), t.post.begin(), t.post.end());
      b.values.insert(b.values.end(), t.values.begin(), t.values.end());
      b.queries.insert(b.queries.end(), t.queries.begin(), t.queries.end());
    }
    return b;
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
      const TokenStream::Block tokens = stream_.MakeBlock(layer, position_, count);
      const TokenBlock block = tokens.View();
      const std::vector<float>& queries = tokens.queries;
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

inline std::unique_ptr<KvPolicy> MakePolicy(const KvPolicyConfig& config, const KvGeometry& g) {
  auto policy = MakeKvPolicy(config, g);
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  return policy.ok() ? std::move(policy).value() : nullptr;
}

// Largest |a − b| relative to the largest |b|, over every layer.
inline double RelativeError(const std::vector<std::vector<float>>& a,
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

inline KvPolicyConfig ShadowConfig(int chunk, int window, int64_t outliers, int rank = 0) {
  KvPolicyConfig c;
  c.policy = "shadowkv";
  c.chunk_size = chunk;
  c.local_window = window;
  c.outlier_chunks = outliers;
  c.rank = rank;
  c.budget_tokens = 100000;  // every chunk fits
  // The method's landmark selection and its rank rule without a floor; tests of the other
  // selections and of the floors name them.
  c.selection = "landmarks";
  c.rank_min = 0;
  c.rank_head_ratio = 0.0;
  return c;
}

// Chunk `c`'s rows of one KV head from the stream: [chunk, head_dim] post-RoPE keys or values.
inline std::vector<float> ChunkRows(const TokenStream& stream, int layer, int h, int chunk_size,
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

// The stream's 300-token prompt under `config` (a ShadowConfig(8, 32, 2, ...) with a budget of 8
// of the 33 selectable chunks, as the callers pass it), then its first decode token at every
// layer: fn(layer, kv_head, the head's segments (outliers, gathered, window), the layer's
// Inspect) for every layer and KV head, stopping at the first fatal failure.
template <typename Fn>
void ForEachHeadAtFirstDecode(const TokenStream& stream, const KvPolicyConfig& config, Fn fn) {
  const KvGeometry& g = stream.geometry();
  auto policy = MakePolicy(config, g);
  Runner runner(*policy, stream);
  runner.Step(300, true);
  for (int layer = 0; layer < g.num_layers; ++layer) {
    AttentionInput input;
    ASSERT_NO_FATAL_FAILURE(runner.AppendOne(layer, 300, nullptr, &input));
    const auto info = runner.shadow().Inspect(layer);
    for (int h = 0; h < g.num_kv_heads; ++h) {
      ASSERT_EQ(input.heads[h].size(), 3u);  // outliers, gathered, window
      ASSERT_NO_FATAL_FAILURE(fn(layer, h, input.heads[h], info));
    }
  }
}

// A setting at a budget every chunk fits in, which must attend exactly as full attention does
// through prefill (two blocks), decode steps that graduate chunks and a multi-token turn.
struct EquivalenceCase {
  int chunk, window, prompt;
  int64_t outliers;
  int key_rank, rank;  // rank 0: full (kv_width)
  int basis_groups = 1;
  std::string selection = "landmarks";
  double rank_energy = 0.0;
};

inline void CheckEquivalence(const EquivalenceCase& c) {
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, c.key_rank, 17);
  KvPolicyConfig full_config;
  auto full = MakePolicy(full_config, g);
  KvPolicyConfig shadow_config =
      ShadowConfig(c.chunk, c.window, c.outliers, c.rank ? c.rank : g.kv_width());
  shadow_config.basis_groups = c.basis_groups;
  shadow_config.selection = c.selection;
  shadow_config.rank_energy = c.rank_energy;
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

inline std::set<int64_t> AsSet(const std::vector<int32_t>& chunks) {
  return std::set<int64_t>(chunks.begin(), chunks.end());
}

}  // namespace shadowkv::kv::shadowkv_testing
