// The eval runner on a tiny random model: every policy answers every question, settings are
// resolved per prompt, and a multi-turn conversation continued on the same KV state answers as
// a fresh prefill of the whole conversation does.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/prefill_record.h"
#include "eval/report.h"
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
  // Multi-turn NIAH, 3 turns of one 1800-token sample (seed 5), every policy.
  eval::EvalSettings ThreeTurns() const {
    eval::EvalSettings settings;
    settings.mode = eval::EvalMode::kMultiTurn;
    settings.turns = 3;
    settings.lengths = {1800};
    settings.samples = 1;
    settings.seed = 5;
    settings.policies = AllPolicies();
    return settings;
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
        EXPECT_EQ(out.rank, 32);  // the floor of 48 is above the kv width of 32: the width
      }
    }
  }
}

// The progress calls hand out the report so far: the questions answered before each call, in
// order, marked incomplete (what `eval --json` writes while it runs); the returned report is
// complete, and the JSON says which it is.
TEST_F(EvalRunnerTest, ProgressCarriesThePartialReport) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  eval::EvalSettings settings;
  settings.tasks = {"passkey"};
  settings.lengths = {1300};
  settings.samples = 3;
  settings.policies = {kv::KvPolicyConfig{}};
  std::vector<size_t> seen;
  bool all_incomplete = true;
  auto progress = [&](const eval::EvalProgress& p) {
    ASSERT_NE(p.partial, nullptr);
    EXPECT_EQ(p.partial->questions.size(), static_cast<size_t>(p.done));
    all_incomplete = all_incomplete && !p.partial->complete;
    if (!p.partial->questions.empty()) {
      EXPECT_EQ(eval::ReportToJson(*p.partial)["complete"], false);
      EXPECT_EQ(p.partial->questions.back().index, static_cast<int>(p.done) - 1);
    }
    seen.push_back(p.partial->questions.size());
  };
  auto report = eval::RunEval(*model_, format_, tasks, settings, progress);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(all_incomplete);
  EXPECT_EQ(seen, (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_TRUE(report->complete);
  EXPECT_EQ(eval::ReportToJson(*report)["complete"], true);
}

// Fidelity: every policy follows the first policy's answer. A policy that answers exactly as the
// first has the first's top token at every step; the first against itself has no divergence; a
// small budget diverges somewhere. Steps are the answer's tokens after the first.
TEST_F(EvalRunnerTest, FidelityFollowsTheFirstPolicysAnswer) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  eval::EvalSettings settings;
  settings.tasks = {"niah_single_2"};
  settings.lengths = {1300};
  settings.samples = 2;
  kv::KvPolicyConfig full, exact_shadow, small;
  exact_shadow.policy = small.policy = "shadowkv";
  exact_shadow.label = "shadowkv:everything";
  exact_shadow.rank = 32;  // the kv width: keys rebuilt exactly
  exact_shadow.budget_tokens = 2048;
  exact_shadow.outlier_chunks = 0;
  small.budget_tokens = 16;
  small.outlier_chunks = 0;
  small.chunk_size = 4;
  settings.policies = {full, exact_shadow, small};
  settings.fidelity = true;
  auto report = eval::RunEval(*model_, format_, tasks, settings);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  double small_kl = 0.0;
  for (const eval::QuestionOutcome& q : report->questions) {
    const int steps = q.outputs[0].generated_tokens - 1;
    ASSERT_GT(steps, 2);
    for (const eval::PolicyOutput& out : q.outputs) {
      SCOPED_TRACE(out.policy + ", sample " + std::to_string(q.index));
      EXPECT_EQ(out.fidelity.steps, steps);
      EXPECT_GE(out.fidelity.kl_sum, 0.0);
      if (out.tokens == q.outputs[0].tokens) {
        EXPECT_EQ(out.fidelity.same_top, steps);
      }
    }
    EXPECT_EQ(q.outputs[0].fidelity.kl_sum, 0.0);
    EXPECT_LT(q.outputs[1].fidelity.kl_sum, 1e-6 * steps);  // equal up to summation order
    small_kl += q.outputs[2].fidelity.kl_sum;
  }
  EXPECT_GT(small_kl, 1e-4);
  const eval::ScoreSummary summary = eval::Summarize(*report);
  EXPECT_DOUBLE_EQ(summary.same_top[0][0], 100.0);
  EXPECT_GT(summary.fidelity_steps[0][2], 0);
  EXPECT_NE(eval::FormatTables(*report).find("teacher-forced along full's answers"),
            std::string::npos);

  settings.mode = eval::EvalMode::kMultiTurn;  // not with multi-turn
  settings.turns = 2;
  EXPECT_EQ(eval::RunEval(*model_, format_, tasks, settings).status().code(),
            ErrorCode::kUnsupported);
}

// Runs `tokens` through a fresh sequence of `config` (full attention by default) and decodes
// greedily.
std::vector<int32_t> FreshAnswer(CpuModel& model, const std::vector<int32_t>& tokens, int max_new,
                                 const kv::KvPolicyConfig& config = {}) {
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

// Policy `p`'s conversation before turn `until` (0-based): prompt, answer 1, follow-up 2, ...
std::vector<int32_t> ConversationBefore(const eval::EvalReport& report, size_t p, int until,
                                        const eval::MultiTurnSample& sample,
                                        const eval::PromptFormat& format,
                                        const Tokenizer& tokenizer) {
  std::vector<int32_t> conversation = tokenizer.Encode(sample.first.prompt, true, true);
  for (int turn = 0; turn < until; ++turn) {
    const std::vector<int32_t>& answer = report.questions[turn].outputs[p].tokens;
    conversation.insert(conversation.end(), answer.begin(), answer.end());
    std::string followup = format.Followup(sample.followups[turn]);
    const int32_t last = answer.back();
    const std::string last_text = tokenizer.Decode(std::span<const int32_t>(&last, 1));
    if (tokenizer.IsEndOfGeneration(last) && followup.starts_with(last_text)) {
      followup.erase(0, last_text.size());  // the answer's end token closed the turn
    }
    const auto more = tokenizer.Encode(followup, false, true);
    conversation.insert(conversation.end(), more.begin(), more.end());
  }
  return conversation;
}

// With fresh_turns every later turn is what a new sequence of the same policy answers after a
// prefill of that policy's conversation so far; full attention answers the same either way.
TEST_F(EvalRunnerTest, FreshTurnsPrefillEachPolicysConversationAgain) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  eval::EvalSettings settings = ThreeTurns();
  auto reused = eval::RunEval(*model_, format_, tasks, settings);
  ASSERT_TRUE(reused.ok()) << reused.status().ToString();
  settings.fresh_turns = true;
  auto fresh = eval::RunEval(*model_, format_, tasks, settings);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  ASSERT_EQ(fresh->questions.size(), 3u);
  auto sample = eval::SynthesizeMultiTurn(3, 1800, 5, 0, tasks).value();
  for (int turn = 0; turn < 3; ++turn) {
    EXPECT_EQ(fresh->questions[turn].outputs[0].tokens, reused->questions[turn].outputs[0].tokens)
        << "full attention, turn " << turn + 1;
  }
  // SnapKV compresses the whole conversation again, so it holds less than the sequence that
  // kept every follow-up and answer exact; full attention holds the same tokens either way.
  const auto& fresh_last = fresh->questions[2].outputs;
  const auto& reused_last = reused->questions[2].outputs;
  ASSERT_EQ(fresh_last[2].policy, "snapkv");
  EXPECT_LT(fresh_last[2].memory.fast_bytes, reused_last[2].memory.fast_bytes);
  EXPECT_EQ(fresh_last[0].memory.fast_bytes, reused_last[0].memory.fast_bytes);
  for (size_t p = 0; p < settings.policies.size(); ++p) {
    for (int turn = 1; turn < 3; ++turn) {
      const std::vector<int32_t>& answer = fresh->questions[turn].outputs[p].tokens;
      const std::vector<int32_t> before =
          ConversationBefore(*fresh, p, turn, sample, format_, model_->tokenizer());
      EXPECT_GE(answer.size(), 8u) << "too short to compare anything";
      EXPECT_EQ(answer, FreshAnswer(*model_, before, 128, settings.policies[p]))
          << settings.policies[p].policy << ", turn " << turn + 1;
    }
  }
}

TEST_F(EvalRunnerTest, MultiTurnContinuesTheConversationOnTheSameKvState) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  eval::EvalSettings settings = ThreeTurns();
  auto report = eval::RunEval(*model_, format_, tasks, settings);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->questions.size(), 3u);
  auto sample = eval::SynthesizeMultiTurn(3, 1800, 5, 0, tasks).value();
  for (int turn = 0; turn < 3; ++turn) {
    EXPECT_EQ(report->questions[turn].turn, turn + 1);
    EXPECT_EQ(report->questions[turn].answers, std::vector<std::string>{sample.values[turn]});
    EXPECT_EQ(report->questions[turn].depth, sample.key_depths[turn]);
  }

  // Turn 2+ of the full policy answers as a fresh prefill of everything before it does.
  for (int turn = 1; turn < 3; ++turn) {
    const std::vector<int32_t>& answer = report->questions[turn].outputs[0].tokens;
    ASSERT_EQ(report->questions[turn].outputs[0].policy, "full");
    EXPECT_GE(answer.size(), 8u) << "too short to compare anything";
    const std::vector<int32_t> before =
        ConversationBefore(*report, 0, turn, sample, format_, model_->tokenizer());
    EXPECT_EQ(answer, FreshAnswer(*model_, before, 128)) << "turn " << turn + 1;
  }
}

// A backend that answers the passkey by reading it from the prompt (policy 0) or says nothing
// useful (policy 1): the runner scores its answers, copies its statistics, and refuses what the
// backend refuses (quest, fidelity unless it measures it, conversations).
class PromptReadingBackend : public eval::AnswerBackend {
 public:
  explicit PromptReadingBackend(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  std::string numerics() const override { return "test-backend"; }
  Status Check(const std::vector<kv::KvPolicyConfig>& policies, bool fidelity,
               bool conversations) const override {
    if (fidelity && !measures_fidelity) return Error(ErrorCode::kUnsupported, "no fidelity here");
    if (conversations) return Error(ErrorCode::kUnsupported, "no conversations here");
    for (const auto& config : policies) {
      if (config.policy == "quest") return Error(ErrorCode::kUnsupported, "no quest here");
    }
    return Status::Ok();
  }
  Status Answer(const std::vector<int32_t>& prompt, int max_new_tokens,
                const std::vector<kv::KvPolicyConfig>& policies, bool fidelity,
                std::vector<eval::BackendAnswer>* answers, double* prefill_seconds) override {
    const std::string text = tokenizer_.Decode(prompt, true);
    const std::string marker = "The pass key is ";
    const size_t at = text.find(marker);
    if (at == std::string::npos) return Error(ErrorCode::kInternal, "no pass key in the prompt");
    const std::string key = text.substr(at + marker.size(), 5);
    prompts_seen.push_back(static_cast<int64_t>(prompt.size()));
    answers->assign(policies.size(), {});
    (*answers)[0].tokens = tokenizer_.Encode(" " + key + ".", false, false);
    (*answers)[1].tokens = tokenizer_.Encode(" none", false, false);
    (*answers)[1].stats.chunk_selections = 10;
    (*answers)[1].stats.chunk_hits = 4;
    (*answers)[1].rank = 8;
    (*answers)[1].memory.fast_bytes = 3000;
    (*answers)[1].kv_tokens = 1000;
    if (fidelity) (*answers)[1].fidelity = {3, 2, 0.75};
    *prefill_seconds = 0.25;
    EXPECT_EQ(max_new_tokens, 16);
    return Status::Ok();
  }
  std::vector<int64_t> prompts_seen;
  bool measures_fidelity = false;

 private:
  const Tokenizer& tokenizer_;
};

TEST_F(EvalRunnerTest, BackendAnswersAreScoredAndItsLimitsReported) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  PromptReadingBackend backend(model_->tokenizer());
  eval::EvalSettings settings;
  settings.tasks = {"passkey"};
  settings.lengths = {900};
  settings.samples = 2;
  settings.policies = AllPolicies();
  settings.policies.resize(2);  // full, shadowkv
  auto report = eval::RunEval(*model_, format_, tasks, settings, nullptr, &backend);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->numerics, "test-backend");
  ASSERT_EQ(report->questions.size(), 2u);
  ASSERT_EQ(backend.prompts_seen.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const eval::QuestionOutcome& q = report->questions[i];
    EXPECT_EQ(q.prompt_tokens, backend.prompts_seen[i]);
    EXPECT_DOUBLE_EQ(q.prefill_seconds, 0.25);
    ASSERT_EQ(q.outputs.size(), 2u);
    EXPECT_EQ(q.outputs[0].text, " " + q.answers[0] + ".");
    EXPECT_DOUBLE_EQ(q.outputs[0].score, 1.0);
    EXPECT_DOUBLE_EQ(q.outputs[1].score, 0.0);
    EXPECT_EQ(q.outputs[1].stats.chunk_hits, 4);
    EXPECT_EQ(q.outputs[1].rank, 8);
    EXPECT_EQ(q.outputs[1].budget_tokens, settings.policies[1].BudgetTokens(q.prompt_tokens));
    EXPECT_EQ(q.outputs[1].kv_tokens, 1000);
  }
  // Bytes per token where the backend gives the held tokens, none where it does not (full here).
  const eval::ScoreSummary summary = eval::Summarize(*report);
  EXPECT_DOUBLE_EQ(summary.fast_bytes_per_token[0][1], 3.0);
  EXPECT_TRUE(std::isnan(summary.fast_bytes_per_token[0][0]));
  // Fidelity: refused where the backend cannot measure it, copied where it does.
  settings.fidelity = true;
  EXPECT_EQ(eval::RunEval(*model_, format_, tasks, settings, nullptr, &backend).status().code(),
            ErrorCode::kUnsupported);
  backend.measures_fidelity = true;
  auto followed = eval::RunEval(*model_, format_, tasks, settings, nullptr, &backend);
  ASSERT_TRUE(followed.ok()) << followed.status().ToString();
  EXPECT_EQ(followed->questions[0].outputs[1].fidelity.same_top, 2);
  EXPECT_DOUBLE_EQ(followed->questions[0].outputs[1].fidelity.kl_sum, 0.75);
  EXPECT_DOUBLE_EQ(eval::Summarize(*followed).mean_kl[0][1], 0.25);
  settings.fidelity = false;
  backend.prompts_seen.clear();
  settings.policies = AllPolicies();  // quest is refused before any sample
  auto refused = eval::RunEval(*model_, format_, tasks, settings, nullptr, &backend);
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnsupported);
  EXPECT_EQ(backend.prompts_seen.size(), 0u);
  settings.policies.resize(2);
  settings.mode = eval::EvalMode::kMultiTurn;
  settings.turns = 2;
  auto multi_turn = eval::RunEval(*model_, format_, tasks, settings, nullptr, &backend);
  EXPECT_EQ(multi_turn.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(multi_turn.status().message().find("no conversations"), std::string::npos);
}

// A backend whose conversations run on the CPU model, one policy's sequence at a time, each
// opened by a prefill of its own (recorded and replayed, as the runner's): the runner's backend path for multi-turn NIAH must give what
// its own side-by-side path gives (the same tokens, held counts and statistics).
class CpuConversationBackend : public eval::AnswerBackend {
 public:
  explicit CpuConversationBackend(CpuModel& model) : model_(model) {}
  std::string numerics() const override { return "cpu-conversations"; }
  Status Check(const std::vector<kv::KvPolicyConfig>&, bool, bool) const override {
    return Status::Ok();
  }
  Status Answer(const std::vector<int32_t>&, int, const std::vector<kv::KvPolicyConfig>&, bool,
                std::vector<eval::BackendAnswer>*, double*) override {
    return Error(ErrorCode::kInternal, "conversations only");
  }
  Status OpenConversation(const std::vector<int32_t>& tokens, const kv::KvPolicyConfig& policy,
                          int32_t* first, double* prefill_seconds) override {
    SKV_ASSIGN_OR_RETURN(policy_, kv::MakeKvPolicy(policy, model_.kv_geometry()));
    SKV_ASSIGN_OR_RETURN(sequence_, policy_->NewSequence());
    SKV_ASSIGN_OR_RETURN(eval::PrefillRecord record, eval::RecordPrefill(model_, tokens, 512));
    SKV_RETURN_IF_ERROR(eval::ReplayPrefill(record, *sequence_));
    *first = Argmax(record.last_logits);
    *prefill_seconds = 0.0;
    opened++;
    return Status::Ok();
  }
  Status RunConversation(eval::GreedyStream& stream, eval::BackendAnswer* answer) override {
    if (!sequence_) return Error(ErrorCode::kInternal, "no conversation open");
    stream.kv = sequence_.get();
    eval::GreedyStream* streams[] = {&stream};
    SKV_RETURN_IF_ERROR(eval::RunGreedy(model_, streams));
    answer->stats = sequence_->stats();
    answer->memory = sequence_->memory();
    answer->kv_tokens = sequence_->num_tokens();
    return Status::Ok();
  }
  void CloseConversation() override {
    sequence_.reset();
    policy_.reset();
  }
  int opened = 0;

 private:
  CpuModel& model_;
  std::unique_ptr<kv::KvPolicy> policy_;
  std::unique_ptr<kv::SequenceKv> sequence_;
};

TEST_F(EvalRunnerTest, BackendConversationsAnswerAsTheCpuRunner) {
  const eval::TaskContext tasks = eval::MakeTaskContext(*model_, format_, &corpus_, &vocabulary_);
  for (bool fresh : {false, true}) {
    eval::EvalSettings settings = ThreeTurns();
    settings.fresh_turns = fresh;
    auto cpu = eval::RunEval(*model_, format_, tasks, settings);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    CpuConversationBackend backend(*model_);
    auto backed = eval::RunEval(*model_, format_, tasks, settings, nullptr, &backend);
    ASSERT_TRUE(backed.ok()) << backed.status().ToString();
    const size_t policies = settings.policies.size();
    // One open per policy, and with fresh turns one more per later turn.
    EXPECT_EQ(backend.opened, static_cast<int>(policies * (fresh ? 3 : 1)));
    ASSERT_EQ(backed->questions.size(), 3u);
    for (int turn = 0; turn < 3; ++turn) {
      const eval::QuestionOutcome& want = cpu->questions[turn];
      const eval::QuestionOutcome& got = backed->questions[turn];
      EXPECT_EQ(got.turn, turn + 1);
      EXPECT_EQ(got.answers, want.answers);
      EXPECT_EQ(got.prompt_tokens, want.prompt_tokens) << "turn " << turn + 1;
      ASSERT_EQ(got.outputs.size(), policies);
      for (size_t p = 0; p < policies; ++p) {
        const std::string what = fmt::format("{}, turn {}, fresh {}", want.outputs[p].policy,
                                             turn + 1, fresh);
        EXPECT_EQ(got.outputs[p].policy, want.outputs[p].policy);
        EXPECT_GE(want.outputs[p].tokens.size(), 4u) << what << ": too short to compare";
        EXPECT_EQ(got.outputs[p].tokens, want.outputs[p].tokens) << what;
        EXPECT_EQ(got.outputs[p].kv_tokens, want.outputs[p].kv_tokens) << what;
        EXPECT_EQ(got.outputs[p].stats.attended_tokens, want.outputs[p].stats.attended_tokens)
            << what;
        EXPECT_EQ(got.outputs[p].budget_tokens, want.outputs[p].budget_tokens) << what;
      }
    }
  }
}

}  // namespace
}  // namespace shadowkv
