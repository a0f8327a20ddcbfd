// Tests of KvPolicyConfig: budget arithmetic and policy variants parsed from text.
#include "kv/kv_config.h"

#include <gtest/gtest.h>

namespace shadowkv::kv {
namespace {

TEST(KvConfigTest, BudgetIsAbsoluteOrFractionWithFloorAndCeiling) {
  KvPolicyConfig config;
  EXPECT_EQ(config.BudgetTokens(131072), 2048);  // 1/64 of the context
  EXPECT_EQ(config.BudgetTokens(4096), 512);     // the floor
  config.budget_max_tokens = 1024;
  EXPECT_EQ(config.BudgetTokens(131072), 1024);  // the ceiling
  EXPECT_EQ(config.BudgetTokens(49152), 768);    // below it: the fraction
  EXPECT_EQ(config.BudgetTokens(4096), 512);
  config.budget_tokens = 300;  // an absolute budget overrides both
  EXPECT_EQ(config.BudgetTokens(131072), 300);
}

TEST(KvConfigTest, PlainNameKeepsBaseSettingsAndHasNoLabel) {
  KvPolicyConfig base;
  base.rank = 48;
  auto config = ParseKvVariant("snapkv", base);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->policy, "snapkv");
  EXPECT_EQ(config->rank, 48);
  EXPECT_EQ(config->display_name(), "snapkv");
}

TEST(KvConfigTest, VariantOverridesNamedSettingsOnly) {
  KvPolicyConfig base;
  base.local_window = 40;
  auto config = ParseKvVariant("shadowkv:rank=64:budget=512:rank_ratio=0.5:snap_pooling=avg", base);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->policy, "shadowkv");
  EXPECT_EQ(config->rank, 64);
  EXPECT_EQ(config->budget_tokens, 512);
  EXPECT_DOUBLE_EQ(config->rank_ratio, 0.5);
  EXPECT_EQ(config->snap_pooling, "avg");
  EXPECT_EQ(config->local_window, 40);
  EXPECT_EQ(config->display_name(), "shadowkv:rank=64:budget=512:rank_ratio=0.5:snap_pooling=avg");
  EXPECT_EQ(config->select_successors, 0);
  auto groups = ParseKvVariant("shadowkv:basis_groups=2", base);
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  EXPECT_EQ(groups->basis_groups, 2);
  EXPECT_EQ(config->basis_groups, 1);
  auto successors = ParseKvVariant("shadowkv:successors=1", base);
  ASSERT_TRUE(successors.ok()) << successors.status().ToString();
  EXPECT_EQ(successors->select_successors, 1);
  auto interval = ParseKvVariant("shadowkv:interval=4", base);
  ASSERT_TRUE(interval.ok()) << interval.status().ToString();
  EXPECT_EQ(interval->select_interval, 4);
  EXPECT_EQ(config->select_interval, 1);
  EXPECT_FALSE(ParseKvVariant("shadowkv:interval=0", base).ok());
  auto fp8 = ParseKvVariant("shadowkv:fp8_values=1:fp8_landmarks=1", base);
  ASSERT_TRUE(fp8.ok()) << fp8.status().ToString();
  EXPECT_EQ(fp8->fp8_values, 1);
  EXPECT_EQ(fp8->fp8_landmarks, 1);
  EXPECT_EQ(config->fp8_values, 0);
  auto modes = ParseKvVariant(
      "shadowkv:rank_energy=0.95:rank_min=16:rank_max=96:select=rerank:rerank_factor=3:"
      "rerank_rank=24:mass=0.8:rerank_min=100",
      base);
  ASSERT_TRUE(modes.ok()) << modes.status().ToString();
  EXPECT_DOUBLE_EQ(modes->rank_energy, 0.95);
  EXPECT_EQ(modes->rank_min, 16);
  EXPECT_EQ(modes->rank_max, 96);
  EXPECT_EQ(modes->selection, "rerank");
  EXPECT_EQ(modes->rerank_factor, 3);
  EXPECT_EQ(modes->rerank_rank, 24);
  EXPECT_EQ(modes->rerank_min_tokens, 100);
  EXPECT_EQ(modes->RerankCandidates(10, 8), 30);  // the factor's 30 above the floor's 13
  EXPECT_EQ(modes->RerankCandidates(4, 8), 13);   // ceil(100 / 8)
  EXPECT_FALSE(modes->RerankReadsStore());  // no exact keys
  // With exact keys the re-rank reads the store unless a rank scores from the factors.
  auto exact = ParseKvVariant("shadowkv:exact_keys=1", base);
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_TRUE(exact->RerankReadsStore());
  auto exact_factors = ParseKvVariant("shadowkv:accurate=1:rank=48:rerank_rank=48", base);
  ASSERT_TRUE(exact_factors.ok()) << exact_factors.status().ToString();
  EXPECT_EQ(exact_factors->exact_keys, 1);
  EXPECT_EQ(exact_factors->rerank_rank, 48);
  EXPECT_FALSE(exact_factors->RerankReadsStore());
  auto huge = ParseKvVariant("shadowkv:rerank_min=9223372036854775807", base);
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  EXPECT_EQ(huge->RerankFloorChunks(8), 1152921504606846976);  // ceil, without overflow
  EXPECT_EQ(config->rerank_min_tokens, 0);
  EXPECT_DOUBLE_EQ(modes->select_mass, 0.8);
  EXPECT_EQ(config->selection, base.selection);
  EXPECT_DOUBLE_EQ(config->rank_energy, 0.0);
}

// The rank floor: rank_min, or half a KV head's width where heads are wide, rounded up to 8.
TEST(KvConfigTest, RankFloorTakesTheWiderOfItsTwoRules) {
  KvPolicyConfig c;                   // rank_min 48, rank_head_ratio 0.5
  EXPECT_EQ(RankFloor(c, 64), 48);    // Qwen2.5-0.5B, SmolLM2: rank_min
  EXPECT_EQ(RankFloor(c, 128), 64);   // GLM-4-9B's two KV heads of 128
  EXPECT_EQ(RankFloor(c, 256), 128);  // Gemma 3's one KV head of 256
  c.rank_head_ratio = 0.3;
  EXPECT_EQ(RankFloor(c, 256), 80);  // 76.8 rounded up to 8
  c.rank_min = 0;
  c.rank_head_ratio = 0.0;
  EXPECT_EQ(RankFloor(c, 256), 0);
  auto parsed = ParseKvVariant("shadowkv:rank_head_ratio=0.25", KvPolicyConfig{});
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_DOUBLE_EQ(parsed->rank_head_ratio, 0.25);
  EXPECT_EQ(RankFloor(*parsed, 256), 64);
}

TEST(KvConfigTest, PaperForcesThePublishedSettings) {
  // Base settings far from the method's: paper=1 puts every one of them back.
  KvPolicyConfig base;
  base.rank = 64;
  base.rank_energy = 0.9;
  base.rank_head_ratio = 0.75;
  base.selection = "mass";
  base.budget_tokens = 1024;
  base.budget_fraction = 0.1;
  base.budget_min_tokens = 64;
  base.budget_max_tokens = 512;
  base.outlier_chunks = 3;
  base.chunk_size = 4;
  base.local_window = 8;
  base.select_successors = 1;
  base.exact_layers = 2;
  base.fp8_values = 1;
  base.basis_groups = 2;
  base.select_interval = 8;
  base.select_drift = 0.8;
  base.select_drift_small = 0.9;
  base.drift_small_below = 4096;
  auto paper = ParseKvVariant("shadowkv:paper=1", base);
  ASSERT_TRUE(paper.ok()) << paper.status().ToString();
  EXPECT_EQ(paper->paper, 1);
  EXPECT_EQ(paper->rank, 0);
  EXPECT_DOUBLE_EQ(paper->rank_ratio, 1 / 6.4);
  EXPECT_DOUBLE_EQ(paper->rank_energy, 0.0);
  EXPECT_EQ(paper->rank_min, 0);
  EXPECT_DOUBLE_EQ(paper->rank_head_ratio, 0.0);
  EXPECT_EQ(paper->selection, "landmarks");
  EXPECT_EQ(paper->budget_tokens, 0);
  EXPECT_DOUBLE_EQ(paper->budget_fraction, 0.015625);
  EXPECT_EQ(paper->budget_min_tokens, 256);
  EXPECT_EQ(paper->budget_max_tokens, 0);
  EXPECT_EQ(paper->outlier_chunks, -1);
  EXPECT_EQ(paper->chunk_size, 8);
  EXPECT_EQ(paper->local_window, 32);
  EXPECT_EQ(paper->select_successors, 0);
  EXPECT_EQ(paper->exact_layers, 0);
  EXPECT_EQ(paper->fp8_values, 0);
  EXPECT_EQ(paper->select_interval, 1);
  EXPECT_DOUBLE_EQ(paper->select_drift, 0.0);
  EXPECT_DOUBLE_EQ(paper->select_drift_small, 0.0);
  EXPECT_EQ(paper->drift_small_below, 0);
  // The sampled share (which does not go with successors, so on a base of its own).
  KvPolicyConfig sampling;
  sampling.policy = "shadowkv";
  sampling.select_sample = 0.25;
  auto unsampled = ParseKvVariant("shadowkv:paper=1", sampling);
  ASSERT_TRUE(unsampled.ok()) << unsampled.status().ToString();
  EXPECT_DOUBLE_EQ(unsampled->select_sample, 0.0);
  EXPECT_EQ(paper->basis_groups, 2);  // a deployment setting, kept
  EXPECT_EQ(paper->label, "shadowkv:paper=1");
  // The same through WithPaperSettings; paper=0 changes nothing.
  KvPolicyConfig in_code = base;
  in_code.paper = 1;
  EXPECT_EQ(WithPaperSettings(in_code).selection, "landmarks");
  EXPECT_EQ(WithPaperSettings(base).selection, "mass");
  auto off = ParseKvVariant("shadowkv:paper=0:rank=32", base);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->rank, 32);
}

TEST(KvConfigTest, AccurateNamesTheMeasuredSettingAndNamedKeysOverrideIt) {
  const KvPolicyConfig base;
  auto accurate = ParseKvVariant("shadowkv:accurate=1", base);
  ASSERT_TRUE(accurate.ok()) << accurate.status().message();
  EXPECT_EQ(accurate->exact_keys, 1);
  EXPECT_EQ(accurate->rank, 8);
  EXPECT_DOUBLE_EQ(accurate->budget_fraction, 0.125);
  EXPECT_EQ(accurate->budget_tokens, 0);
  EXPECT_EQ(accurate->select_interval, 8);
  EXPECT_DOUBLE_EQ(accurate->select_drift, 0.85);
  // Budgets under 3,072 tokens (contexts under about 24K) reselect at 0.9.
  EXPECT_DOUBLE_EQ(accurate->select_drift_small, 0.9);
  EXPECT_EQ(accurate->drift_small_below, 3072);
  EXPECT_DOUBLE_EQ(accurate->DriftForBudget(2024), 0.9);  // 16K: 2,029 tokens, 253 chunks
  EXPECT_DOUBLE_EQ(accurate->DriftForBudget(768), 0.9);
  EXPECT_DOUBLE_EQ(accurate->DriftForBudget(2048), 0.9);  // the ceiling: 16K and longer
  EXPECT_DOUBLE_EQ(accurate->DriftForBudget(3072), 0.85);  // with budget_max raised
  EXPECT_DOUBLE_EQ(accurate->DriftForBudget(4096), 0.85);
  EXPECT_TRUE(accurate->ReselectsOnDrift());
  EXPECT_DOUBLE_EQ(accurate->select_sample, 0.25);  // a quarter of the budget drawn
  EXPECT_EQ(accurate->selection, base.selection);  // the re-ranked selection, untouched
  EXPECT_EQ(accurate->label, "shadowkv:accurate=1");
  EXPECT_EQ(accurate->BudgetTokens(4096), 768);  // its own floor
  EXPECT_EQ(accurate->BudgetTokens(2048), 768);
  EXPECT_EQ(accurate->BudgetTokens(12288), 1536);
  EXPECT_EQ(accurate->BudgetTokens(16384), 2048);   // 12.5% meets the ceiling
  EXPECT_EQ(accurate->BudgetTokens(32768), 2048);
  EXPECT_EQ(accurate->BudgetTokens(124928), 2048);
  // Candidates: three per kept chunk, at least 1,024 chunks (8,192 tokens of chunk 8): at the
  // ceiling the floor, four per kept chunk.
  EXPECT_EQ(accurate->rerank_factor, 3);
  EXPECT_EQ(accurate->RerankCandidates(2048 / 8, 8), 1024);
  EXPECT_EQ(accurate->RerankCandidates(4096 / 8, 8), 1536);
  EXPECT_EQ(accurate->RerankCandidates(768 / 8, 8), 1024);
  EXPECT_EQ(accurate->RerankCandidates(8192 / 8, 8), 3072);  // within the re-rank's 4,096

  // A key named beside it keeps its value, before or after it.
  for (const char* text : {"shadowkv:drift=0.9:accurate=1", "shadowkv:accurate=1:drift=0.9"}) {
    auto named = ParseKvVariant(text, base);
    ASSERT_TRUE(named.ok()) << text;
    EXPECT_DOUBLE_EQ(named->select_drift, 0.9) << text;
    EXPECT_EQ(named->select_interval, 8) << text;
    EXPECT_EQ(named->exact_keys, 1) << text;
  }
  auto absolute = ParseKvVariant("shadowkv:accurate=1:budget=1024", base);
  ASSERT_TRUE(absolute.ok());
  EXPECT_EQ(absolute->BudgetTokens(32768), 1024);
  // fp8_keys needs exact keys, which the setting gives.
  auto fp8 = ParseKvVariant("shadowkv:fp8_keys=1:accurate=1", base);
  ASSERT_TRUE(fp8.ok()) << fp8.status().message();
  EXPECT_EQ(fp8->fp8_keys, 1);
  auto off = ParseKvVariant("shadowkv:accurate=0:rank=32", base);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->exact_keys, 0);
  EXPECT_EQ(off->rank, 32);
  EXPECT_FALSE(off->ReselectsOnDrift());
}

TEST(KvConfigTest, DriftReselectsOnlyWithAnIntervalToShorten) {
  KvPolicyConfig config;
  EXPECT_FALSE(config.ReselectsOnDrift());
  config.select_drift = 0.9;
  EXPECT_FALSE(config.ReselectsOnDrift()) << "interval 1 selects at every step anyway";
  config.select_interval = 2;
  EXPECT_TRUE(config.ReselectsOnDrift());
  config.select_drift = 0.0;
  EXPECT_FALSE(config.ReselectsOnDrift());
}

TEST(KvConfigTest, BadVariantsAreErrorsNamingTheProblem) {
  const KvPolicyConfig base;
  struct Case {
    const char* text;
    const char* mentions;
  };
  for (const Case& c :
       {Case{"shadowkv:colour=red", "unknown setting 'colour'"},
        Case{"shadowkv:rank", "not KEY=VALUE"},
        Case{"shadowkv:rank=12x", "12x"},
        Case{"shadowkv:budget=", "budget"},
        Case{"shadowkv:chunk=0", "chunk size 0"},
        Case{"shadowkv:fp8_values=2", "fp8_values must be 0 or 1"},
        Case{"shadowkv:fp8_landmarks=-1", "fp8_landmarks must be 0 or 1"},
        Case{"shadowkv:rank_energy=1.5", "rank energy 1.5"},
        Case{"shadowkv:rank_min=64:rank_max=32", "rank floor 64"},
        Case{"shadowkv:rank_min=-8", "must not be negative"},
        Case{"shadowkv:rank_head_ratio=1.5", "rank head ratio 1.5"},
        Case{"shadowkv:paper=1:rank_head_ratio=0.25", "paper=1 fixes 'rank_head_ratio'"},
        Case{"shadowkv:select=oracle", "chunk selection 'oracle'"},
        Case{"shadowkv:rerank_factor=0", "rerank factor 0"},
        Case{"shadowkv:rerank_min=-8", "rerank floor -8 is negative"},
        Case{"shadowkv:budget_max=-1", "budget ceiling -1 is negative"},
        Case{"shadowkv:budget_min=1024:budget_max=512",
             "budget ceiling 512 is below the budget floor 1024"},
        Case{"shadowkv:accurate=1:budget_max=512", "below the budget floor 768"},
        // The ceiling the user did not write is named as the setting's.
        Case{"shadowkv:accurate=1:budget_min=10000", "accurate=1 sets "},
        Case{"shadowkv:accurate=1:budget_min=10000", "budget_max=2048"},
        Case{"shadowkv:paper=1:budget_max=4096", "paper=1 fixes 'budget_max'"},
        Case{"shadowkv:rerank_rank=20", "rerank rank 20 is not a multiple of 8"},
        Case{"shadowkv:mass=0", "selection mass 0"},
        Case{"shadowkv:paper=2", "paper must be 0 or 1"},
        Case{"shadowkv:paper=1:rank=64", "paper=1 fixes 'rank'"},
        Case{"shadowkv:paper=1:interval=2", "paper=1 fixes 'interval'"},
        Case{"shadowkv:select=heads:paper=1", "paper=1 fixes 'select'"},
        Case{"shadowkv:accurate=2", "accurate must be 0 or 1"},
        Case{"shadowkv:accurate=1:paper=1", "not one with paper=1"},
        Case{"quest:accurate=1", "accurate=1 is a ShadowKV setting"},
        Case{"shadowkv:accurate=1:drift=1.5", "select drift 1.5"},
        Case{"shadowkv:drift=0.9:drift_small=1.5", "small-budget drift 1.5"},
        Case{"shadowkv:drift=0.9:drift_small=0.95:drift_small_below=-1", "bound -1 is negative"},
        Case{"shadowkv:drift_small=0.95:drift_small_below=4096", "needs drift on"},
        Case{"shadowkv:paper=1:drift_small_below=4096", "paper=1 fixes 'drift_small_below'"},
        Case{"shadowkv:sample=1", "sampled share 1 of the budget is not in [0, 1)"},
        Case{"shadowkv:sample=-0.1", "sampled share -0.1"},
        Case{"shadowkv:sample=0.25:select=mass", "sample applies to select=landmarks or rerank"},
        Case{"shadowkv:sample=0.25:successors=1", "sample does not apply with successors"},
        Case{"shadowkv:paper=1:sample=0.25", "paper=1 fixes 'sample'"},
        Case{"nonsense:rank=8", "unknown KV policy 'nonsense'"}}) {
    auto config = ParseKvVariant(c.text, base);
    ASSERT_FALSE(config.ok()) << c.text;
    EXPECT_EQ(config.status().code(), ErrorCode::kInvalidArgument) << c.text;
    EXPECT_NE(config.status().message().find(c.mentions), std::string::npos)
        << c.text << ": " << config.status().message();
  }
}

TEST(KvConfigTest, SampledChunksTakeTheShareAndLeaveOneRanked) {
  auto config = ParseKvVariant("shadowkv:sample=0.25", KvPolicyConfig{});
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_DOUBLE_EQ(config->select_sample, 0.25);
  EXPECT_EQ(config->SampledChunks(96), 24);
  EXPECT_EQ(config->SampledChunks(10), 3);  // 2.5 rounds up
  EXPECT_EQ(config->SampledChunks(2), 1);   // 0.5 rounds up, one chunk stays ranked
  EXPECT_EQ(config->SampledChunks(1), 0);
  config->select_sample = 0.9;
  EXPECT_EQ(config->SampledChunks(4), 3);  // 3.6 rounds to 4; one stays ranked
  config->select_sample = 0.0;
  EXPECT_EQ(config->SampledChunks(96), 0);
}

}  // namespace
}  // namespace shadowkv::kv
