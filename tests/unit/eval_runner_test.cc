// The eval runner on a tiny random model: every policy answers every question, settings are
// resolved per prompt, and a multi-turn conversation continued on the same KV state answers as
// a fresh prefill of the whole conversation does.
#include <gtest/gtest.h>

#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/runner.h"
#include "model/cpu_model.h"
#include "tiny_model.h"

namespace shadowkv {
namespace {

eval::EssayCorpus SmallCorpus() {
  eval::EssayCorpus corpus;
  corpus.source = "test";
  const char* words[] = {"stone", "water", "light", "cloud", "field", "river", "paper", "glass"};
  for (int s = 0; s < 600; ++s) {
    for (int w = 0; w < 7; ++w) corpus.words.push_back(words[(s * 7 + w * 3) % 8]);
    corpus.words.back() += ".";
  }
  return corpus;
}

class EvalRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::TinyModelSpec spec;
    spec.layers = 2;
    spec.context = 2048;
    spec.seed = 3;
    model_ = CpuModel::Load(testing::WriteTinyModel(spec, "eval_runner"), 1).value();
    corpus_ = SmallCorpus();
  }
  std::vector<kv::KvPolicyConfig> AllPolicies() const {
    std::vector<kv::KvPolicyConfig> configs;
    for (const std::string& name : kv::KnownKvPolicies()) {
      kv::KvPolicyConfig c;
      c.policy = name;
      c.budget_min_tokens = 64;
      c.outlier_chunks = 2;
      configs.push_back(c);
    }
    return configs;
  }
  std::unique_ptr<CpuModel> model_;
  eval::EssayCorpus corpus_;
  std::vector<std::string> vocabulary_ = {"alpha", "bravo", "delta", "gamma", "kappa"};
  eval::PromptFormat format_ = eval::PromptFormat::Chat({ChatFormat::kChatML, ""});
};

TEST_F(EvalRunnerTest, EveryPolicyAnswersEveryQuestion) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  eval::EvalSettings settings;
  settings.tasks = {"niah_single_2", "passkey"};
  settings.lengths = {1300};
  settings.samples = 2;
  settings.policies = AllPolicies();
  auto report = eval::RunEval(*model_, format_, tasks, settings);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->questions.size(), 4u);
  for (const eval::QuestionOutcome& q : report->questions) {
    EXPECT_EQ(q.length, 1300);
    EXPECT_GT(q.prompt_tokens, 1000);
    EXPECT_LE(q.prompt_tokens + (q.task == "passkey" ? 16 : 128), 1300);
    ASSERT_EQ(q.outputs.size(), settings.policies.size());
    for (size_t p = 0; p < q.outputs.size(); ++p) {
      const eval::PolicyOutput& out = q.outputs[p];
      EXPECT_EQ(out.policy, settings.policies[p].policy);
      EXPECT_GT(out.generated_tokens, 0);
      EXPECT_EQ(out.tokens.size(), static_cast<size_t>(out.generated_tokens));
      EXPECT_TRUE(out.score >= 0.0 && out.score <= 1.0);
      if (out.policy == "full") {
        EXPECT_EQ(out.budget_tokens, 0);
      } else {
        EXPECT_EQ(out.budget_tokens, settings.policies[p].BudgetTokens(q.prompt_tokens));
      }
      if (out.policy == "shadowkv") {
        EXPECT_EQ(out.rank, 8);  // ceil8(kv width 32 / 6.4)
      }
    }
  }
}

// Runs `tokens` through a fresh full-attention sequence and decodes greedily.
std::vector<int32_t> FreshAnswer(CpuModel& model, const std::vector<int32_t>& tokens, int max_new) {
  kv::KvPolicyConfig config;
  auto policy = kv::MakeKvPolicy(config, model.kv_geometry()).value();
  auto sequence = policy->NewSequence().value();
  std::vector<float> logits(model.config().vocab_size);
  StepInput in;
  in.kv = sequence.get();
  in.tokens = tokens;
  in.finish_prefill = true;
  in.logits_out = logits.data();
  EXPECT_TRUE(model.Forward(std::span<const StepInput>(&in, 1)).ok());
  eval::GreedyStream stream;
  stream.kv = sequence.get();
  stream.remaining = max_new;
  eval::PushToken(stream, Argmax(logits), model.tokenizer());
  eval::GreedyStream* streams[] = {&stream};
  EXPECT_TRUE(eval::RunGreedy(model, streams).ok());
  return stream.generated;
}

TEST_F(EvalRunnerTest, MultiTurnContinuesTheConversationOnTheSameKvState) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  eval::EvalSettings settings;
  settings.mode = eval::EvalMode::kMultiTurn;
  settings.turns = 3;
  settings.lengths = {1800};
  settings.samples = 1;
  settings.seed = 5;
  settings.policies = AllPolicies();
  auto report = eval::RunEval(*model_, format_, tasks, settings);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->questions.size(), 3u);
  auto sample = eval::SynthesizeMultiTurn(3, 1800, 5, 0, tasks).value();
  for (int turn = 0; turn < 3; ++turn) {
    EXPECT_EQ(report->questions[turn].turn, turn + 1);
    EXPECT_EQ(report->questions[turn].answers, std::vector<std::string>{sample.values[turn]});
    EXPECT_EQ(report->questions[turn].depth, sample.key_depths[turn]);
  }

  // The conversation as text the full policy saw: prompt, answer 1, follow-up 2, answer 2, ...
  const Tokenizer& tokenizer = model_->tokenizer();
  std::vector<int32_t> conversation = tokenizer.Encode(sample.first.prompt, true, true);
  for (int turn = 0; turn < 3; ++turn) {
    const std::vector<int32_t>& answer = report->questions[turn].outputs[0].tokens;
    ASSERT_EQ(report->questions[turn].outputs[0].policy, "full");
    if (turn > 0) {
      // Turn 2+ answers as a fresh prefill of everything before it does.
      EXPECT_GE(answer.size(), 8u) << "too short to compare anything";
      EXPECT_EQ(answer, FreshAnswer(*model_, conversation, 128)) << "turn " << turn + 1;
    }
    conversation.insert(conversation.end(), answer.begin(), answer.end());
    if (turn + 1 < 3) {
      std::string followup = format_.Followup(sample.followups[turn]);
      const int32_t last = answer.back();
      const std::string last_text = tokenizer.Decode(std::span<const int32_t>(&last, 1));
      if (tokenizer.IsEndOfGeneration(last) && followup.starts_with(last_text)) {
        followup.erase(0, last_text.size());  // the answer's end token closed the turn
      }
      const auto more = tokenizer.Encode(followup, false, true);
      conversation.insert(conversation.end(), more.begin(), more.end());
    }
  }
}

}  // namespace
}  // namespace shadowkv
