// The eval harness on the real model: task lengths with its tokenizer and chat template, and a
// tiny eval (2 tasks x 2 samples x 1K tokens, full attention) end to end.
#include <gtest/gtest.h>

#include <fstream>

#include "eval/haystack.h"
#include "eval/report.h"
#include "eval/runner.h"
#include "format/chat_template.h"
#include "model/cpu_model.h"
#include "model_path.h"

namespace shadowkv {
namespace {

class EvalModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto model = CpuModel::Load(testing::DefaultModelPath(), 2);
    if (!model.ok()) return;
    model_ = std::move(model).value().release();
    format_ = new eval::PromptFormat(
        eval::PromptFormat::Chat(DetectChatTemplate(model_->file()).value()));
    if (std::ifstream(std::string(eval::kDefaultEssayPath))) {
      corpus_ = new eval::EssayCorpus(eval::LoadEssayCorpus("").value());
      vocabulary_ = new std::vector<std::string>(eval::CorpusVocabulary(*corpus_));
    }
  }
  static void TearDownTestSuite() {
    delete model_;
    delete format_;
    delete corpus_;
    delete vocabulary_;
  }
  void SetUp() override {
    if (!model_) GTEST_SKIP() << "model not found at " << testing::DefaultModelPath();
  }
  static inline CpuModel* model_ = nullptr;
  static inline eval::PromptFormat* format_ = nullptr;
  static inline eval::EssayCorpus* corpus_ = nullptr;
  static inline std::vector<std::string>* vocabulary_ = nullptr;
};

TEST_F(EvalModelTest, PromptsFillTheTargetWithTheModelsTokenizer) {
  const eval::TaskContext context = eval::MakeTaskContext(*model_, *format_, corpus_, vocabulary_);
  for (const eval::TaskInfo& task : eval::AllTasks()) {
    if (!corpus_ && (task.name == "niah_single_2" || task.name == "cwe")) continue;
    for (int64_t target : {2048, 8192}) {
      SCOPED_TRACE(task.name + " at " + std::to_string(target));
      eval::SampleRequest request;
      request.task = task.name;
      request.target_tokens = target;
      auto sample = eval::SynthesizeSample(request, context);
      if (!corpus_ && !sample.ok()) continue;  // an essay task without the corpus
      ASSERT_TRUE(sample.ok()) << sample.status().ToString();
      const auto tokens = model_->tokenizer().Encode(sample->prompt, true, true);
      EXPECT_EQ(static_cast<int64_t>(tokens.size()), sample->prompt_tokens);
      EXPECT_LE(sample->prompt_tokens + task.max_new_tokens, target);
      EXPECT_GE(sample->prompt_tokens + task.max_new_tokens, 0.97 * target);
      // ChatML around the user turn, the answer prefix after the assistant header.
      EXPECT_TRUE(sample->prompt.starts_with("<|im_start|>system\n"))
          << sample->prompt.substr(0, 80);
      const std::string header = "<|im_end|>\n<|im_start|>assistant\n";
      const size_t at = sample->prompt.rfind(header);
      ASSERT_NE(at, std::string::npos);
      EXPECT_EQ(sample->prompt.substr(at + header.size()),
                sample->parts.answer_prefix.substr(1));  // without RULER's leading space
    }
  }
}

TEST_F(EvalModelTest, TinyEvalWithFullAttentionFindsTheNeedle) {
  const eval::TaskContext context = eval::MakeTaskContext(*model_, *format_, corpus_, vocabulary_);
  eval::EvalSettings settings;
  settings.tasks = {"niah_single_1", "passkey"};
  settings.lengths = {1024};
  settings.samples = 2;
  settings.seed = 42;
  kv::KvPolicyConfig full;
  full.policy = "full";
  settings.policies = {full};
  int progress_calls = 0;
  auto report =
      eval::RunEval(*model_, *format_, context, settings, [&](const eval::EvalProgress& p) {
        EXPECT_EQ(p.total, 4);
        ++progress_calls;
      });
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(progress_calls, 5);  // before each question, then once finished
  ASSERT_EQ(report->questions.size(), 4u);
  for (const eval::QuestionOutcome& q : report->questions) {
    SCOPED_TRACE(q.task + " sample " + std::to_string(q.index));
    ASSERT_EQ(q.outputs.size(), 1u);
    EXPECT_EQ(q.outputs[0].policy, "full");
    EXPECT_LE(q.prompt_tokens, 1024);
    EXPECT_GT(q.outputs[0].generated_tokens, 0);
    ASSERT_EQ(q.answers.size(), 1u);
    if (q.task == "niah_single_1") {
      // Checked by hand: SmolLM2-135M-Instruct answers both samples of seed 42 at 1K.
      EXPECT_EQ(q.outputs[0].score, 1.0) << q.outputs[0].text;
      EXPECT_NE(q.outputs[0].text.find(q.answers[0]), std::string::npos);
    }
  }

  const eval::ScoreSummary summary = eval::Summarize(*report);
  EXPECT_EQ(summary.lengths, std::vector<int64_t>{1024});
  EXPECT_EQ(summary.rows, (std::vector<std::string>{"niah_single_1", "passkey"}));
  EXPECT_EQ(summary.scores[0][0][0], 100.0);

  const std::string tables = eval::FormatTables(*report);
  EXPECT_NE(tables.find("niah_single_1"), std::string::npos);
  EXPECT_NE(tables.find("average"), std::string::npos);
  EXPECT_NE(tables.find("qa_1, qa_2: not available (SQuAD/HotpotQA cannot be fetched here)"),
            std::string::npos);

  const auto json = eval::ReportToJson(*report);
  EXPECT_EQ(json["settings"]["samples"], 2);
  EXPECT_EQ(json["settings"]["seed"], 42);
  EXPECT_EQ(json["settings"]["prompt_format"], "chatml");
  EXPECT_EQ(json["settings"]["policies"][0]["name"], "full");
  EXPECT_EQ(json["scores"]["1024"]["niah_single_1"]["full"], 100.0);
  EXPECT_TRUE(json["scores"]["1024"].contains("average"));
  EXPECT_EQ(json["questions"].size(), 4u);
  EXPECT_EQ(json["unavailable"],
            "qa_1, qa_2: not available (SQuAD/HotpotQA cannot be fetched here)");

  const std::string csv = eval::ReportToCsv(*report);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 4);  // header, 2 tasks, average
  EXPECT_NE(csv.find("tasks,"), std::string::npos);
}

}  // namespace
}  // namespace shadowkv
