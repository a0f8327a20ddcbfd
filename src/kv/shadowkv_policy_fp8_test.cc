// Tests of the ShadowKV policy's FP8 e4m3 values, landmarks and exact keys (core/fp8.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <set>

#include "core/fp8.h"
#include "kv/chunk_selection.h"
#include "support/shadowkv_test_util.h"

namespace shadowkv::kv {
namespace {

using namespace shadowkv_testing;

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
    int64_t quantised = 0;
    ForEachHeadAtFirstDecode(stream, config, [&](int layer, int h,
                                                 const std::vector<KvSegment>& segments,
                                                 const ShadowKvLayerInfo& info) {
      const KvSegment& gathered = segments[1];
      for (size_t slot = 0; slot < 8; ++slot) {
        auto values = ChunkRows(stream, layer, h, 8, info.gathered_chunks[h][slot], true);
        auto expected = values;
        if (fp8) RoundTripFp8Run(expected.data(), 8 * 64);
        for (int i = 0; i < 8 * 64; ++i) {
          ASSERT_EQ(gathered.values[slot * 8 * 64 + i], expected[i]) << "slot " << slot;
          quantised += expected[i] != values[i];
        }
      }
      const KvSegment& outliers = segments[0];
      for (size_t k = 0; k < 2; ++k) {
        auto values = ChunkRows(stream, layer, h, 8, info.outlier_chunks[h][k], true);
        for (int i = 0; i < 8 * 64; ++i) ASSERT_EQ(outliers.values[k * 8 * 64 + i], values[i]);
      }
      const KvSegment& window = segments[2];
      ASSERT_EQ(window.num_tokens, info.exact_tokens);
      for (int t = 0; t < window.num_tokens; ++t) {
        const auto exact = stream.Make(layer, info.exact_first_position + t).values;
        for (int i = 0; i < 64; ++i) {
          ASSERT_EQ(window.values[t * window.row_stride + i], exact[h * 64 + i]);
        }
      }
    });
    ASSERT_FALSE(HasFatalFailure());
    if (fp8) {
      EXPECT_GT(quantised, 2 * 3 * 8 * 8 * 64 / 2);  // most values changed by the rounding
    } else {
      EXPECT_EQ(quantised, 0);
    }
  }
}

TEST(ShadowKvTest, Fp8KeysGatherTheDequantisedExactKeys) {
  // exact_keys with fp8_keys: the gathered chunks' keys are exactly the chunk's landmark plus the
  // codec's dequantised run of the stream's post-RoPE keys less that landmark (one scale per
  // chunk and KV head) at rank 16 of 128, the values stay exact; the key store takes a byte an
  // element plus a scale per run.
  const KvGeometry g = TestGeometry();
  TokenStream stream(g, 0, 5);
  KvPolicyConfig config = ShadowConfig(8, 32, 2, 16);
  config.budget_tokens = 64;
  config.exact_keys = 1;
  config.fp8_keys = 1;
  int64_t quantised = 0;
  ForEachHeadAtFirstDecode(stream, config, [&](int layer, int h,
                                               const std::vector<KvSegment>& segments,
                                               const ShadowKvLayerInfo& info) {
    const KvSegment& gathered = segments[1];
    for (size_t slot = 0; slot < 8; ++slot) {
      const int32_t chunk = info.gathered_chunks[h][slot];
      auto keys = ChunkRows(stream, layer, h, 8, chunk, false);
      std::vector<float> landmark(64);
      ComputeLandmarks(keys.data(), 64, 1, 8, 64, landmark.data());
      auto expected = keys;
      for (int i = 0; i < 8 * 64; ++i) expected[i] -= landmark[i % 64];
      RoundTripFp8Run(expected.data(), 8 * 64);
      for (int i = 0; i < 8 * 64; ++i) expected[i] += landmark[i % 64];
      const auto values = ChunkRows(stream, layer, h, 8, chunk, true);
      for (int i = 0; i < 8 * 64; ++i) {
        ASSERT_EQ(gathered.keys[slot * 8 * 64 + i], expected[i]) << "slot " << slot;
        ASSERT_EQ(gathered.values[slot * 8 * 64 + i], values[i]) << "slot " << slot;
        quantised += expected[i] != keys[i];
      }
    }
  });
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_GT(quantised, 2 * 3 * 8 * 8 * 64 / 2);  // most keys changed by the rounding

  // Memory: fp32 values plus FP8 keys, against fp32 values plus fp32 keys.
  KvPolicyConfig fp32_keys = config;
  fp32_keys.fp8_keys = 0;
  auto with_fp8 = MakePolicy(config, g), with_fp32 = MakePolicy(fp32_keys, g);
  const int64_t runs_fp8 = with_fp8->EstimateMemory(300).slow_bytes;
  const int64_t runs_fp32 = with_fp32->EstimateMemory(300).slow_bytes;
  // Per run: 8 x 64 fp32 values + 8 x 64 keys, as bytes + a scale or as fp32.
  EXPECT_EQ(runs_fp8 * (2 * 8 * 64 * 4), runs_fp32 * (8 * 64 * 4 + 8 * 64 + 4));
  config.exact_keys = 0;  // FP8 keys of no key store
  const auto refused = MakeKvPolicy(config, g);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("exact_keys"), std::string::npos)
      << refused.status().ToString();
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
  // Every element is within the bound (checked above); the bound is also tight: the worst error
  // takes a good part of it (0.23 here), so the values were read as e4m3, not at a finer precision
  // (bf16's rounding, 2^-8 of a value, would use about 1/70 of it, fp16's about 1/560).
  EXPECT_GT(worst_ratio, 1.0 / 16);
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
