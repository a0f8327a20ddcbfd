// Tiny random-weight models of each family against transformers (scripts/goldens/
// tiny_family_goldens.py): logits at sampled positions, top-1 at every position, 32 greedy
// tokens through the decode path; and the KV policies on each family's layers (on gemma3 the
// sparse ones take the global layers while the windowed layers keep their window).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/sampler.h"
#include "kv/kv_config.h"
#include "kv/policies.h"
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

void RunEveryPolicy(const std::string& family, size_t steps = 8);

// qwen3, phi3, glm4 and chatglm have no windowed layer: every policy serves them (qwen3's with
// the normed pre-RoPE keys, phi3's rotated with the LongRoPE factors, glm4's and chatglm's half
// rotated).
TEST(FamilyPolicyTest, EveryPolicyRunsOnTheFamiliesWithoutWindows) {
  for (const std::string family : {"qwen3", "phi3", "glm4", "chatglm"}) {
    SCOPED_TRACE(family);
    RunEveryPolicy(family);
  }
}

void RunEveryPolicy(const std::string& family, size_t steps) {
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
               std::span<const float>(logits.data() + (tokens.size() - 1) * vocab, vocab), steps);
    ASSERT_TRUE(generated.ok()) << name << ": " << generated.status().ToString();
    EXPECT_EQ(generated->size(), steps) << name;
    for (int32_t id : *generated) EXPECT_TRUE(id >= 0 && id < vocab) << name;
  }
}

// Every policy serves gemma3: the windowed layers keep their window, the global layer takes the
// named policy; 32 greedy tokens with each, at its default settings.
TEST(FamilyPolicyTest, EveryPolicyRunsOnGemma3) { RunEveryPolicy("gemma3", 32); }

// Logits of the prompt's last token and of 32 greedy steps after it ([33, vocab]), and the tokens.
struct Decoded {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
};

Decoded PrefillAndDecode(CpuModel& model, kv::SequenceKv* kv, const std::vector<int32_t>& prompt) {
  Decoded out;
  const int64_t vocab = model.config().vocab_size;
  std::vector<float> logits;
  const Status prefilled = Prefill(model, kv, prompt, 16, &logits);
  EXPECT_TRUE(prefilled.ok()) << prefilled.ToString();
  if (!prefilled.ok()) return out;
  out.logits.assign(logits.end() - vocab, logits.end());
  int32_t next = Argmax(std::span<const float>(out.logits));
  std::vector<float> step(vocab);
  for (int i = 0; i < 32; ++i) {
    out.tokens.push_back(next);
    StepInput in;
    in.kv = kv;
    in.tokens = std::span<const int32_t>(&next, 1);
    in.logits_out = step.data();
    const Status stepped = model.Forward(std::span<const StepInput>(&in, 1));
    EXPECT_TRUE(stepped.ok()) << stepped.ToString();
    if (!stepped.ok()) return out;
    out.logits.insert(out.logits.end(), step.begin(), step.end());
    next = Argmax(step);
  }
  return out;
}

// A budget that covers the whole prompt and every generated token leaves nothing out: each
// policy's logits are full attention's (ShadowKV at full rank rebuilds its keys exactly, up to
// float rounding). The reference keeps every token of every layer (no window trimming).
TEST(FamilyPolicyTest, Gemma3SparsePoliciesWithAWholeBudgetMatchFullAttention) {
  std::unique_ptr<CpuModel> model = LoadTiny("gemma3");
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> tokens = ReadGolden("gemma3").json["tokens"];
  const kv::KvGeometry geometry = model->kv_geometry();
  auto every_token = kv::MakeFullPolicy(kv::KvPolicyConfig{}, geometry);
  ASSERT_TRUE(every_token.ok());
  auto reference_kv = (*every_token)->NewSequence();
  ASSERT_TRUE(reference_kv.ok());
  const Decoded reference = PrefillAndDecode(*model, reference_kv->get(), tokens);
  ASSERT_EQ(reference.tokens.size(), 32u);
  const int64_t vocab = model->config().vocab_size;
  for (const std::string& name : kv::KnownKvPolicies()) {
    SCOPED_TRACE(name);
    kv::KvPolicyConfig config;
    config.policy = name;
    config.budget_tokens = 128;         // more than the 72 tokens a sequence reaches
    config.rank = geometry.kv_width();  // shadowkv: the whole key width
    auto policy = kv::MakeKvPolicy(config, geometry);
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    auto kv = (*policy)->NewSequence();
    ASSERT_TRUE(kv.ok());
    const Decoded decoded = PrefillAndDecode(*model, kv->get(), tokens);
    ASSERT_EQ(decoded.logits.size(), reference.logits.size());
    double max_rel = 0;
    for (size_t row = 0; row < decoded.logits.size() / vocab; ++row) {
      double row_abs = 0, range = 0;
      for (int64_t i = 0; i < vocab; ++i) {
        const double ref = reference.logits[row * vocab + i];
        row_abs = std::max(row_abs, std::abs(decoded.logits[row * vocab + i] - ref));
        range = std::max(range, std::abs(ref));
      }
      max_rel = std::max(max_rel, row_abs / range);
    }
    std::printf("[gemma3, %s, whole budget] max relative logit error %.2e over 33 rows\n",
                name.c_str(), max_rel);
    EXPECT_LT(max_rel, 1e-4);
    EXPECT_EQ(decoded.tokens, reference.tokens);
  }
}

// Watches what each layer is given: copies every appended block's post-RoPE keys and values, and
// checks each prepared input of a windowed layer against them: every query sees exactly the
// positions of its window, each row the key and value appended at that position. Counts the
// global layers' decode steps that read fewer rows than their layer holds.
class WatchingSequence final : public kv::ForwardingSequenceKv {
 public:
  WatchingSequence(std::unique_ptr<kv::SequenceKv> inner, const ModelConfig& config)
      : ForwardingSequenceKv(std::move(inner)),
        config_(config),
        width_(config.num_kv_heads * config.head_dim),
        keys_(config.num_layers),
        values_(config.num_layers) {}

  Status Append(int layer, const kv::TokenBlock& block) override {
    const size_t count = static_cast<size_t>(block.num_tokens) * width_;
    keys_[layer].insert(keys_[layer].end(), block.keys, block.keys + count);
    values_[layer].insert(values_[layer].end(), block.values, block.values + count);
    first_query_ = block.first_position;
    return inner_->Append(layer, block);
  }

  Status Prepare(int layer, const float* queries, int num_queries,
                 kv::AttentionInput* out) override {
    SKV_RETURN_IF_ERROR(inner_->Prepare(layer, queries, num_queries, out));
    const int64_t held = static_cast<int64_t>(keys_[layer].size()) / width_;
    if (!config_.IsWindowed(layer)) {
      if (num_queries == 1) {
        global_decode_steps++;
        global_sparse_steps += out->num_tokens(0) < held;
      }
      return Status::Ok();
    }
    const int d = config_.head_dim;
    for (int64_t p = first_query_; p < first_query_ + num_queries; ++p) {
      for (int h = 0; h < config_.num_kv_heads; ++h) {
        std::vector<int64_t> seen;
        for (const KvSegment& s : out->heads[h]) {
          EXPECT_TRUE(s.causal) << "layer " << layer;
          for (int t = 0; t < s.num_tokens; ++t) {
            const int64_t at = s.first_position + t;
            if (at > p || at <= p - config_.sliding_window) continue;
            seen.push_back(at);
            const float* key = s.keys + static_cast<int64_t>(t) * s.row_stride;
            const float* value = s.values + static_cast<int64_t>(t) * s.row_stride;
            const size_t expected = static_cast<size_t>(at) * width_ + h * d;
            EXPECT_TRUE(std::equal(key, key + d, keys_[layer].begin() + expected) &&
                        std::equal(value, value + d, values_[layer].begin() + expected))
                << "layer " << layer << " position " << at;
          }
        }
        std::sort(seen.begin(), seen.end());
        std::vector<int64_t> window;
        for (int64_t t = std::max<int64_t>(0, p - config_.sliding_window + 1); t <= p; ++t) {
          window.push_back(t);
        }
        EXPECT_EQ(seen, window) << "layer " << layer << " query " << p << " head " << h;
        windowed_queries_checked++;
      }
    }
    return Status::Ok();
  }

  int64_t global_decode_steps = 0;
  int64_t global_sparse_steps = 0;
  int64_t windowed_queries_checked = 0;

 private:
  const ModelConfig& config_;
  int64_t width_;
  std::vector<std::vector<float>> keys_;    // [layer][token * kv_width]
  std::vector<std::vector<float>> values_;  // [layer][token * kv_width]
  int64_t first_query_ = 0;
};

// With a budget far under the prompt, the windowed layers (0, 1, 3) still attend exactly their
// window of 8 at every query, and the global layer (2) is the one that reads a subset.
TEST(FamilyPolicyTest, Gemma3WindowedLayersKeepTheirWindowUnderASmallBudget) {
  std::unique_ptr<CpuModel> model = LoadTiny("gemma3");
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  ASSERT_EQ(c.layer_windowed, (std::vector<bool>{true, true, false, true}));
  ASSERT_EQ(c.sliding_window, 8);
  const std::vector<int32_t> tokens = ReadGolden("gemma3").json["tokens"];
  for (const std::string& name : kv::KnownKvPolicies()) {
    SCOPED_TRACE(name);
    kv::KvPolicyConfig config;
    config.policy = name;
    config.budget_tokens = 16;
    config.local_window = 8;  // shadowkv: chunks to compress in a 40-token prompt
    config.snap_window = 8;
    auto policy = kv::MakeKvPolicy(config, model->kv_geometry());
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    auto inner = (*policy)->NewSequence();
    ASSERT_TRUE(inner.ok());
    WatchingSequence kv(std::move(*inner), c);
    const Decoded decoded = PrefillAndDecode(*model, &kv, tokens);
    ASSERT_EQ(decoded.tokens.size(), 32u);
    // 3 windowed layers, 2 KV heads, every prompt and generated token as a query.
    EXPECT_EQ(kv.windowed_queries_checked, 3 * 2 * (40 + 32));
    EXPECT_EQ(kv.global_decode_steps, 32);
    EXPECT_EQ(kv.global_sparse_steps, name == "full" ? 0 : 32);
  }
}

// A model whose every layer slides (the tiny mistral) has no global layer for a sparse policy to
// serve: refused when the policy is made, saying why; full attention serves it.
TEST(FamilyPolicyTest, SparsePoliciesAreRefusedWhereEveryLayerSlides) {
  std::unique_ptr<CpuModel> model = LoadTiny("mistral");
  ASSERT_NE(model, nullptr);
  const kv::KvGeometry geometry = model->kv_geometry();
  ASSERT_EQ(geometry.layer_windowed, std::vector<bool>(geometry.num_layers, true));
  for (const std::string& name : kv::KnownKvPolicies()) {
    kv::KvPolicyConfig config;
    config.policy = name;
    auto policy = kv::MakeKvPolicy(config, geometry);
    if (name == "full") {
      EXPECT_TRUE(policy.ok()) << policy.status().ToString();
      continue;
    }
    ASSERT_FALSE(policy.ok()) << "mistral accepted " << name;
    EXPECT_EQ(policy.status().code(), ErrorCode::kUnsupported);
    const std::string& message = policy.status().message();
    EXPECT_NE(message.find("sliding window of 8 tokens"), std::string::npos) << message;
    EXPECT_NE(message.find("'" + name + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("this model has none"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace shadowkv
