// Every KV policy on a sliding-window geometry: the windowed layers attend exactly their window,
// the global layers take the named policy; memory, stats, forks and refusals of the split.
#include <gtest/gtest.h>

#include <algorithm>

#include "kv/policies.h"
#include "kv/shadowkv_policy.h"
#include "support/policy_test_util.h"

namespace shadowkv::kv {
namespace {

using testing::BlockOf;
using testing::RandomStream;
using testing::TokenStream;

constexpr int64_t kWindow = 8;
constexpr int64_t kPrompt = 40;
constexpr int64_t kTotal = 72;  // prompt plus 32 decode steps

// gemma3's pattern in small: layers 0, 1 and 3 slide, layer 2 is global.
KvGeometry WindowedGeometry(std::vector<bool> windowed = {true, true, false, true}) {
  KvGeometry geometry = testing::SmallGeometry(static_cast<int>(windowed.size()));
  geometry.sliding_window = kWindow;
  geometry.layer_windowed = std::move(windowed);
  return geometry;
}

KvPolicyConfig Config(const std::string& name, int64_t budget) {
  KvPolicyConfig config;
  config.policy = name;
  config.budget_tokens = budget;
  config.local_window = 8;  // shadowkv: leave chunks to compress in a 40-token prompt
  config.snap_window = 8;
  config.quest_dense_layers = 0;
  return config;
}

// What a prepared input shows one query at `position` of a windowed layer, KV head `h`: the
// positions inside its window (each segment positioned and causal).
std::vector<int64_t> VisibleInWindow(const AttentionInput& input, int h, int64_t position) {
  std::vector<int64_t> visible;
  for (const KvSegment& s : input.heads[h]) {
    EXPECT_TRUE(s.causal);
    for (int t = 0; t < s.num_tokens; ++t) {
      const int64_t at = s.first_position + t;
      // The value tag says which token the row holds: it must be the one at its position.
      EXPECT_EQ(static_cast<int64_t>(s.values[static_cast<int64_t>(t) * s.row_stride]), at);
      if (at <= position && at > position - kWindow) visible.push_back(at);
    }
  }
  std::sort(visible.begin(), visible.end());
  return visible;
}

struct CheckedRun {
  int64_t global_decode_prepares = 0;
  int64_t global_decode_sparse = 0;  // of those, where KV head 0 read fewer rows than were held
  int64_t max_window_rows = 0;       // rows a windowed layer's prepared input held at most
};

// Prefill in chunks of `chunk`, then decode to kTotal; checks every windowed layer's attention
// against the fp64 reference over exactly its window, at every query.
CheckedRun RunChecked(SequenceKv& sequence, const TokenStream& stream, int64_t chunk) {
  const KvGeometry& geometry = stream.geometry;
  ThreadPool pool(2);
  CheckedRun run;
  auto step = [&](int64_t from, int64_t to) {
    for (int l = 0; l < geometry.num_layers; ++l) {
      const TokenBlock block = BlockOf(stream, l, from, to - from);
      ASSERT_TRUE(sequence.Append(l, block).ok());
      AttentionInput input;
      ASSERT_TRUE(sequence.Prepare(l, block.queries, block.num_tokens, &input).ok());
      if (!geometry.layer_windowed[l]) {
        if (to - from == 1 && from >= kPrompt) {
          run.global_decode_prepares++;
          run.global_decode_sparse += input.num_tokens(0) < to;
        }
        continue;
      }
      run.max_window_rows = std::max(run.max_window_rows, input.num_tokens(0));
      AttentionShape shape = testing::ShapeOf(geometry);
      shape.window = kWindow;
      std::vector<float> out(block.num_tokens * geometry.q_width());
      const AttentionJob job{block.queries, out.data(), block.num_tokens, from, &input};
      RunAttention(shape, std::span<const AttentionJob>(&job, 1), pool);
      for (int64_t p = from; p < to; ++p) {
        std::vector<std::vector<int64_t>> window(geometry.num_kv_heads);
        for (int h = 0; h < geometry.num_kv_heads; ++h) {
          window[h] = VisibleInWindow(input, h, p);
          std::vector<int64_t> expected;
          for (int64_t t = std::max<int64_t>(0, p - kWindow + 1); t <= p; ++t) {
            expected.push_back(t);
          }
          ASSERT_EQ(window[h], expected) << "layer " << l << " position " << p;
        }
        const std::vector<float> reference = testing::ReferenceOver(stream, l, p, window);
        testing::ExpectClose(std::span<const float>(out.data() + (p - from) * geometry.q_width(),
                                                    geometry.q_width()),
                             reference, 1e-4f);
      }
    }
  };
  for (int64_t from = 0; from < kPrompt; from += chunk) step(from, std::min(kPrompt, from + chunk));
  for (int l = 0; l < geometry.num_layers; ++l) EXPECT_TRUE(sequence.FinishPrefill(l).ok());
  for (int64_t t = kPrompt; t < kTotal; ++t) step(t, t + 1);
  return run;
}

TEST(SlidingSplitPolicyTest, WindowedLayersAttendTheirWindowAndGlobalLayersGoSparse) {
  const KvGeometry geometry = WindowedGeometry();
  const TokenStream stream = RandomStream(geometry, kTotal, 7);
  for (const std::string& name : KnownKvPolicies()) {
    for (int64_t chunk : {int64_t{5}, int64_t{13}, kPrompt}) {
      SCOPED_TRACE(name + ", chunks of " + std::to_string(chunk));
      auto policy = MakeKvPolicy(Config(name, 16), geometry);
      ASSERT_TRUE(policy.ok()) << policy.status().ToString();
      EXPECT_EQ((*policy)->name(), name);
      EXPECT_EQ((*policy)->config().budget_tokens, 16);
      auto sequence = (*policy)->NewSequence();
      ASSERT_TRUE(sequence.ok()) << sequence.status().ToString();
      const CheckedRun run = RunChecked(**sequence, stream, chunk);
      EXPECT_EQ((*sequence)->num_tokens(), kTotal);
      // A window's rows: what the block's first query reaches back to, plus up to a window
      // awaiting compaction.
      EXPECT_LE(run.max_window_rows, 2 * kWindow - 1 + chunk);
      EXPECT_EQ(run.global_decode_prepares, kTotal - kPrompt);
      EXPECT_EQ(run.global_decode_sparse, name == "full" ? 0 : run.global_decode_prepares);
    }
  }
}

// The windowed layers hold at most 2 * window - 1 rows after prefill; memory() counts them and
// the global part's own; EstimateMemory says the same for the full policy.
TEST(SlidingSplitPolicyTest, MemoryCountsTheWindowsNotTheWholeContext) {
  const KvGeometry geometry = WindowedGeometry();
  const TokenStream stream = RandomStream(geometry, kTotal, 3);
  auto split = MakeKvPolicy(Config("full", 0), geometry);
  ASSERT_TRUE(split.ok());
  auto every_token = MakeFullPolicy(Config("full", 0), geometry);  // keeps all rows everywhere
  ASSERT_TRUE(every_token.ok());
  auto sequence = (*split)->NewSequence();
  auto reference = (*every_token)->NewSequence();
  ASSERT_TRUE(sequence.ok() && reference.ok());
  testing::RunPolicy(**sequence, stream, kPrompt, kPrompt);
  testing::RunPolicy(**reference, stream, kPrompt, kPrompt);
  const int64_t row_bytes = 2 * geometry.kv_width() * static_cast<int64_t>(sizeof(float));
  EXPECT_EQ((*reference)->memory().fast_bytes, 4 * kTotal * row_bytes);
  const int64_t held = (*sequence)->memory().fast_bytes;
  EXPECT_GE(held, (3 * (kWindow - 1) + kTotal) * row_bytes);
  EXPECT_LE(held, (3 * (2 * kWindow - 1) + kTotal) * row_bytes);
  EXPECT_EQ((*split)->EstimateMemory(kTotal).fast_bytes,
            (3 * (2 * kWindow - 1) + kTotal) * row_bytes);
  EXPECT_EQ((*split)->EstimateMemory(5).fast_bytes, 4 * 5 * row_bytes);
  EXPECT_EQ((*sequence)->stats().prepare_calls, (*reference)->stats().prepare_calls);
}

// ShadowKV's per-layer counters and layer descriptions come at the model's layer indices.
TEST(SlidingSplitPolicyTest, ShadowKvReportsAtTheModelsLayers) {
  const KvGeometry geometry = WindowedGeometry();
  const TokenStream stream = RandomStream(geometry, kTotal, 5);
  auto policy = MakeKvPolicy(Config("shadowkv", 16), geometry);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  auto sequence = (*policy)->NewSequence();
  ASSERT_TRUE(sequence.ok());
  testing::RunPolicy(**sequence, stream, kPrompt, kPrompt);
  const std::vector<PolicyStats> layers = (*sequence)->layer_stats();
  ASSERT_EQ(layers.size(), 4u);
  for (const PolicyStats& s : layers) EXPECT_EQ(s.prepare_calls, 1 + kTotal - kPrompt);
  EXPECT_GT(layers[2].chunk_selections, 0);
  EXPECT_EQ(layers[0].chunk_selections, 0);
  const auto* shadow = dynamic_cast<const ShadowKvSequence*>(sequence->get());
  ASSERT_NE(shadow, nullptr);
  EXPECT_TRUE(shadow->Inspect(2).compressed);
  EXPECT_GT(shadow->Inspect(2).rank, 0);
  EXPECT_FALSE(shadow->Inspect(3).compressed);
  EXPECT_EQ(shadow->Inspect(3).rank, 0);
  EXPECT_LE(shadow->Inspect(3).exact_tokens, 2 * kWindow - 1);

  // The other policies do not describe themselves as ShadowKV's.
  auto snap = MakeKvPolicy(Config("snapkv", 16), geometry);
  ASSERT_TRUE(snap.ok());
  auto snap_sequence = (*snap)->NewSequence();
  ASSERT_TRUE(snap_sequence.ok());
  EXPECT_EQ(dynamic_cast<const ShadowKvSequence*>(snap_sequence->get()), nullptr);
}

// A fork of the full policy's split goes on exactly as the original; the sparse policies do not
// copy their states, and the split says so.
TEST(SlidingSplitPolicyTest, ForksWhereBothPartsFork) {
  const KvGeometry geometry = WindowedGeometry();
  const TokenStream stream = RandomStream(geometry, kTotal, 11);
  auto policy = MakeKvPolicy(Config("full", 0), geometry);
  ASSERT_TRUE(policy.ok());
  auto original = (*policy)->NewSequence();
  ASSERT_TRUE(original.ok());
  ThreadPool pool(2);
  std::vector<std::vector<float>> a(4), b(4);
  testing::StepPolicy(**original, stream, 0, kPrompt, pool, a);
  for (int l = 0; l < 4; ++l) ASSERT_TRUE((*original)->FinishPrefill(l).ok());
  auto fork = (*original)->Fork();
  ASSERT_TRUE(fork.ok()) << fork.status().ToString();
  EXPECT_EQ((*fork)->num_tokens(), kPrompt);
  EXPECT_EQ((*fork)->memory().fast_bytes, (*original)->memory().fast_bytes);
  for (int64_t t = kPrompt; t < kTotal; ++t) {
    testing::StepPolicy(**original, stream, t, t + 1, pool, a);
    testing::StepPolicy(**fork, stream, t, t + 1, pool, b);
  }
  for (int l = 0; l < 4; ++l) {
    const int64_t w = geometry.q_width();
    EXPECT_TRUE(std::equal(a[l].begin() + kPrompt * w, a[l].end(), b[l].begin() + kPrompt * w))
        << "layer " << l;
  }

  auto snap = MakeKvPolicy(Config("snapkv", 16), geometry);
  ASSERT_TRUE(snap.ok());
  auto sparse = (*snap)->NewSequence();
  ASSERT_TRUE(sparse.ok());
  EXPECT_EQ((*sparse)->Fork().status().code(), ErrorCode::kUnsupported);
}

// Settings that count the model's first layers count the global layers among them.
TEST(SlidingSplitPolicyTest, GlobalLayersGetTheirOwnGeometryAndLayerCounts) {
  const KvGeometry geometry = WindowedGeometry();
  const KvGeometry global = GlobalLayersGeometry(geometry);
  EXPECT_EQ(global.num_layers, 1);
  EXPECT_TRUE(global.layer_windowed.empty());
  EXPECT_EQ(global.sliding_window, 0);
  EXPECT_EQ(global.kv_width(), geometry.kv_width());
  KvPolicyConfig config;
  config.exact_layers = 3;
  config.quest_dense_layers = 2;
  const KvPolicyConfig mapped = GlobalLayersConfig(config, geometry);
  EXPECT_EQ(mapped.exact_layers, 1);
  EXPECT_EQ(mapped.quest_dense_layers, 0);
}

// A model whose every layer slides has no global layer for a sparse policy: it is refused,
// saying so; the full policy serves it (every layer trimmed to its window).
TEST(SlidingSplitPolicyTest, EveryLayerWindowedRefusesTheSparsePolicies) {
  const KvGeometry geometry = WindowedGeometry({true, true});
  for (const std::string& name : KnownKvPolicies()) {
    auto policy = MakeKvPolicy(Config(name, 16), geometry);
    if (name == "full") {
      ASSERT_TRUE(policy.ok()) << policy.status().ToString();
      auto sequence = (*policy)->NewSequence();
      ASSERT_TRUE(sequence.ok());
      const TokenStream stream = RandomStream(geometry, kTotal, 13);
      RunChecked(**sequence, stream, 13);
      EXPECT_EQ((*sequence)->num_tokens(), kTotal);
      continue;
    }
    ASSERT_FALSE(policy.ok()) << name;
    EXPECT_EQ(policy.status().code(), ErrorCode::kUnsupported);
    const std::string& message = policy.status().message();
    EXPECT_NE(message.find("'" + name + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("sliding window of 8 tokens"), std::string::npos) << message;
    EXPECT_NE(message.find("global layers only"), std::string::npos) << message;
  }
  KvGeometry broken = WindowedGeometry();
  broken.layer_windowed.pop_back();
  EXPECT_EQ(MakeKvPolicy(Config("snapkv", 16), broken).status().code(),
            ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace shadowkv::kv
