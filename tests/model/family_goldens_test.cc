// Tiny random-weight models of each family against transformers (scripts/goldens/
// tiny_family_goldens.py): logits at sampled positions, top-1 at every position, 32 greedy
// tokens through the decode path; and which KV policies each family's layers can take.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/sampler.h"
#include "kv/kv_config.h"
#include "model/cpu_model.h"
#include "model_path.h"

namespace shadowkv {
namespace {

constexpr double kMaxRelativeError = 1e-3;  // as the exact-vs-transformers goldens

struct Golden {
  nlohmann::json json;
  std::vector<float> rows;  // [positions, vocab]
};

Golden ReadGolden(const std::string& family) {
  Golden golden;
  std::ifstream in(testing::DataPath("goldens/tiny_" + family + ".json"));
  golden.json = nlohmann::json::parse(in);
  const size_t count =
      golden.json["full_logits"]["positions"].size() * golden.json["num_vocab"].get<size_t>();
  golden.rows.resize(count);
  std::ifstream f32(
      testing::DataPath("goldens/" + golden.json["full_logits"]["file"].get<std::string>()),
      std::ios::binary);
  f32.read(reinterpret_cast<char*>(golden.rows.data()), static_cast<std::streamsize>(count * 4));
  EXPECT_TRUE(f32.good()) << "short golden logits for " << family;
  return golden;
}

std::unique_ptr<CpuModel> LoadTiny(const std::string& family) {
  auto model =
      CpuModel::Load(testing::DataPath("goldens/tiny_" + family + ".gguf"), 2, Numerics::kExact);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? std::move(*model) : nullptr;
}

// Prefills `tokens` in chunks of `chunk` (every position's logits into `logits`).
Status Prefill(CpuModel& model, kv::SequenceKv* kv, const std::vector<int32_t>& tokens,
               size_t chunk, std::vector<float>* logits) {
  const int64_t vocab = model.config().vocab_size;
  logits->assign(tokens.size() * vocab, 0.0f);
  for (size_t done = 0; done < tokens.size(); done += chunk) {
    StepInput in;
    in.kv = kv;
    in.tokens =
        std::span<const int32_t>(tokens.data() + done, std::min(chunk, tokens.size() - done));
    in.finish_prefill = done + chunk >= tokens.size();
    in.logits = StepInput::Logits::kAll;
    in.logits_out = logits->data() + done * vocab;
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
  }
  return Status::Ok();
}

// Greedy decoding of `count` tokens after `last_logits`, one token per step.
Result<std::vector<int32_t>> Greedy(CpuModel& model, kv::SequenceKv* kv,
                                    std::span<const float> last_logits, size_t count) {
  std::vector<int32_t> generated;
  std::vector<float> step(model.config().vocab_size);
  int32_t next = Argmax(last_logits);
  while (generated.size() < count) {
    generated.push_back(next);
    StepInput in;
    in.kv = kv;
    in.tokens = std::span<const int32_t>(&next, 1);
    in.logits_out = step.data();
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
    next = Argmax(step);
  }
  return generated;
}

class FamilyGoldenTest : public ::testing::TestWithParam<std::tuple<std::string, size_t>> {};

TEST_P(FamilyGoldenTest, MatchesTransformers) {
  const auto& [family, chunk] = GetParam();
  const Golden golden = ReadGolden(family);
  std::unique_ptr<CpuModel> model = LoadTiny(family);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->config().architecture, golden.json["architecture"].get<std::string>());
  const int64_t vocab = golden.json["num_vocab"];
  ASSERT_EQ(vocab, model->config().vocab_size);
  const std::vector<int32_t> tokens = golden.json["tokens"];

  auto policy = kv::MakeKvPolicy(kv::KvPolicyConfig{}, model->kv_geometry());
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  auto kv = (*policy)->NewSequence();
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  std::vector<float> logits;
  const Status prefilled = Prefill(*model, kv->get(), tokens, chunk, &logits);
  ASSERT_TRUE(prefilled.ok()) << prefilled.ToString();

  const std::vector<int> positions = golden.json["full_logits"]["positions"];
  double max_abs = 0, max_rel = 0;
  for (size_t p = 0; p < positions.size(); ++p) {
    double row_abs = 0, range = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double ref = golden.rows[p * vocab + i];
      row_abs = std::max(row_abs, std::abs(logits[positions[p] * vocab + i] - ref));
      range = std::max(range, std::abs(ref));
    }
    max_abs = std::max(max_abs, row_abs);
    max_rel = std::max(max_rel, row_abs / range);
  }
  const std::vector<int32_t> top_ids = golden.json["prompt_top_ids"];
  int agree = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    agree += Argmax(std::span<const float>(logits.data() + t * vocab, vocab)) == top_ids[t];
  }
  std::printf("[%s, chunks of %zu] max |logit error| %.2e, relative %.2e, top-1 %d of %zu\n",
              family.c_str(), chunk, max_abs, max_rel, agree, tokens.size());
  EXPECT_LT(max_rel, kMaxRelativeError);
  EXPECT_EQ(agree, static_cast<int>(tokens.size()));

  const std::vector<int32_t> expected = golden.json["continuation"]["tokens"];
  auto generated = Greedy(
      *model, kv->get(), std::span<const float>(logits.data() + (tokens.size() - 1) * vocab, vocab),
      expected.size());
  ASSERT_TRUE(generated.ok()) << generated.status().ToString();
  EXPECT_EQ(*generated, expected);
}

// Whole prompt in one chunk, and chunks smaller than gemma3's and mistral's window of 8 and
// larger than it (the window then spans chunk boundaries).
INSTANTIATE_TEST_SUITE_P(Families, FamilyGoldenTest,
                         ::testing::Combine(::testing::Values("qwen3", "gemma3", "mistral", "phi3",
                                                              "glm4", "chatglm"),
                                            ::testing::Values(size_t{64}, size_t{5}, size_t{13})),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_chunk" +
                                  std::to_string(std::get<1>(info.param));
                         });

void RunEveryPolicy(const std::string& family);

// qwen3, phi3, glm4 and chatglm have no windowed layer: every policy serves them (qwen3's with
// the normed pre-RoPE keys, phi3's rotated with the LongRoPE factors, glm4's and chatglm's half
// rotated).
TEST(FamilyPolicyTest, EveryPolicyRunsOnTheFamiliesWithoutWindows) {
  for (const std::string family : {"qwen3", "phi3", "glm4", "chatglm"}) {
    SCOPED_TRACE(family);
    RunEveryPolicy(family);
  }
}

void RunEveryPolicy(const std::string& family) {
  std::unique_ptr<CpuModel> model = LoadTiny(family);
  ASSERT_NE(model, nullptr);
  const Golden golden = ReadGolden(family);
  const std::vector<int32_t> tokens = golden.json["tokens"];
  for (const std::string& name : kv::KnownKvPolicies()) {
    kv::KvPolicyConfig config;
    config.policy = name;
    auto policy = kv::MakeKvPolicy(config, model->kv_geometry());
    ASSERT_TRUE(policy.ok()) << name << ": " << policy.status().ToString();
    auto kv = (*policy)->NewSequence();
    ASSERT_TRUE(kv.ok()) << name << ": " << kv.status().ToString();
    std::vector<float> logits;
    const Status prefilled = Prefill(*model, kv->get(), tokens, 16, &logits);
    ASSERT_TRUE(prefilled.ok()) << name << ": " << prefilled.ToString();
    const int64_t vocab = model->config().vocab_size;
    auto generated =
        Greedy(*model, kv->get(),
               std::span<const float>(logits.data() + (tokens.size() - 1) * vocab, vocab), 8);
    ASSERT_TRUE(generated.ok()) << name << ": " << generated.status().ToString();
    for (int32_t id : *generated) EXPECT_TRUE(id >= 0 && id < vocab) << name;
  }
}

// Sliding-window layers are served by the full policy only; the sparse ones are refused saying
// why (the refusal comes when the policy is made, before any sequence exists).
TEST(FamilyPolicyTest, SparsePoliciesAreRefusedOnSlidingWindowModels) {
  for (const std::string family : {"gemma3", "mistral"}) {
    std::unique_ptr<CpuModel> model = LoadTiny(family);
    ASSERT_NE(model, nullptr);
    ASSERT_FALSE(model->kv_geometry().layer_windowed.empty()) << family;
    for (const std::string& name : kv::KnownKvPolicies()) {
      kv::KvPolicyConfig config;
      config.policy = name;
      auto policy = kv::MakeKvPolicy(config, model->kv_geometry());
      if (name == "full") {
        EXPECT_TRUE(policy.ok()) << family << ": " << policy.status().ToString();
        continue;
      }
      ASSERT_FALSE(policy.ok()) << family << " accepted " << name;
      EXPECT_EQ(policy.status().code(), ErrorCode::kUnsupported);
      EXPECT_NE(policy.status().message().find("sliding window of 8 tokens"), std::string::npos)
          << policy.status().message();
      EXPECT_NE(policy.status().message().find("'" + name + "'"), std::string::npos)
          << policy.status().message();
    }
  }
}

}  // namespace
}  // namespace shadowkv
