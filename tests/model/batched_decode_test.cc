// Batched decode of sequences of different lengths gives the same tokens as decoding each alone.
#include <gtest/gtest.h>

#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "model_path.h"

namespace shadowkv {
namespace {

class BatchedDecodeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto model = CpuModel::Load(testing::DefaultModelPath(), 2);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(model).value().release();
  }
  static void TearDownTestSuite() { delete model_; }

  // Prefills `prompt` into a fresh full-attention sequence; returns the first greedy token.
  static int32_t Prefill(const kv::KvPolicy& policy, const std::vector<int32_t>& prompt,
                         std::unique_ptr<kv::SequenceKv>& kv, std::vector<float>& logits) {
    kv = policy.NewSequence().value();
    StepInput in;
    in.kv = kv.get();
    in.tokens = prompt;
    in.finish_prefill = true;
    in.logits_out = logits.data();
    EXPECT_TRUE(model_->Forward(std::span<const StepInput>(&in, 1)).ok());
    return Argmax(logits);
  }

  static CpuModel* model_;
};
CpuModel* BatchedDecodeTest::model_ = nullptr;

TEST_F(BatchedDecodeTest, SameTokensAndLogitsAloneOrBatched) {
  const auto& tok = model_->tokenizer();
  const std::vector<std::string> texts = {
      "Once upon a time, in a small village by the sea,",
      "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
      "The three primary colours are red, yellow and blue. Mixing red and yellow gives orange, "
      "mixing yellow and blue gives green, and mixing blue with red gives",
  };
  kv::KvPolicyConfig config;
  auto policy = kv::MakeKvPolicy(config, model_->kv_geometry()).value();
  const int vocab = static_cast<int>(model_->config().vocab_size);
  const int steps = 24;

  // Alone: each sequence decoded by itself; record tokens and logits.
  std::vector<std::vector<int32_t>> alone_tokens(texts.size());
  std::vector<std::vector<float>> alone_logits(texts.size());
  for (size_t s = 0; s < texts.size(); ++s) {
    std::vector<float> logits(vocab);
    std::unique_ptr<kv::SequenceKv> kv;
    int32_t next = Prefill(*policy, tok.Encode(texts[s], false, false), kv, logits);
    for (int step = 0; step < steps; ++step) {
      alone_tokens[s].push_back(next);
      StepInput in;
      in.kv = kv.get();
      in.tokens = std::span<const int32_t>(&next, 1);
      in.logits_out = logits.data();
      ASSERT_TRUE(model_->Forward(std::span<const StepInput>(&in, 1)).ok());
      alone_logits[s].insert(alone_logits[s].end(), logits.begin(), logits.end());
      next = Argmax(logits);
    }
  }

  // Batched: all three decode in the same forward steps.
  std::vector<std::unique_ptr<kv::SequenceKv>> kvs(texts.size());
  std::vector<int32_t> next(texts.size());
  std::vector<float> logits(texts.size() * vocab);
  for (size_t s = 0; s < texts.size(); ++s) {
    std::vector<float> first(vocab);
    next[s] = Prefill(*policy, tok.Encode(texts[s], false, false), kvs[s], first);
  }
  EXPECT_NE(kvs[0]->num_tokens(), kvs[2]->num_tokens());  // really different lengths
  for (int step = 0; step < steps; ++step) {
    std::vector<StepInput> inputs(texts.size());
    for (size_t s = 0; s < texts.size(); ++s) {
      ASSERT_EQ(next[s], alone_tokens[s][step]) << "sequence " << s << " step " << step;
      inputs[s].kv = kvs[s].get();
      inputs[s].tokens = std::span<const int32_t>(&next[s], 1);
      inputs[s].logits_out = logits.data() + s * vocab;
    }
    ASSERT_TRUE(model_->Forward(inputs).ok());
    for (size_t s = 0; s < texts.size(); ++s) {
      float max_diff = 0;
      for (int i = 0; i < vocab; ++i) {
        max_diff = std::max(max_diff, std::abs(logits[s * vocab + i] -
                                               alone_logits[s][step * vocab + i]));
      }
      EXPECT_LE(max_diff, 1e-4f) << "sequence " << s << " step " << step;
      next[s] = Argmax(std::span<const float>(logits.data() + s * vocab, vocab));
    }
  }
}

TEST_F(BatchedDecodeTest, RejectsOverlongSequenceAndBadTokens) {
  kv::KvPolicyConfig config;
  auto policy = kv::MakeKvPolicy(config, model_->kv_geometry()).value();
  auto kv = policy->NewSequence().value();
  std::vector<int32_t> too_long(model_->config().context_length + 1, 100);
  StepInput in;
  in.kv = kv.get();
  in.tokens = too_long;
  in.logits = StepInput::Logits::kNone;
  Status status = model_->Forward(std::span<const StepInput>(&in, 1));
  EXPECT_EQ(status.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(status.message().find("context"), std::string::npos);
  std::vector<int32_t> bad = {1, -5};
  in.tokens = bad;
  EXPECT_EQ(model_->Forward(std::span<const StepInput>(&in, 1)).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(kv->num_tokens(), 0);  // nothing was appended
}

}  // namespace
}  // namespace shadowkv
