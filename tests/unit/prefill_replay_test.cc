// Shared prefill for the eval: replaying a recorded full-attention prefill into a fresh sequence
// must decode exactly what that policy's own prefill decodes (tiny random model).
#include <gtest/gtest.h>

#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/prefill_record.h"
#include "eval/runner.h"
#include "model/cpu_model.h"
#include "tiny_model.h"

namespace shadowkv {
namespace {

using eval::GreedyStream;

constexpr int kDecodeTokens = 24;
constexpr int kChunk = 96;  // prefill chunk of both paths: several chunks per prompt

std::vector<int32_t> MakePrompt(int tokens) {
  std::vector<int32_t> prompt;
  uint32_t x = 12345;
  for (int i = 0; i < tokens; ++i) {
    x = x * 1664525u + 1013904223u;
    prompt.push_back(static_cast<int32_t>(32 + (x >> 16) % 90));  // printable bytes
  }
  return prompt;
}

// The normal path: chunked prefill under `policy`, then greedy decoding.
std::vector<int32_t> DecodeNormally(CpuModel& model, const kv::KvPolicy& policy,
                                    const std::vector<int32_t>& prompt) {
  auto sequence = policy.NewSequence().value();
  std::vector<float> logits(model.config().vocab_size);
  const int64_t size = static_cast<int64_t>(prompt.size());
  for (int64_t done = 0; done < size; done += kChunk) {
    StepInput in;
    in.kv = sequence.get();
    in.tokens =
        std::span<const int32_t>(prompt).subspan(done, std::min<int64_t>(kChunk, size - done));
    in.finish_prefill = done + kChunk >= size;
    in.logits = in.finish_prefill ? StepInput::Logits::kLast : StepInput::Logits::kNone;
    in.logits_out = logits.data();
    EXPECT_TRUE(model.Forward(std::span<const StepInput>(&in, 1)).ok());
  }
  GreedyStream stream;
  stream.kv = sequence.get();
  stream.remaining = kDecodeTokens;
  eval::PushToken(stream, Argmax(logits), model.tokenizer());
  GreedyStream* streams[] = {&stream};
  EXPECT_TRUE(eval::RunGreedy(model, streams).ok());
  return stream.generated;
}

// The eval's path: one recorded prefill replayed into a fresh sequence of `policy`.
std::vector<int32_t> DecodeReplayed(CpuModel& model, const kv::KvPolicy& policy,
                                    const eval::PrefillRecord& record) {
  auto sequence = policy.NewSequence().value();
  EXPECT_TRUE(eval::ReplayPrefill(record, *sequence).ok());
  EXPECT_EQ(sequence->num_tokens(), record.num_tokens);
  GreedyStream stream;
  stream.kv = sequence.get();
  stream.remaining = kDecodeTokens;
  eval::PushToken(stream, Argmax(record.last_logits), model.tokenizer());
  GreedyStream* streams[] = {&stream};
  EXPECT_TRUE(eval::RunGreedy(model, streams).ok());
  return stream.generated;
}

// `name` with a budget the 400-token prompt exceeds, and small windows.
kv::KvPolicyConfig SmallBudget(const std::string& name) {
  kv::KvPolicyConfig config;
  config.policy = name;
  config.budget_tokens = 64;
  config.outlier_chunks = 2;
  config.local_window = 16;
  config.snap_window = 16;
  config.quest_dense_layers = 1;
  return config;
}

class PrefillReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::TinyModelSpec spec;
    spec.layers = 3;
    spec.context = 1024;
    spec.seed = 7;
    model_ = CpuModel::Load(testing::WriteTinyModel(spec, "replay"), 1).value();
    prompt_ = MakePrompt(400);
    record_ = eval::RecordPrefill(*model_, prompt_, kChunk).value();
  }
  std::unique_ptr<CpuModel> model_;
  std::vector<int32_t> prompt_;
  eval::PrefillRecord record_;
};

TEST_F(PrefillReplayTest, RecordHoldsEveryLayerAndToken) {
  const auto& c = model_->config();
  ASSERT_EQ(record_.keys.size(), static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    EXPECT_EQ(record_.keys_pre_rope[l].size(), 400u * c.num_kv_heads * c.head_dim);
    EXPECT_EQ(record_.keys[l].size(), 400u * c.num_kv_heads * c.head_dim);
    EXPECT_EQ(record_.values[l].size(), 400u * c.num_kv_heads * c.head_dim);
    EXPECT_EQ(record_.queries[l].size(), 400u * c.num_query_heads * c.head_dim);
  }
  // Position 0 is not rotated: pre- and post-RoPE keys agree there, and differ later.
  const int width = c.num_kv_heads * c.head_dim;
  for (int i = 0; i < width; ++i) EXPECT_EQ(record_.keys[1][i], record_.keys_pre_rope[1][i]);
  double moved = 0;
  for (int i = 0; i < width; ++i) {
    moved += std::abs(record_.keys[1][100 * width + i] - record_.keys_pre_rope[1][100 * width + i]);
  }
  EXPECT_GT(moved, 1e-3);
}

TEST_F(PrefillReplayTest, FullPolicyReplayDecodesLikeItsOwnPrefill) {
  kv::KvPolicyConfig config;
  config.policy = "full";
  auto policy = kv::MakeKvPolicy(config, model_->kv_geometry()).value();
  const std::vector<int32_t> normal = DecodeNormally(*model_, *policy, prompt_);
  const std::vector<int32_t> replayed = DecodeReplayed(*model_, *policy, record_);
  ASSERT_GE(normal.size(), 8u) << "the tiny model ended too early to compare anything";
  EXPECT_EQ(replayed, normal);
}

// The same holds for the compressing policies once the prompt exceeds their budget: they
// attend exactly during prefill and compress from the appended data at FinishPrefill.
TEST_F(PrefillReplayTest, SparsePoliciesReplayDecodeLikeTheirOwnPrefill) {
  for (const std::string name : {"shadowkv", "snapkv", "quest", "streaming"}) {
    SCOPED_TRACE(name);
    auto policy = kv::MakeKvPolicy(SmallBudget(name), model_->kv_geometry());
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    const std::vector<int32_t> normal = DecodeNormally(*model_, **policy, prompt_);
    const std::vector<int32_t> replayed = DecodeReplayed(*model_, **policy, record_);
    EXPECT_EQ(replayed, normal);
  }
}

// A record whose first tokens came from elsewhere (the GPU's cache in `eval --device cuda`):
// the first `held` tokens' keys and values without queries, the rest run by ExtendPrefill.
eval::PrefillRecord HandOver(const eval::PrefillRecord& full, int64_t held) {
  eval::PrefillRecord part;
  part.num_tokens = held;
  part.kv_width = full.kv_width;
  part.q_width = full.q_width;
  auto head = [&](const std::vector<std::vector<float>>& from) {
    std::vector<std::vector<float>> to;
    for (const auto& layer : from) to.emplace_back(layer.begin(), layer.begin() + held * full.kv_width);
    return to;
  };
  part.keys_pre_rope = head(full.keys_pre_rope);
  part.keys = head(full.keys);
  part.values = head(full.values);
  part.queries.resize(full.queries.size());
  return part;
}

TEST_F(PrefillReplayTest, ExtendedRecordMatchesTheWholeRecord) {
  constexpr int64_t kHeld = 370;  // 30 tokens run again, across a chunk boundary of neither
  eval::PrefillRecord part = HandOver(record_, kHeld);
  ASSERT_TRUE(eval::ExtendPrefill(*model_, prompt_, &part, kChunk).ok());
  ASSERT_EQ(part.num_tokens, record_.num_tokens);
  const int q_width = record_.q_width;
  for (size_t l = 0; l < record_.keys.size(); ++l) {
    ASSERT_EQ(part.keys[l].size(), record_.keys[l].size());
    ASSERT_EQ(part.queries[l].size(), static_cast<size_t>(400 - kHeld) * q_width);
    double worst = 0;
    for (size_t i = kHeld * record_.kv_width; i < part.keys[l].size(); ++i) {
      worst = std::max<double>(worst, std::abs(part.keys[l][i] - record_.keys[l][i]));
      worst = std::max<double>(worst, std::abs(part.values[l][i] - record_.values[l][i]));
      worst = std::max<double>(worst,
                               std::abs(part.keys_pre_rope[l][i] - record_.keys_pre_rope[l][i]));
    }
    for (size_t i = 0; i < part.queries[l].size(); ++i) {
      worst = std::max<double>(
          worst, std::abs(part.queries[l][i] - record_.queries[l][kHeld * q_width + i]));
    }
    EXPECT_LT(worst, 1e-4) << "layer " << l;
  }
  double worst_logit = 0;
  for (size_t i = 0; i < part.last_logits.size(); ++i) {
    worst_logit = std::max<double>(worst_logit, std::abs(part.last_logits[i] - record_.last_logits[i]));
  }
  EXPECT_LT(worst_logit, 1e-3);
}

// Every policy answers the same from the handed-over record (SnapKV's window queries are the
// re-run tail's) as from the whole one.
TEST_F(PrefillReplayTest, AnswersFromAHandedOverRecordMatchTheWholeRecord) {
  std::vector<kv::KvPolicyConfig> policies;
  for (const std::string name : {"full", "snapkv", "quest", "streaming", "shadowkv"}) {
    policies.push_back(SmallBudget(name));
  }
  eval::PrefillRecord part = HandOver(record_, 400 - 16);
  ASSERT_TRUE(eval::ExtendPrefill(*model_, prompt_, &part, kChunk).ok());
  std::vector<eval::BackendAnswer> whole, handed;
  ASSERT_TRUE(eval::AnswerFromRecord(*model_, record_, policies, kDecodeTokens, &whole).ok());
  ASSERT_TRUE(eval::AnswerFromRecord(*model_, part, policies, kDecodeTokens, &handed).ok());
  ASSERT_EQ(whole.size(), policies.size());
  ASSERT_EQ(handed.size(), policies.size());
  for (size_t p = 0; p < policies.size(); ++p) {
    SCOPED_TRACE(policies[p].policy);
    EXPECT_GE(whole[p].tokens.size(), 8u);
    EXPECT_EQ(handed[p].tokens, whole[p].tokens);
  }
  EXPECT_GT(whole[4].rank, 0);  // shadowkv reports its rank

  // SnapKV needs its whole observation window among the re-run tokens.
  eval::PrefillRecord short_tail = HandOver(record_, 400 - 8);
  ASSERT_TRUE(eval::ExtendPrefill(*model_, prompt_, &short_tail, kChunk).ok());
  const Status status = eval::AnswerFromRecord(*model_, short_tail, {policies[1]}, 4, &handed);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("queries"), std::string::npos) << status.ToString();
}

TEST_F(PrefillReplayTest, ExtendPrefillRejectsMismatchedRecords) {
  eval::PrefillRecord whole = record_;
  EXPECT_FALSE(eval::ExtendPrefill(*model_, prompt_, &whole, kChunk).ok());  // nothing left
  eval::PrefillRecord part = HandOver(record_, 100);
  part.keys[1].pop_back();
  const Status status = eval::ExtendPrefill(*model_, prompt_, &part, kChunk);
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(status.message().find("100 tokens"), std::string::npos) << status.ToString();
}

}  // namespace
}  // namespace shadowkv
