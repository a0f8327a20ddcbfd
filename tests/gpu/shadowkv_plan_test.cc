// The host side of ShadowKV on the GPU (gpu/model/shadowkv_plan.h, pure C++, no GPU needed):
// the row planner against the CPU's graduation rule, the refusals of prompts and settings the
// kernels do not take, the rank from the key spectrum, the memory of a sequence (per-layer rank,
// sliding-window rings, exact keys in the store, the drift state), the capacity's tiles, the
// bench's budget and its spread of host-value rows.
#include <algorithm>
#include <utility>
#include <vector>

#include "gpu/bench/cuda_bench.h"
#include "gpu/model/shadowkv_plan.h"
#include "gpu/serving/pool_memory.h"
#include "gpu_test_util.h"
#include "shadowkv_test_util.h"
#include "kv/kv_config.h"

namespace shadowkv::cuda {
namespace {

// Hand-computed: W = 32, C = 8, a 100-token prompt chunks [0, 64) and keeps 36 tokens exact; the
// window would reach 40 exact tokens with token 103, so at that step chunk 8 (tokens 64..71)
// leaves before the token is written.
TEST(CudaShadowKvPlanTest, RowPlansFollowTheCpuGraduationRule) {
  SkvSequenceInfo info{2, 8, 16, 80};
  EXPECT_EQ(SkvExactFirst(100, 64, 8, 32), 64);
  EXPECT_EQ(SkvExactFirst(103, 64, 8, 32), 64);
  EXPECT_EQ(SkvExactFirst(104, 64, 8, 32), 72);
  SkvRowMeta first = PlanSkvRow(3, 100, 64, info, 8, 32);  // token 100 goes in
  EXPECT_EQ(first.seq, 3);
  EXPECT_EQ(first.pre_row, 36);
  EXPECT_EQ(first.attn_row, 80 + 36);
  EXPECT_EQ(first.held_rows, 36);
  EXPECT_EQ(first.graduate_chunk, -1);
  EXPECT_EQ(first.num_chunks, 8);
  EXPECT_EQ(first.attn_last, 80 + 37 - 1);
  SkvRowMeta graduating = PlanSkvRow(3, 103, 64, info, 8, 32);  // token 103: 40 exact
  // The chunk leaves first (39 held, 31 kept), then the token goes in after the 31.
  EXPECT_EQ(graduating.held_rows, 39);
  EXPECT_EQ(graduating.pre_row, 31);
  EXPECT_EQ(graduating.attn_row, 80 + 31);
  EXPECT_EQ(graduating.graduate_chunk, 8);
  EXPECT_EQ(graduating.num_chunks, 9);
  EXPECT_EQ(graduating.attn_last, 80 + 32 - 1);  // 32 exact after the chunk left
  SkvRowMeta next = PlanSkvRow(3, 104, 64, info, 8, 32);
  EXPECT_EQ(next.pre_row, 32);
  EXPECT_EQ(next.graduate_chunk, -1);
  EXPECT_EQ(next.num_chunks, 9);
  EXPECT_EQ(first.reuse + graduating.reuse + next.reuse, 0);  // interval 1: every step selects
  // select_interval 3 after a 100-token prompt: decode steps 0, 3, 6 select, the others reuse.
  info.decode_origin = 100;
  for (int64_t length = 100; length < 107; ++length) {
    EXPECT_EQ(PlanSkvRow(3, length, 64, info, 8, 32, 3).reuse, (length - 100) % 3 != 0 ? 1 : 0)
        << "length " << length;
  }
}

TEST(CudaShadowKvPlanTest, ShortPromptsAreRefusedNotMiscompressed) {
  const kv::KvPolicyConfig config = testing::ParityConfig();
  auto geometry = MakeSkvGeometry(config, 2, 2, 64, 512);
  ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
  EXPECT_EQ(geometry->rank, 24);  // ceil8(128 / 6.4)
  EXPECT_EQ(geometry->max_budget, 8);
  EXPECT_EQ(geometry->max_outliers, 2);  // round(64 / 1024 * 24)
  auto too_short = PlanSkvCompression(config, *geometry, 100);  // 8 chunks < 8 + 2
  EXPECT_EQ(too_short.status().code(), ErrorCode::kUnsupported);
  auto ok = PlanSkvCompression(config, *geometry, 300);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->num_chunks, 33);  // (300 - 32) / 8
  EXPECT_EQ(ok->info.recent_base, (2 + 8) * 8);
}

// No exact window is refused by name: a step graduates before it appends, so the GPU needs an
// exact token behind the new one.
TEST(CudaShadowKvPlanTest, NoExactWindowIsRefusedByName) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.local_window = 0;
  auto geometry = MakeSkvGeometry(config, 2, 2, 64, 512);
  ASSERT_FALSE(geometry.ok());
  EXPECT_EQ(geometry.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(geometry.status().message().find("window=0"), std::string::npos)
      << geometry.status().ToString();
  config.local_window = 1;
  EXPECT_TRUE(MakeSkvGeometry(config, 2, 2, 64, 512).ok());
}

// Sampled chunks (select_sample): each sequence draws the share of its own budget (0.25 of 8
// chunks: 2; of 20: 5), the layout reserves the share of the largest, and one fp32 log weight
// per gather slot (2 layers x 2 KV heads x 20 slots) is counted on the device.
TEST(CudaShadowKvPlanTest, SampledChunksFollowEachSequencesBudget) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.budget_tokens = 0;
  config.budget_fraction = 0.3125;  // 160 tokens (20 chunks) at the capacity of 512
  config.budget_min_tokens = 64;
  kv::KvPolicyConfig sampled = config;
  sampled.select_sample = 0.25;
  auto plain = MakeSkvGeometry(config, 2, 2, 64, 512);
  auto geometry = MakeSkvGeometry(sampled, 2, 2, 64, 512);
  ASSERT_TRUE(plain.ok() && geometry.ok()) << geometry.status().ToString();
  EXPECT_EQ(plain->max_sample, 0);
  EXPECT_EQ(geometry->max_budget, 20);
  EXPECT_EQ(geometry->max_sample, 5);
  EXPECT_EQ(geometry->DeviceBytesPerSequence() - plain->DeviceBytesPerSequence(), 2 * 2 * 20 * 4);
  auto small = PlanSkvCompression(sampled, *geometry, 200);  // budget 64 tokens: 8 chunks
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ(small->info.budget_chunks, 8);
  EXPECT_EQ(small->info.sample_chunks, 2);
  auto large = PlanSkvCompression(sampled, *geometry, 512);
  ASSERT_TRUE(large.ok()) << large.status().ToString();
  EXPECT_EQ(large->info.budget_chunks, 20);
  EXPECT_EQ(large->info.sample_chunks, 5);
  auto none = PlanSkvCompression(config, *plain, 512);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->info.sample_chunks, 0);
}

// Hand-computed: of a trace of 100, the first 8 eigenvalues hold 80 and the next 8 hold 15; the
// spectrum given stops at 16 (a fit at a cap of 16), so shares past 95% take the cap.
TEST(CudaShadowKvPlanTest, RankForEnergyIsTheSmallestMultipleOfEightHoldingTheShare) {
  std::vector<double> eigenvalues(16);
  for (int i = 0; i < 8; ++i) eigenvalues[i] = 10.0;
  for (int i = 8; i < 16; ++i) eigenvalues[i] = 15.0 / 8;
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.05, 8, 16), 8);  // the first direction
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.80, 8, 16), 8);
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.81, 8, 16), 16);
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.99, 8, 16), 16);   // not held: the cap
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.80, 16, 32), 16);  // the floor
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.81, 8, 8), 8);     // the cap
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 0.0, 0.9, 8, 16), 8);      // no energy: the floor
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 95.0, 1.0, 8, 16), 16);     // all of it: the cap
  // A spectrum narrower than the cap is a whole one: its width bounds the rank.
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 0.0, 0.9, 24, 32), 16);
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 95.0, 1.0, 8, 32), 16);
  eigenvalues[1] = -10.0;  // rounding noise holds nothing: 70 in the first 8 (not 60)
  EXPECT_EQ(SkvRankForEnergy(eigenvalues, 100.0, 0.69, 8, 16), 8);
}

// A per-layer rank lays the storage out at its cap (rank_max, or the width when 0), so the
// memory of a sequence is that of the fixed rank at the cap plus one rank per layer; the pool's
// planning counts the same. A cap the kernels cannot take and modes not built are refused;
// re-ranking sizes its candidates from the budget at capacity, within the kernels' bound.
TEST(CudaShadowKvPlanTest, PerLayerRankIsSizedAtItsCap) {
  kv::KvPolicyConfig fixed;
  fixed.policy = "shadowkv";
  fixed.budget_tokens = 64;
  kv::KvPolicyConfig spectrum = fixed;
  spectrum.rank_energy = 0.9;
  spectrum.rank_min = 12;
  auto half_head = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(half_head.ok()) << half_head.status().ToString();
  EXPECT_EQ(half_head->rank_floor, 32);  // the default head floor: half of 64
  spectrum.rank_head_ratio = 0.0;
  auto wide = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(wide.ok()) << wide.status().ToString();
  EXPECT_TRUE(wide->per_layer_rank());
  EXPECT_EQ(wide->rank, 128);  // the width
  EXPECT_EQ(wide->rank_floor, 16);
  fixed.rank = 128;
  auto at_width = MakeSkvGeometry(fixed, 2, 2, 64, 512);
  ASSERT_TRUE(at_width.ok());
  EXPECT_EQ(wide->DeviceBytesPerSequence(), at_width->DeviceBytesPerSequence());
  spectrum.rank_max = 64;
  auto capped = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->rank, 64);
  fixed.rank = 64;
  auto at_cap = MakeSkvGeometry(fixed, 2, 2, 64, 512);
  ASSERT_TRUE(at_cap.ok());
  EXPECT_EQ(capped->DeviceBytesPerSequence(), at_cap->DeviceBytesPerSequence());
  // A, B: the cap's 64 columns / rows, not 128.
  EXPECT_EQ(wide->DeviceBytesPerSequence() - capped->DeviceBytesPerSequence(),
            2ll * (64 * 8 * 64 + 64 * 128) * 2);
  ModelConfig model;
  model.num_layers = 2;
  model.num_kv_heads = 2;
  model.head_dim = 64;
  auto pool = LeastSequenceBytes(model, 512, &spectrum, /*host_values=*/true, {});
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ(*pool, capped->DeviceBytesPerSequence());
  spectrum.rank_max = 100;
  auto odd = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  EXPECT_EQ(odd.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(odd.status().message().find("rank_max"), std::string::npos) << odd.status().ToString();
  spectrum.rank_max = 0;
  spectrum.selection = "rerank";  // 4 x 8 candidates of the 64 chunks
  auto rerank = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(rerank.ok()) << rerank.status().ToString();
  EXPECT_EQ(rerank->max_candidates, 32);
  spectrum.rerank_factor = 100;  // no more candidates than chunks
  rerank = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(rerank.ok());
  EXPECT_EQ(rerank->max_candidates, 64);
  spectrum.rerank_factor = 1;  // 1 x 8 candidates, at least 200 tokens: 25 chunks
  spectrum.rerank_min_tokens = 200;
  rerank = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(rerank.ok());
  EXPECT_EQ(rerank->max_candidates, 25);
  EXPECT_EQ(rerank->rerank_min_chunks, 25);
  spectrum.rerank_min_tokens = 1000;  // at most the 64 chunks
  rerank = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  ASSERT_TRUE(rerank.ok());
  EXPECT_EQ(rerank->max_candidates, 64);
  EXPECT_EQ(rerank->rerank_min_chunks, 64);
  spectrum.rerank_min_tokens = 0;
  spectrum.rerank_factor = 1000;
  rerank = MakeSkvGeometry(spectrum, 2, 2, 64, 1 << 17);  // 1000 x 8 of 16384 chunks > 4096
  EXPECT_EQ(rerank.status().code(), ErrorCode::kUnsupported) << rerank.status().ToString();
  spectrum.rerank_factor = 4;
  spectrum.selection = "heads";
  EXPECT_TRUE(MakeSkvGeometry(spectrum, 2, 2, 64, 512).ok());
  spectrum.select_successors = 1;  // one selection rule at a time
  EXPECT_EQ(MakeSkvGeometry(spectrum, 2, 2, 64, 512).status().code(), ErrorCode::kUnsupported);
  spectrum.select_successors = 0;
  spectrum.selection = "mass";
  auto mass = MakeSkvGeometry(spectrum, 2, 2, 64, 512);
  EXPECT_EQ(mass.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(mass.status().message().find("'mass'"), std::string::npos) << mass.status().ToString();
}

// The drift tests' model: 3 layers, 2 KV heads of 64, 4 query heads each.
ModelConfig DriftTestModel() {
  ModelConfig model;
  model.num_layers = 3;
  model.num_query_heads = 8;
  model.num_kv_heads = 2;
  model.head_dim = 64;
  return model;
}

// select_drift: each (layer, KV head) of a sequence keeps its last selection's step (4 bytes)
// and its group's queries (fp32), counted in the fast tier; without an interval above 1 (or
// drift 0) there is nothing to keep. The rows are planned at interval 1 (the drift kernel
// decides), and each plan carries its token's position.
TEST(CudaShadowKvPlanTest, DriftKeepsEachHeadsLastSelectionInTheFastTier) {
  const ModelConfig model = DriftTestModel();
  kv::KvPolicyConfig config = testing::ParityConfig();
  config.select_interval = 4;
  auto interval = MakeSkvGeometryFor(config, model, 2, 512);
  ASSERT_TRUE(interval.ok()) << interval.status().ToString();
  EXPECT_FALSE(interval->drift());
  EXPECT_EQ(interval->DriftBytesPerSequence(), 0);
  config.select_drift = 0.9;
  auto drift = MakeSkvGeometryFor(config, model, 2, 512);
  ASSERT_TRUE(drift.ok()) << drift.status().ToString();
  EXPECT_TRUE(drift->drift());
  EXPECT_EQ(drift->group, 4);
  EXPECT_EQ(drift->DriftBytesPerSequence(), 3 * 2 * (4 * 64 * 4 + 4));
  EXPECT_EQ(drift->DeviceBytesPerSequence(),
            interval->DeviceBytesPerSequence() + drift->DriftBytesPerSequence());
  config.select_interval = 1;  // drift without an interval: every step selects anyway
  auto every_step = MakeSkvGeometryFor(config, model, 2, 512);
  ASSERT_TRUE(every_step.ok());
  EXPECT_FALSE(every_step->drift());
  const SkvSequenceInfo info{2, 8, 16, 80, 100};
  for (int64_t length = 100; length < 104; ++length) {
    const SkvRowMeta row = PlanSkvRow(0, length, 64, info, 8, 32, 1);
    EXPECT_EQ(row.reuse, 0);
    EXPECT_EQ(row.position, length);
  }
}

// Each sequence reselects at the threshold of its own budget (one pool serves prompts of many
// lengths): drift_small where its budget in whole chunks is below drift_small_below tokens,
// drift from there, as the CPU policy decides (kv::KvPolicyConfig::DriftForBudget).
TEST(CudaShadowKvPlanTest, EachSequenceDriftsAtItsOwnBudgetsThreshold) {
  const ModelConfig model = DriftTestModel();
  kv::KvPolicyConfig config = testing::ParityConfig();
  config.budget_tokens = 0;
  config.budget_fraction = 0.125;
  config.budget_min_tokens = 64;
  config.select_interval = 8;
  config.select_drift = 0.85;
  config.select_drift_small = 0.9;
  config.drift_small_below = 256;
  auto geometry = MakeSkvGeometryFor(config, model, 2, 4096);
  ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
  ASSERT_TRUE(geometry->drift());
  // Budgets of 125, 256 and 500 tokens: 15, 32 and 62 chunks of 8.
  const std::vector<std::pair<int64_t, float>> cases = {{1000, 0.9f}, {2048, 0.85f}, {4000, 0.85f}};
  for (const auto& [prompt, threshold] : cases) {
    auto plan = PlanSkvCompression(config, *geometry, prompt);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_FLOAT_EQ(plan->info.select_drift, threshold) << "prompt " << prompt;
    EXPECT_FLOAT_EQ(plan->info.select_drift,
                    static_cast<float>(config.DriftForBudget(plan->info.budget_chunks * 8)));
  }
  config.select_drift_small = 0.0;  // off: every sequence at drift
  auto plain = PlanSkvCompression(config, *geometry, 1000);
  ASSERT_TRUE(plain.ok());
  EXPECT_FLOAT_EQ(plain->info.select_drift, 0.85f);
}

// Exact keys: the store grows by one bf16 run of keys per chunk and head (FP8 codes and a scale
// with fp8_keys), placed after the values (after the FP8 scales too) on a 16-byte boundary; the
// fast tier does not change, and the pool counts the store where it sits.
TEST(CudaShadowKvPlanTest, ExactKeysFollowTheValuesInTheStore) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.budget_tokens = 64;
  kv::KvPolicyConfig exact = config;
  exact.exact_keys = 1;
  for (const int fp8 : {0, 1}) {
    config.fp8_values = exact.fp8_values = fp8;
    auto plain = MakeSkvGeometry(config, 2, 2, 64, 512);
    auto with_keys = MakeSkvGeometry(exact, 2, 2, 64, 512);
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    ASSERT_TRUE(with_keys.ok()) << with_keys.status().ToString();
    EXPECT_FALSE(plain->exact_keys);
    EXPECT_TRUE(with_keys->exact_keys);
    EXPECT_EQ(plain->KeyBytesPerSequence(), 0);
    EXPECT_EQ(plain->StoreBytesPerSequence(), plain->ValueBytesPerSequence());
    // 2 layers x 2 heads x 64 chunks of 8 tokens x 64 dims, bf16.
    const int64_t runs = 2 * 2 * 64, run_elements = 8 * 64;
    EXPECT_EQ(with_keys->KeyBytesPerSequence(), runs * run_elements * 2);
    EXPECT_EQ(with_keys->KeyStoreOffset(), runs * (fp8 ? run_elements + 4 : run_elements * 2));
    EXPECT_EQ(with_keys->KeyStoreOffset() % 16, 0);
    EXPECT_EQ(with_keys->StoreBytesPerSequence(),
              with_keys->KeyStoreOffset() + with_keys->KeyBytesPerSequence());
    EXPECT_EQ(with_keys->DeviceBytesPerSequence(), plain->DeviceBytesPerSequence());
    ModelConfig model;
    model.num_layers = 2;
    model.num_kv_heads = 2;
    model.head_dim = 64;
    // The re-rank reads such a store at every selection, so it stays in device memory whether
    // or not host stores are allowed; scored from the factors (rerank_rank), it may leave.
    auto on_device = LeastSequenceBytes(model, 512, &exact, /*host_values=*/false, {});
    auto on_host = LeastSequenceBytes(model, 512, &exact, /*host_values=*/true, {});
    ASSERT_TRUE(on_device.ok() && on_host.ok());
    EXPECT_EQ(*on_device, *on_host);
    kv::KvPolicyConfig factors = exact;
    factors.rank = 16;
    factors.rerank_rank = 16;
    auto factors_device = LeastSequenceBytes(model, 512, &factors, /*host_values=*/false, {});
    auto factors_host = LeastSequenceBytes(model, 512, &factors, /*host_values=*/true, {});
    ASSERT_TRUE(factors_device.ok() && factors_host.ok());
    EXPECT_EQ(*factors_device - *factors_host, with_keys->StoreBytesPerSequence());
  }
  // FP8 keys: a byte an element and a scale per run, after the values.
  exact.fp8_keys = 1;
  auto fp8_keys = MakeSkvGeometry(exact, 2, 2, 64, 512);
  ASSERT_TRUE(fp8_keys.ok()) << fp8_keys.status().ToString();
  EXPECT_TRUE(fp8_keys->fp8_keys);
  EXPECT_EQ(fp8_keys->KeyBytesPerSequence(), 2 * 2 * 64 * (8 * 64 + 4));
  EXPECT_EQ(fp8_keys->StoreBytesPerSequence(),
            fp8_keys->ValueBytesPerSequence() + fp8_keys->KeyBytesPerSequence());
  exact.fp8_keys = 0;
  exact.paper = 1;  // the paper's configuration rebuilds every key
  auto paper = MakeSkvGeometry(kv::WithPaperSettings(exact), 2, 2, 64, 512);
  ASSERT_TRUE(paper.ok()) << paper.status().ToString();
  EXPECT_FALSE(paper->exact_keys);
}

// A sliding-window model's geometry: its global layers laid out as a model of those layers
// alone, plus one ring of the window per windowed layer (capped at the capacity); each model
// layer's index in its part; a model whose every layer slides is refused, as on the CPU.
TEST(CudaShadowKvPlanTest, SlidingWindowModelsCompressTheGlobalLayersOnly) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.budget_tokens = 64;
  ModelConfig model;
  model.num_layers = 5;
  model.num_query_heads = 4;
  model.num_kv_heads = 2;
  model.head_dim = 64;
  model.sliding_window = 100;
  model.layer_windowed = {true, false, false, true, false};
  const SkvLayerParts parts = SkvLayerPartsOf(model);
  EXPECT_EQ(parts.index, (std::vector<int>{0, 0, 1, 1, 2}));
  EXPECT_EQ(parts.global, (std::vector<int>{1, 2, 4}));
  auto sliding = MakeSkvGeometryFor(config, model, 2, 512);
  ASSERT_TRUE(sliding.ok()) << sliding.status().ToString();
  auto global_only = MakeSkvGeometry(config, 3, 2, 64, 512);
  ASSERT_TRUE(global_only.ok());
  EXPECT_EQ(sliding->num_layers, 3);
  EXPECT_EQ(sliding->window_layers, 2);
  EXPECT_EQ(sliding->window_rows, 100);
  EXPECT_EQ(sliding->WindowBytesPerSequence(), int64_t{2} * 2 * 2 * 100 * 64 * 2);  // K, V bf16
  EXPECT_EQ(sliding->DeviceBytesPerSequence(),
            global_only->DeviceBytesPerSequence() + sliding->WindowBytesPerSequence());
  EXPECT_EQ(sliding->ValueBytesPerSequence(), global_only->ValueBytesPerSequence());
  auto short_capacity = MakeSkvGeometryFor(config, model, 2, 80);
  ASSERT_TRUE(short_capacity.ok());
  EXPECT_EQ(short_capacity->window_rows, 80);  // no token is ever older than the window there

  model.layer_windowed.assign(5, true);
  auto none = MakeSkvGeometryFor(config, model, 2, 512);
  EXPECT_EQ(none.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(none.status().message().find("has none (use 'full')"), std::string::npos)
      << none.status().message();
}

// Capacities round up to whole 16-chunk tiles of the tensor-core scoring, with bf16 landmarks as
// with FP8 ones, so the scoring never falls back to the CUDA-core kernel.
TEST(CudaShadowKvPlanTest, CapacityIsAWholeNumberOfScoringTiles) {
  kv::KvPolicyConfig config = testing::ParityConfig();
  for (const int fp8 : {0, 1}) {
    config.fp8_landmarks = fp8;
    auto odd = MakeSkvGeometry(config, 2, 2, 64, 400);  // 50 chunks
    ASSERT_TRUE(odd.ok()) << odd.status().ToString();
    EXPECT_EQ(odd->capacity_chunks, 64) << "fp8 landmarks " << fp8;
    EXPECT_EQ(odd->capacity_tokens, 400);
    auto whole = MakeSkvGeometry(config, 2, 2, 64, 512);  // 64 chunks
    ASSERT_TRUE(whole.ok());
    EXPECT_EQ(whole->capacity_chunks, 64);
  }
}

// The bench runs the budget a server gives a prompt of the bench's context, not a rounded one.
TEST(CudaShadowKvPlanTest, BenchBudgetIsTheServedBudget) {
  const kv::KvPolicyConfig defaults;
  EXPECT_EQ(ShadowKvBenchSettings(defaults, 124928).budget_tokens, 1952);  // 1.5625%
  EXPECT_EQ(ShadowKvBenchSettings(defaults, 32000).budget_tokens, 512);    // the floor
  auto accurate = kv::ParseKvVariant("shadowkv:accurate=1", defaults);
  ASSERT_TRUE(accurate.ok());
  EXPECT_EQ(ShadowKvBenchSettings(*accurate, 12000).budget_tokens, 1500);   // 12.5%
  EXPECT_EQ(ShadowKvBenchSettings(*accurate, 124928).budget_tokens, 2048);  // the ceiling
  for (const int64_t context : {4096, 20000, 32000, 124928}) {
    EXPECT_EQ(ShadowKvBenchSettings(*accurate, context).budget_tokens,
              accurate->BudgetTokens(context))
        << context;
  }
  kv::KvPolicyConfig absolute = defaults;
  absolute.policy = "quest";
  absolute.budget_tokens = 1000;
  const kv::KvPolicyConfig kept = ShadowKvBenchSettings(absolute, 124928);
  EXPECT_EQ(kept.budget_tokens, 1000);
  EXPECT_EQ(kept.policy, "shadowkv");
}

// The bench's batch order puts host-value sequences in both halves of a split step's rows and
// keeps every sequence exactly once.
TEST(CudaShadowKvPlanTest, HostValueRowsAreSpreadOverTheBatch) {
  EXPECT_EQ(SpreadHostRows({0, 1, 2, 3}, {}), (std::vector<int>{0, 1, 2, 3}));
  const std::vector<int> rows = SpreadHostRows(
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, {20, 21});
  ASSERT_EQ(rows.size(), 22u);
  EXPECT_EQ(rows[5], 20);   // (2·0 + 1)·22 / 4
  EXPECT_EQ(rows[16], 21);  // (2·1 + 1)·22 / 4: the other half (rows 11-21)
  std::vector<int> sorted = rows;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 22; ++i) EXPECT_EQ(sorted[i], i);
  // Host values for all but one sequence.
  EXPECT_EQ(SpreadHostRows({0}, {1, 2}), (std::vector<int>{1, 0, 2}));
}

}  // namespace
}  // namespace shadowkv::cuda
