// GPU next-token choice: argmax against the CPU Argmax (ties, NaN); temperature, top-k and top-p
// draws against the CPU Sampler's candidate sets and the truncated softmax they must follow;
// per-row settings in one launch; noise that depends on (seed, draw, id) only; and the same
// through CudaModel's Forward and DecodeStep (graph-replayed) on a tiny model.
#include "ops/cuda/sampling/sampling.cuh"

#include <set>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu_test_util.h"
#include "kv/kv_config.h"
#include "sampling_test_util.h"
#include "shadowkv_test_util.h"
#include "support/sampling_stats.h"
#include "tiny_model.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;
using shadowkv::testing::ChiSquare;
using shadowkv::testing::ChiSquareBound;
using shadowkv::testing::TruncatedSoftmax;

// One launch over `rows` rows of `vocab` logits, row r with controls[r].
std::vector<int32_t> RunSampling(const std::vector<float>& logits, int rows, int vocab,
                                 const std::vector<SamplingControl>& controls) {
  EXPECT_EQ(controls.size(), static_cast<size_t>(rows));
  auto device_logits = ToDevice(logits);
  auto device_controls = ToDevice(controls);
  auto tokens = ToDevice(std::vector<int32_t>(rows, -1));
  SamplingParams p;
  p.logits = device_logits.get();
  p.controls = device_controls.get();
  p.tokens = tokens.get();
  p.rows = rows;
  p.vocab = vocab;
  EXPECT_EQ(LaunchSampling(p, nullptr), cudaSuccess);
  return ToHost(tokens);
}

std::vector<int32_t> RunSampling(const std::vector<float>& logits, int rows, int vocab,
                                 const SamplingControl& control) {
  return RunSampling(logits, rows, vocab, std::vector<SamplingControl>(rows, control));
}

SamplingControl Control(float temperature, int top_k, float top_p, uint64_t seed, uint64_t draw) {
  SamplingControl c;
  c.temperature = temperature;
  c.top_k = top_k;
  c.top_p = top_p;
  c.seed = seed;
  c.draw = draw;
  return c;
}

shadowkv::SamplingParams CpuParams(const SamplingControl& c) {
  return shadowkv::SamplingParams{c.temperature, c.top_k, c.top_p, c.seed};
}

std::vector<float> Row(const std::vector<float>& logits, int row, int vocab) {
  return std::vector<float>(logits.begin() + static_cast<int64_t>(row) * vocab,
                            logits.begin() + static_cast<int64_t>(row + 1) * vocab);
}

// `rows` copies of `row`.
std::vector<float> Repeated(const std::vector<float>& row, int rows) {
  std::vector<float> all;
  all.reserve(row.size() * rows);
  for (int r = 0; r < rows; ++r) all.insert(all.end(), row.begin(), row.end());
  return all;
}

TEST(CudaSamplingTest, GreedyMatchesCpuArgmax) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const int rows = 6, vocab = 128256;
  std::vector<float> logits = RandomFloats(static_cast<int64_t>(rows) * vocab, rng, 4.0f);
  // Row 1: a tie between ids 9000 and 70000 (lowest id wins); row 2: NaNs are never chosen;
  // row 3: the maximum in the last element.
  logits[vocab + 9000] = logits[vocab + 70000] = 100.0f;
  for (int v = 0; v < vocab; v += 3) logits[2 * vocab + v] = NAN;
  logits[2 * vocab + 4] = 50.0f;
  logits[3 * vocab + vocab - 1] = 1000.0f;
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, SamplingControl{});
  for (int r = 0; r < rows; ++r) {
    if (r == 2) {
      EXPECT_EQ(got[r], 4);  // std::max_element is not defined with NaNs: checked by hand
      continue;
    }
    EXPECT_EQ(got[r], Argmax(Row(logits, r, vocab))) << "row " << r;
  }
  // Greedy ignores the cuts (the argmax survives any of them).
  EXPECT_EQ(RunSampling(logits, rows, vocab, Control(0.0f, 5, 0.3f, 1, 2)), got);
}

TEST(CudaSamplingTest, TemperatureDrawsFromTheSoftmax) {
  SKV_SKIP_WITHOUT_GPU();
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.0f, -3.0f, 0.0f};
  const int vocab = static_cast<int>(row.size()), rows = 40000;
  const float temperature = 1.5f;
  const std::vector<float> logits = Repeated(row, rows);
  // Each row one draw of its own (draw = row), all with one seed.
  std::vector<SamplingControl> controls(rows);
  for (int r = 0; r < rows; ++r) controls[r] = Control(temperature, 0, 1.0f, 1234, r);
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, controls);
  std::vector<double> counts(vocab, 0.0);
  for (int32_t token : got) {
    ASSERT_GE(token, 0);
    ASSERT_LT(token, vocab);
    counts[token] += 1.0;
  }
  std::vector<int32_t> all(vocab);
  for (int v = 0; v < vocab; ++v) all[v] = v;
  int df = 0;
  const double chi = ChiSquare(counts, TruncatedSoftmax(row, all, temperature), &df);
  EXPECT_LT(chi, ChiSquareBound(df));
  // The same (seed, draw): the same ids; other draws: different ones.
  EXPECT_EQ(RunSampling(logits, rows, vocab, controls), got);
  for (SamplingControl& c : controls) c.draw += rows;
  EXPECT_NE(RunSampling(logits, rows, vocab, controls), got);
}

// The noise of a draw depends on (seed, draw, id) only: the same setting in another row of
// another launch, next to other rows, chooses the same id.
TEST(CudaSamplingTest, SameSeedAndDrawInAnotherRowGivesTheSameId) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(8);
  const int vocab = 50000, rows = 16;
  const std::vector<float> row = RandomFloats(vocab, rng, 2.0f);
  const std::vector<float> logits = Repeated(row, rows);
  std::vector<SamplingControl> controls(rows);
  for (int r = 0; r < rows; ++r) {
    controls[r] = Control(1.0f, r % 3 == 0 ? 50 : 0, r % 2 == 0 ? 0.9f : 1.0f, 77 + r, 5 * r);
  }
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, controls);
  for (int r = 0; r < rows; ++r) {
    // Alone, and in the last row of a launch whose other rows are greedy.
    std::vector<SamplingControl> moved(rows, SamplingControl{});
    moved[rows - 1 - r] = controls[r];
    EXPECT_EQ(RunSampling(row, 1, vocab, controls[r])[0], got[r]) << "row " << r;
    EXPECT_EQ(RunSampling(logits, rows, vocab, moved)[rows - 1 - r], got[r]) << "row " << r;
  }
  // The CPU Sampler draws with the same noise: the same ids but where fp32 logs round apart
  // (rare; not all of them may differ).
  int agree = 0;
  for (int r = 0; r < rows; ++r) {
    agree += SampleAt(row, CpuParams(controls[r]), controls[r].draw) == got[r];
  }
  EXPECT_GE(agree, rows - 2);
}

// Rows with different settings side by side in one launch: each gets its own choice.
TEST(CudaSamplingTest, MixedSettingsInOneLaunch) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  const int vocab = 32000, rows = 8;
  const std::vector<float> logits = RandomFloats(static_cast<int64_t>(rows) * vocab, rng, 3.0f);
  const std::vector<SamplingControl> controls = {
      Control(0.0f, 0, 1.0f, 0, 0), Control(1.0f, 1, 1.0f, 3, 1),  Control(0.7f, 20, 1.0f, 4, 2),
      Control(1.0f, 0, 0.5f, 5, 3), Control(1.2f, 40, 0.8f, 6, 4), Control(0.0f, 3, 0.2f, 7, 5),
      Control(2.0f, 0, 1.0f, 8, 6), Control(1.0f, 0, 1e-6f, 9, 7)};
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, controls);
  for (int r = 0; r < rows; ++r) {
    const std::vector<float> row = Row(logits, r, vocab);
    const SamplingControl& c = controls[r];
    if (c.temperature == 0.0f || c.top_k == 1 || c.top_p < 1e-3f) {
      EXPECT_EQ(got[r], Argmax(row)) << "row " << r << " is greedy";
      continue;
    }
    const std::vector<int32_t> candidates = SamplingCandidates(row, CpuParams(c));
    EXPECT_TRUE(std::find(candidates.begin(), candidates.end(), got[r]) != candidates.end())
        << "row " << r << " chose " << got[r] << ", outside its " << candidates.size()
        << " candidates";
    // Each row alone: the same choice.
    EXPECT_EQ(RunSampling(row, 1, vocab, c)[0], got[r]) << "row " << r;
  }
}

TEST(CudaSamplingTest, TopKOneIsGreedy) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  const int vocab = 152064, rows = 32;
  const std::vector<float> logits = RandomFloats(static_cast<int64_t>(rows) * vocab, rng, 2.0f);
  std::vector<SamplingControl> controls(rows);
  for (int r = 0; r < rows; ++r) controls[r] = Control(0.5f + r, 1, r % 2 ? 1.0f : 0.9f, r, r);
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, controls);
  for (int r = 0; r < rows; ++r) EXPECT_EQ(got[r], Argmax(Row(logits, r, vocab))) << "row " << r;
}

// Top-k and top-p over many rows of the same random logits, each row one draw: every id is one of
// the CPU Sampler's candidates, and the ids follow the softmax renormalised over them.
void CheckTruncatedDraws(int top_k, float top_p, float temperature, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int vocab = 4096, rows = 30000;
  const std::vector<float> row = RandomFloats(vocab, rng, 1.0f);
  const std::vector<float> logits = Repeated(row, rows);
  std::vector<SamplingControl> controls(rows);
  for (int r = 0; r < rows; ++r) controls[r] = Control(temperature, top_k, top_p, seed, 1000 + r);
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, controls);
  const std::vector<int32_t> candidates = SamplingCandidates(row, CpuParams(controls[0]));
  ASSERT_GT(candidates.size(), 1u);
  const std::set<int32_t> allowed(candidates.begin(), candidates.end());
  std::vector<double> counts(vocab, 0.0);
  std::set<int32_t> seen;
  for (int r = 0; r < rows; ++r) {
    ASSERT_TRUE(allowed.count(got[r])) << "row " << r << " chose " << got[r] << ", outside the "
                                       << candidates.size() << " candidates";
    counts[got[r]] += 1.0;
    seen.insert(got[r]);
  }
  const std::vector<double> want = TruncatedSoftmax(row, candidates, temperature);
  int df = 0;
  const double chi = ChiSquare(counts, want, &df);
  EXPECT_LT(chi, ChiSquareBound(df))
      << candidates.size() << " candidates, " << seen.size() << " seen";
}

TEST(CudaSamplingTest, TopKDrawsFromTheKLargestOnly) {
  SKV_SKIP_WITHOUT_GPU();
  CheckTruncatedDraws(10, 1.0f, 1.0f, 21);
  CheckTruncatedDraws(25, 1.0f, 0.5f, 22);
}

TEST(CudaSamplingTest, TopPDrawsFromTheNucleusOnly) {
  SKV_SKIP_WITHOUT_GPU();
  // At T = 0.25 the nucleus of 4096 normal logits is a few dozen ids.
  CheckTruncatedDraws(0, 0.5f, 0.25f, 31);
  CheckTruncatedDraws(0, 0.9f, 0.2f, 32);
}

TEST(CudaSamplingTest, TopPWithinTheTopK) {
  SKV_SKIP_WITHOUT_GPU();
  CheckTruncatedDraws(20, 0.7f, 0.5f, 41);
}

// Ties at the cut and NaN logits: ids tied with the one at the cut may all be kept, NaNs never.
TEST(CudaSamplingTest, TiesAtTheCutAndNaNs) {
  SKV_SKIP_WITHOUT_GPU();
  const int vocab = 1000, rows = 2000;
  std::vector<float> row(vocab, -5.0f);
  for (int v = 0; v < vocab; v += 2) row[v] = NAN;
  row[101] = 2.0f;
  row[303] = 1.0f;
  row[505] = 1.0f;  // tied with 303 at the cut of top_k = 2
  const std::vector<float> logits = Repeated(row, rows);
  std::vector<SamplingControl> controls(rows);
  for (int r = 0; r < rows; ++r) controls[r] = Control(1.0f, 2, 1.0f, 3, r);
  std::set<int32_t> seen;
  for (int32_t id : RunSampling(logits, rows, vocab, controls)) seen.insert(id);
  EXPECT_EQ(seen, (std::set<int32_t>{101, 303, 505}));
  // top_k larger than the non-NaN logits: every one of them may come, no NaN.
  for (int r = 0; r < rows; ++r) controls[r] = Control(50.0f, 900, 1.0f, 3, r);
  for (int32_t id : RunSampling(logits, rows, vocab, controls)) {
    ASSERT_EQ(id % 2, 1) << "a NaN logit was chosen";
  }
}

using shadowkv::testing::SmallSpec;
using shadowkv::testing::SomeTokens;
using shadowkv::testing::WriteTinyModel;

CudaModelOptions Options(int max_batch, int max_step_tokens) {
  CudaModelOptions options;
  options.max_batch = max_batch;
  options.max_step_tokens = max_step_tokens;
  return options;
}

std::unique_ptr<CudaModel> TinyModel(const std::string& tag) {
  const std::string path =
      WriteTinyModel(SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32, true, 13), tag);
  auto model = CudaModel::Load(path, Options(4, 256));
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return nullptr;
  EXPECT_TRUE((*model)->AllocateKvCache(4, 256).ok());
  return std::move(model).value();
}

// One Forward prefilling four prompts with sampling on some inputs and logits on others, then
// decode steps (graph-replayed) whose rows change settings from step to step.
TEST(CudaModelSamplingTest, PerRowSettingsThroughForwardAndDecodeStep) {
  SKV_SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaModel> model = TinyModel("gpu_sampling_rows");
  ASSERT_TRUE(model);
  const int vocab = static_cast<int>(model->config().vocab_size);
  const CudaSampling greedy{}, hot{2.0f, 0, 1.0f, 5}, cut{1.0f, 8, 0.9f, 6}, one{50.0f, 1, 1.0f, 7};
  DrawChecker checker;

  // Slots 2 and 3 hold the same prompt with the same setting: the same id, though only slot 2
  // copies its logits (slot 3's logit row comes after the copied ones).
  const std::vector<std::vector<int32_t>> prompts = {SomeTokens(20, 31), SomeTokens(9, 32),
                                                     SomeTokens(30, 33), SomeTokens(30, 33)};
  std::vector<std::vector<float>> logits(4, std::vector<float>(vocab, NAN));
  std::vector<int32_t> first(4, -1);
  std::vector<CudaStepInput> inputs(4);
  const CudaSampling* prefill_settings[4] = {&greedy, nullptr, &hot, &hot};
  for (int i = 0; i < 4; ++i) {
    inputs[i].slot = i;
    inputs[i].tokens = prompts[i];
    inputs[i].logits_out = i == 3 ? nullptr : logits[i].data();
    inputs[i].sample = prefill_settings[i];
    inputs[i].token_out = prefill_settings[i] ? &first[i] : nullptr;
  }
  const Status prefilled = model->Forward(inputs);
  ASSERT_TRUE(prefilled.ok()) << prefilled.ToString();
  EXPECT_EQ(first[1], -1);  // no sample asked for: untouched
  for (float v : logits[1]) ASSERT_TRUE(std::isfinite(v));
  checker.Check(first[0], logits[0], greedy, "prefill, greedy");
  checker.Check(first[2], logits[2], hot, "prefill, temperature 2");
  EXPECT_EQ(first[3], first[2]) << "the same logits, seed and draw in another row";
  first[1] = Argmax(logits[1]);

  // Decode: each row's setting moves to the next row at every step (the graph captured at the
  // first step reads the new ones), and the draws count up.
  const std::vector<CudaSampling> settings = {greedy, one, hot, cut};
  const std::vector<int> slots = {0, 1, 2, 3};
  std::vector<int32_t> tokens = first;
  for (int step = 0; step < 6; ++step) {
    std::vector<CudaSampling> rows(4);
    for (int r = 0; r < 4; ++r) {
      rows[r] = settings[(r + step) % 4];
      rows[r].draw = step + 1;
    }
    std::vector<float> got(4 * static_cast<size_t>(vocab));
    const Status stepped = model->DecodeStep(slots, tokens, rows, got.data());
    ASSERT_TRUE(stepped.ok()) << stepped.ToString();
    for (int r = 0; r < 4; ++r) {
      const std::vector<float> row(got.begin() + r * vocab, got.begin() + (r + 1) * vocab);
      checker.Check(tokens[r], row, rows[r], fmt::format("decode step {} row {}", step, r));
    }
  }
  EXPECT_EQ(model->slot_length(0), 26);

  // A decode row through Forward, sampled, next to a prefill chunk: as DecodeStep would draw.
  std::vector<float> row_logits(vocab);
  int32_t drawn = -1;
  const std::vector<int32_t> next = {tokens[2]}, more = SomeTokens(12, 34);
  CudaSampling later = cut;
  later.draw = 7;
  const std::vector<CudaStepInput> mixed = {{2, next, row_logits.data(), &later, &drawn},
                                            {1, more, nullptr, nullptr, nullptr}};
  ASSERT_TRUE(model->Forward(mixed).ok());
  checker.Check(drawn, row_logits, later, "decode row in Forward");
}

// The overload with one setting for every row gives each row noise of its own; one setting per
// row with the same seed and draw gives rows of the same sequence the same id.
TEST(CudaModelSamplingTest, OneSettingForEveryRowDrawsEachRowApart) {
  SKV_SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaModel> model = TinyModel("gpu_sampling_same");
  ASSERT_TRUE(model);
  const std::vector<int32_t> prompt = SomeTokens(25, 41);
  ASSERT_TRUE(model->Forward(std::vector<CudaStepInput>{{0, prompt, nullptr}}).ok());
  for (int to = 1; to < 4; ++to) ASSERT_TRUE(model->CopySlot(0, to).ok());
  const std::vector<int> slots = {0, 1, 2, 3};
  const CudaSampling flat{30.0f, 0, 1.0f, 3};  // near-uniform over the vocabulary
  int steps_all_alike = 0;
  std::vector<int32_t> tokens(4, prompt.back());
  for (int step = 0; step < 3; ++step) {
    // Every row the same token in: after the step the four slots still hold one sequence.
    std::fill(tokens.begin(), tokens.end(), SomeTokens(1, 50 + step)[0]);
    ASSERT_TRUE(model->DecodeStep(slots, tokens, flat).ok());
    steps_all_alike += std::count(tokens.begin(), tokens.end(), tokens[0]) == 4;
  }
  EXPECT_EQ(steps_all_alike, 0) << "rows drew with the same noise";
  for (int step = 0; step < 3; ++step) {
    std::fill(tokens.begin(), tokens.end(), SomeTokens(1, 60 + step)[0]);
    CudaSampling same = flat;
    same.draw = 100 + step;
    ASSERT_TRUE(model->DecodeStep(slots, tokens, std::vector<CudaSampling>(4, same)).ok());
    EXPECT_EQ(std::count(tokens.begin(), tokens.end(), tokens[0]), 4) << "step " << step;
  }
}

// ShadowKvDecodeStep with one setting per row, the rows trading settings between (graph-replayed)
// steps, and refusing a bad one.
TEST(CudaModelSamplingTest, PerRowSettingsThroughShadowKvDecodeStep) {
  SKV_SKIP_WITHOUT_GPU();
  const std::string path = WriteTinyModel(
      SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32, true, 14), "gpu_sampling_skv");
  auto loaded = CudaModel::Load(path, Options(4, 512));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  CudaModel& model = **loaded;
  const kv::KvPolicyConfig config = ParityConfig();
  ASSERT_TRUE(model.AllocateKvCache(2, 512, /*keep_pre_rope_keys=*/true).ok());
  ASSERT_TRUE(model.AllocateShadowKv(config, 2, 512).ok());
  const std::vector<std::vector<int32_t>> prompts = {SomeTokens(300, 43), SomeTokens(237, 44)};
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(model.AllocateShadowKvValues(s, false).ok());
    ASSERT_TRUE(model.Forward(std::vector<CudaStepInput>{{s, prompts[s], nullptr}}).ok());
    const Status compressed = model.CompressToShadowKv(s, s);
    ASSERT_TRUE(compressed.ok()) << compressed.ToString();
  }
  model.FreeKvCache();
  const int vocab = static_cast<int>(model.config().vocab_size);
  const std::vector<int> seqs = {0, 1};
  const std::vector<CudaSampling> settings = {CudaSampling{}, CudaSampling{1.5f, 12, 0.95f, 8}};
  std::vector<int32_t> tokens = {prompts[0].back(), prompts[1].back()};
  DrawChecker checker;
  for (int step = 0; step < 6; ++step) {
    std::vector<CudaSampling> rows = {settings[step % 2], settings[(step + 1) % 2]};
    for (CudaSampling& row : rows) row.draw = step;
    std::vector<float> got(2 * static_cast<size_t>(vocab));
    const Status stepped = model.ShadowKvDecodeStep(seqs, tokens, rows, got.data());
    ASSERT_TRUE(stepped.ok()) << stepped.ToString();
    for (int r = 0; r < 2; ++r) {
      const std::vector<float> row(got.begin() + r * vocab, got.begin() + (r + 1) * vocab);
      checker.Check(tokens[r], row, rows[r], fmt::format("ShadowKV step {} row {}", step, r));
    }
  }
  const std::vector<CudaSampling> bad = {CudaSampling{}, CudaSampling{1.0f, 0, 2.0f}};
  const Status refused = model.ShadowKvDecodeStep(seqs, tokens, bad);
  EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("row 1"), std::string::npos) << refused.ToString();
  EXPECT_EQ(model.shadowkv_length(0), 306);
}

TEST(CudaModelSamplingTest, BadSettingsAreRefusedNamingTheRow) {
  SKV_SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaModel> model = TinyModel("gpu_sampling_bad");
  ASSERT_TRUE(model);
  const std::vector<int32_t> prompt = SomeTokens(10, 42);
  ASSERT_TRUE(
      model->Forward(std::vector<CudaStepInput>{{0, prompt, nullptr}, {1, prompt, nullptr}}).ok());
  const std::vector<int> slots = {0, 1};
  std::vector<int32_t> tokens = {1, 2};
  Status status = model->DecodeStep(slots, tokens, std::vector<CudaSampling>(1));
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.ToString();
  for (CudaSampling bad :
       {CudaSampling{-1.0f}, CudaSampling{NAN}, CudaSampling{INFINITY}, CudaSampling{1.0f, -2},
        CudaSampling{1.0f, 0, 0.0f}, CudaSampling{1.0f, 0, 1.5f}, CudaSampling{1.0f, 0, NAN}}) {
    std::vector<CudaSampling> rows(2);
    rows[1] = bad;
    status = model->DecodeStep(slots, tokens, rows);
    EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("row 1"), std::string::npos) << status.ToString();
    // Forward: the same check, naming the slot.
    int32_t out = -1;
    const std::vector<int32_t> one_token = {3};
    status = model->Forward(std::vector<CudaStepInput>{{1, one_token, nullptr, &bad, &out}});
    EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("slot 1"), std::string::npos) << status.ToString();
    EXPECT_EQ(out, -1);
  }
  // A sample with nowhere to put the token.
  const CudaSampling fine{};
  const std::vector<int32_t> one_token = {3};
  status = model->Forward(std::vector<CudaStepInput>{{0, one_token, nullptr, &fine, nullptr}});
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.ToString();
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 2}));  // refused steps change nothing
  EXPECT_EQ(model->slot_length(0), 10);
  EXPECT_EQ(model->slot_length(1), 10);
  // And the model still steps.
  ASSERT_TRUE(model->DecodeStep(slots, tokens, std::vector<CudaSampling>(2)).ok());
  EXPECT_EQ(model->slot_length(1), 11);
}

}  // namespace
}  // namespace shadowkv::cuda
