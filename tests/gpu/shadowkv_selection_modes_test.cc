// ShadowKV's selection modes through the whole GPU decode step (graph replay, the selection in
// halves, host values, graduations) and their reuse: the re-rank and the per-query-head
// selection against the landmark selection and the CPU policy, chunks drawn at random beside the
// ranked ones (select_sample), a selection served for several steps (select_interval) and made
// again where the queries turn (select_drift).
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"
#include "shadowkv_parity_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

// Re-ranking through the whole step (graph replay, the selection in halves, host values,
// graduations). With rerank_factor 1 the candidates are the landmarks' K and all are kept, so
// the step must equal the landmark selection bit for bit; with 4 it decodes on its own choice.
// Where the CPU policy re-ranks too, the parity with it as for the landmarks.
TEST(CudaShadowKvParityTest, RerankRunsThroughTheDecodeStep) {
  SKV_SKIP_WITHOUT_GPU();
  const kv::KvPolicyConfig landmarks = ParityConfig(false);
  kv::KvPolicyConfig rerank = landmarks;
  rerank.selection = "rerank";
  rerank.rerank_factor = 1;
  rerank.label = "shadowkv:select=rerank:rerank_factor=1";
  std::vector<std::vector<int32_t>> landmark_chunks, rerank_chunks, wide_chunks;
  const std::vector<float> want = DecodeOnGpu(landmarks, &landmark_chunks);
  const std::vector<float> got = DecodeOnGpu(rerank, &rerank_chunks);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(got, want) << "rerank_factor 1 keeps the landmarks' choice";
  EXPECT_EQ(rerank_chunks, landmark_chunks);
  rerank.rerank_factor = 4;
  rerank.label = "shadowkv:select=rerank";
  const std::vector<float> wide = DecodeOnGpu(rerank, &wide_chunks);
  ASSERT_EQ(wide.size(), want.size());
  int64_t same = 0, total = 0;
  for (size_t i = 0; i < wide_chunks.size() && i < landmark_chunks.size(); ++i) {
    std::set<int32_t> a(wide_chunks[i].begin(), wide_chunks[i].end());
    for (int32_t c : landmark_chunks[i]) same += a.count(c);
    total += static_cast<int64_t>(landmark_chunks[i].size());
  }
  std::printf("[ rerank   ] rerank_factor 4: %lld of %lld gathered chunks also the landmarks'\n",
              static_cast<long long>(same), static_cast<long long>(total));
  EXPECT_LT(same, total) << "re-ranking 4K candidates never changed a choice";

  CheckParityWhereTheCpuRuns(rerank, /*want_ranks=*/24);
  // Candidates scored with the first 8 of the 24 components, kept chunks attended at 24.
  rerank.rerank_rank = 8;
  rerank.label = "shadowkv:select=rerank:rerank_rank=8";
  CheckParityWhereTheCpuRuns(rerank, /*want_ranks=*/24);
}

// The re-rank reads stored bf16 exact keys ahead of the tile it scores (by cp.async) or a tile at
// a time: the same keys either way, so the same logits bit for bit and the same chunks, odd
// sequences' stores in host memory included. FP8 keys are scored as coded when read ahead and
// decoded when read a tile at a time, which round differently: CudaShadowKvRerankTest checks
// both against exact scores, and ExactKeysInTheStoreDecodeAsTheFullCacheAndTheCpuPolicy the
// whole step against the CPU policy.
TEST(CudaShadowKvParityTest, StoredKeysReadAheadScoreAsReadInPlace) {
  SKV_SKIP_WITHOUT_GPU();
  kv::KvPolicyConfig config = ParityConfig(false);
  config.selection = "rerank";
  config.exact_keys = 1;
  config.label = "shadowkv:exact_keys=1";
  CudaModelOptions in_place = tp_testing::SmallOptions();
  in_place.kernels.stored_key_prefetch = 0;
  std::vector<std::vector<int32_t>> ahead_chunks, in_place_chunks;
  const std::vector<float> ahead = DecodeOnGpu(config, &ahead_chunks);
  const std::vector<float> plain = DecodeOnGpu(config, &in_place_chunks, nullptr, in_place);
  ASSERT_FALSE(ahead.empty()) << config.label;
  EXPECT_EQ(ahead, plain) << config.label;
  EXPECT_EQ(ahead_chunks, in_place_chunks) << config.label;
}

// Per-query-head selection through the whole step: copies equal to their originals, K chunks
// per head at every step, a choice of its own; where the CPU policy selects per head too, the
// parity with it as for the landmarks.
TEST(CudaShadowKvParityTest, PerQueryHeadSelectionRunsThroughTheDecodeStep) {
  SKV_SKIP_WITHOUT_GPU();
  kv::KvPolicyConfig heads = ParityConfig(false);
  heads.selection = "heads";
  heads.label = "shadowkv:select=heads";
  std::vector<std::vector<int32_t>> landmark_chunks, head_chunks;
  const std::vector<float> landmarks = DecodeOnGpu(ParityConfig(false), &landmark_chunks);
  const std::vector<float> got = DecodeOnGpu(heads, &head_chunks);
  ASSERT_EQ(got.size(), landmarks.size());
  ASSERT_FALSE(got.empty());
  EXPECT_NE(head_chunks, landmark_chunks) << "per-head selection never changed a choice";

  CheckParityWhereTheCpuRuns(heads, /*want_ranks=*/24);
}

// select_interval 3 through the whole step (graph replay, the selection in halves, host
// values), for each selection mode: at the steps between selections every gather slot keeps its
// chunk (no selection, fetch or rebuild for the row), and the CPU policy at the same interval
// agrees as at interval 1.
TEST(CudaShadowKvParityTest, SelectIntervalReusesTheGatheredChunks) {
  SKV_SKIP_WITHOUT_GPU();
  const TinyModelSpec spec = SmallLlamaSpec(7);
  for (const char* mode : {"landmarks", "rerank", "heads"}) {
    kv::KvPolicyConfig config = ParityConfig(false);
    config.selection = mode;
    config.select_interval = 3;
    config.label = std::string("shadowkv:select=") + mode + ":interval=3";
    SCOPED_TRACE(config.label);
    std::vector<std::vector<int32_t>> gathered;
    ASSERT_FALSE(DecodeOnGpu(config, &gathered).empty());
    const size_t per_step = 2u * spec.layers * spec.kv_heads;
    ASSERT_EQ(gathered.size(), 24 * per_step);
    int changed = 0;
    for (int step = 1; step < 24; ++step) {
      for (size_t i = 0; i < per_step; ++i) {
        const auto& now = gathered[step * per_step + i];
        const auto& before = gathered[(step - 1) * per_step + i];
        if (step % 3 != 0) {
          ASSERT_EQ(now, before) << "step " << step << ", entry " << i;
        } else {
          changed += now != before;
        }
      }
    }
    EXPECT_GT(changed, 0) << "no selecting step changed a slot";
    CheckParityWhereTheCpuRuns(config, /*want_ranks=*/24);
  }
}

// Chunks drawn at random (select_sample 0.25 of K = 8: 6 ranked, 2 drawn) under the landmark
// selection and the re-rank, and kept between selections (interval 3): the GPU draws what the CPU
// policy draws (the same seed and shuffle) and weighs them alike, so the parity holds as for the
// ranked selections; the draw changes the chunks gathered; the first kernels draw as the fast
// ones do (their scores may round apart, so nearly always the same chunks).
TEST(CudaShadowKvParityTest, SampledChunksAreDrawnAsTheCpuPolicyDrawsThem) {
  SKV_SKIP_WITHOUT_GPU();
  for (const char* mode : {"landmarks", "rerank"}) {
    for (const int interval : {1, 3}) {
      kv::KvPolicyConfig ranked = ParityConfig(false);
      ranked.selection = mode;
      ranked.select_interval = interval;
      kv::KvPolicyConfig config = ranked;
      config.select_sample = 0.25;
      config.label = std::string("shadowkv:select=") + mode + ":sample=0.25:interval=" +
                     std::to_string(interval);
      SCOPED_TRACE(config.label);
      std::vector<std::vector<int32_t>> drawn_chunks, ranked_chunks, first_chunks;
      const std::vector<float> drawn = DecodeOnGpu(config, &drawn_chunks);
      ASSERT_FALSE(drawn.empty());
      ASSERT_FALSE(DecodeOnGpu(ranked, &ranked_chunks).empty());
      EXPECT_NE(drawn_chunks, ranked_chunks) << "the draw never changed a choice";
      CudaModelOptions first = tp_testing::SmallOptions();
      first.kernels.shadowkv_kernels = kSkvKernelsFirst;
      ASSERT_EQ(DecodeOnGpu(config, &first_chunks, nullptr, first).size(), drawn.size());
      ASSERT_EQ(first_chunks.size(), drawn_chunks.size());
      int64_t same = 0, total = 0;
      for (size_t i = 0; i < first_chunks.size(); ++i) {
        const std::set<int32_t> fast(drawn_chunks[i].begin(), drawn_chunks[i].end());
        for (int32_t c : first_chunks[i]) same += fast.count(c);
        total += static_cast<int64_t>(first_chunks[i].size());
      }
      EXPECT_GE(static_cast<double>(same), 0.97 * static_cast<double>(total))
          << "the first kernels gathered other chunks";
      CheckParityWhereTheCpuRuns(config, /*want_ranks=*/24);
    }
  }
}

// select_drift through the whole step (graph replay, the selection in halves, host values), for
// the landmark and re-rank selections. At drift 1 no step's queries are parallel to the last
// selection's, so every KV head selects at every step and the decode equals interval 1's bit
// for bit. At lower thresholds a head selects at least every select_interval (6) steps and
// sooner where its queries turn: fewer selections the lower the threshold, some of them between
// the interval's steps and some heads keeping their chunks; each (row, layer, KV head) step is
// counted. Where selections are mixed, the CPU policy at the same settings agrees as at interval
// 1 (it decides from fp32 queries, the GPU from bf16 ones). A sequence's own threshold follows its
// budget (drift_small below drift_small_below).
TEST(CudaShadowKvParityTest, SelectDriftSelectsWhereTheQueriesTurn) {
  SKV_SKIP_WITHOUT_GPU();
  const TinyModelSpec spec = SmallLlamaSpec(7);
  const int64_t head_steps = int64_t{24} * 4 * spec.layers * spec.kv_heads;
  const int64_t periodic = int64_t{4} * 4 * spec.layers * spec.kv_heads;  // steps 0, 6, 12, 18
  for (const char* mode : {"landmarks", "rerank"}) {
    kv::KvPolicyConfig every = ParityConfig(false);
    every.selection = mode;
    SCOPED_TRACE(mode);
    std::vector<std::vector<int32_t>> every_chunks, always_chunks;
    const std::vector<float> want = DecodeOnGpu(every, &every_chunks);
    kv::KvPolicyConfig always = every;
    always.select_interval = 6;
    always.select_drift = 1.0;
    CudaShadowKvStats stats;
    const std::vector<float> got = DecodeOnGpu(always, &always_chunks, &stats);
    ASSERT_FALSE(want.empty());
    EXPECT_TRUE(got == want) << "drift 1 did not decode as every-step selection";
    EXPECT_EQ(always_chunks, every_chunks);
    EXPECT_EQ(stats.head_steps, head_steps);
    EXPECT_EQ(stats.head_selections, head_steps);

    std::vector<int64_t> selections;
    std::optional<kv::KvPolicyConfig> mixed;
    for (const char* drift : {"0.9", "0.6", "0.3", "0.1"}) {
      kv::KvPolicyConfig config = always;
      config.select_drift = std::stod(drift);
      config.label = std::string("shadowkv:select=") + mode + ":interval=6:drift=" + drift;
      std::vector<std::vector<int32_t>> chunks;
      ASSERT_FALSE(DecodeOnGpu(config, &chunks, &stats).empty());
      std::printf("[ drift    ] %s: %lld of %lld head steps selected\n", config.label.c_str(),
                  static_cast<long long>(stats.head_selections),
                  static_cast<long long>(stats.head_steps));
      EXPECT_EQ(stats.head_steps, head_steps);
      EXPECT_GE(stats.head_selections, periodic);
      selections.push_back(stats.head_selections);
      if (!mixed && stats.head_selections > periodic && stats.head_selections < head_steps) {
        mixed = config;
      }
    }
    // Decisions depend on the path (a selection moves the reference), so only the ends compare.
    EXPECT_LT(selections.back(), selections.front()) << "drift 0.1 selected as often as 0.9";

    // Each sequence's threshold comes from its budget (64 tokens here): below drift_small_below
    // it is drift_small, at the bound drift. Both of these decode as drift 0.9 itself.
    kv::KvPolicyConfig tight = always;
    tight.select_drift = 0.9;
    std::vector<std::vector<int32_t>> tight_chunks;
    const std::vector<float> tight_out = DecodeOnGpu(tight, &tight_chunks, &stats);
    const int64_t tight_selections = stats.head_selections;
    ASSERT_FALSE(tight_out.empty());
    for (const auto& [base, small, below] :
         {std::tuple{0.1, 0.9, int64_t{65}}, std::tuple{0.9, 0.1, int64_t{64}}}) {
      kv::KvPolicyConfig config = always;
      config.select_drift = base;
      config.select_drift_small = small;
      config.drift_small_below = below;
      std::vector<std::vector<int32_t>> chunks;
      EXPECT_TRUE(DecodeOnGpu(config, &chunks, &stats) == tight_out)
          << "drift " << base << ", " << small << " below " << below;
      EXPECT_EQ(chunks, tight_chunks);
      EXPECT_EQ(stats.head_selections, tight_selections);
    }
    ASSERT_TRUE(mixed.has_value()) << "no threshold mixed kept and turned heads";
    CheckParityWhereTheCpuRuns(*mixed, /*want_ranks=*/24);
  }
}

}  // namespace
}  // namespace shadowkv::cuda
