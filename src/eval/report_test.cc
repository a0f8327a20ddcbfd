// Report summaries on hand-made outcomes: means per row and policy, averages, table, JSON, CSV.
#include "eval/report.h"

#include <gtest/gtest.h>

#include <cmath>

namespace shadowkv::eval {
namespace {

QuestionOutcome Question(const std::string& task, int64_t length, std::vector<double> scores,
                         double depth = -1, int turn = 0) {
  QuestionOutcome q;
  q.task = task;
  q.length = length;
  q.depth = depth;
  q.turn = turn;
  const char* names[] = {"full", "streaming"};
  for (size_t p = 0; p < scores.size(); ++p) {
    PolicyOutput out;
    out.policy = names[p];
    out.score = scores[p];
    q.outputs.push_back(out);
  }
  return q;
}

EvalReport TwoPolicies(EvalMode mode) {
  EvalReport report;
  report.settings.mode = mode;
  report.settings.samples = 2;
  report.settings.seed = 7;
  report.settings.lengths = {2048, 4096};
  kv::KvPolicyConfig full, streaming;
  full.policy = "full";
  streaming.policy = "streaming";
  streaming.budget_tokens = 300;
  report.settings.policies = {full, streaming};
  report.model_path = "/models/m.gguf";
  report.numerics = "exact";
  return report;
}

TEST(ReportTest, MeansPerTaskAndAverageOverTasks) {
  EvalReport report = TwoPolicies(EvalMode::kTasks);
  report.settings.tasks = {"niah_single_1", "vt"};
  report.questions = {Question("niah_single_1", 2048, {1.0, 0.0}),
                      Question("niah_single_1", 2048, {1.0, 1.0}), Question("vt", 2048, {0.4, 0.0}),
                      Question("vt", 2048, {0.6, 0.2}),
                      Question("niah_single_1", 4096, {0.0, 0.0})};
  const ScoreSummary s = Summarize(report);
  EXPECT_EQ(s.lengths, (std::vector<int64_t>{2048, 4096}));
  EXPECT_EQ(s.rows, (std::vector<std::string>{"niah_single_1", "vt"}));
  EXPECT_EQ(s.policies, (std::vector<std::string>{"full", "streaming"}));
  EXPECT_DOUBLE_EQ(s.scores[0][0][0], 100.0);
  EXPECT_DOUBLE_EQ(s.scores[0][0][1], 50.0);
  EXPECT_DOUBLE_EQ(s.scores[0][1][0], 50.0);
  EXPECT_DOUBLE_EQ(s.scores[0][1][1], 10.0);
  EXPECT_DOUBLE_EQ(s.averages[0][0], 75.0);
  EXPECT_DOUBLE_EQ(s.averages[0][1], 30.0);
  EXPECT_TRUE(std::isnan(s.scores[1][1][0]));  // vt was not run at 4096
  EXPECT_DOUBLE_EQ(s.averages[1][0], 0.0);     // the average skips it
  EXPECT_EQ(s.counts[0][0][1], 2);

  const std::string table = FormatTables(report);
  EXPECT_NE(table.find("context 2048 tokens"), std::string::npos);
  EXPECT_NE(table.find("average               75.0       30.0"), std::string::npos) << table;
  EXPECT_NE(table.find("qa_1, qa_2: not available"), std::string::npos);
  // A long variant name gets a column of its own width, two spaces from the previous one.
  EvalReport variant = report;
  for (QuestionOutcome& q : variant.questions) q.outputs[1].policy = "streaming:budget=1024";
  variant.settings.policies[1].label = "streaming:budget=1024";
  const std::string wide = FormatTables(variant);
  EXPECT_NE(wide.find("full  streaming:budget=1024"), std::string::npos) << wide;
  EXPECT_NE(wide.find("average               75.0                   30.0"), std::string::npos)
      << wide;

  const auto json = ReportToJson(report);
  EXPECT_EQ(json["scores"]["2048"]["vt"]["streaming"], 10.0);
  EXPECT_TRUE(json["scores"]["4096"]["vt"]["full"].is_null());
  EXPECT_EQ(json["settings"]["policies"][1]["budget_tokens_at_length"]["4096"], 300);
  EXPECT_TRUE(json["settings"]["policies"][0]["budget_tokens_at_length"]["4096"].is_null());
  EXPECT_EQ(json["settings"]["policies"][1]["config"]["budget_tokens"], 300);
  EXPECT_EQ(json["model"]["path"], "/models/m.gguf");
  // Keys keep the run's order (not alphabetical): tasks, then the average.
  std::vector<std::string> rows;
  for (const auto& [key, value] : json["scores"]["2048"].items()) rows.push_back(key);
  EXPECT_EQ(rows, (std::vector<std::string>{"niah_single_1", "vt", "average"}));

  const std::string csv = ReportToCsv(report);
  EXPECT_NE(csv.find("tasks,\"/models/m.gguf\",exact,7,2,2048,\"vt\",streaming,300,10.00,2,"),
            std::string::npos)
      << csv;
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 2 * 2 * 3);
}

TEST(ReportTest, GridRowsAreDepthsAndTheJsonHasAMatrixPerPolicy) {
  EvalReport report = TwoPolicies(EvalMode::kNiahGrid);
  report.settings.tasks = {"niah_single_2"};
  report.questions = {Question("niah_single_2", 2048, {1.0, 1.0}, 0.0),
                      Question("niah_single_2", 2048, {1.0, 0.0}, 50.0),
                      Question("niah_single_2", 4096, {0.0, 1.0}, 0.0),
                      Question("niah_single_2", 4096, {1.0, 0.0}, 50.0)};
  const auto json = ReportToJson(report);
  EXPECT_EQ(json["grid"]["depths"], (std::vector<double>{0.0, 50.0}));
  EXPECT_EQ(json["grid"]["lengths"], (std::vector<int64_t>{2048, 4096}));
  // [length][depth]
  EXPECT_EQ(json["grid"]["scores"]["streaming"][0][1], 0.0);
  EXPECT_EQ(json["grid"]["scores"]["streaming"][1][0], 100.0);
  EXPECT_NE(FormatTables(report).find("depth 50%"), std::string::npos);
}

TEST(ReportTest, MultiTurnRowsAreTurns) {
  EvalReport report = TwoPolicies(EvalMode::kMultiTurn);
  report.questions = {Question("niah_multi_turn", 2048, {1.0, 1.0}, 10, 1),
                      Question("niah_multi_turn", 2048, {1.0, 0.0}, 60, 2)};
  const ScoreSummary s = Summarize(report);
  EXPECT_EQ(s.rows, (std::vector<std::string>{"turn 1", "turn 2"}));
  EXPECT_EQ(s.row_values, (std::vector<double>{1, 2}));
  const auto json = ReportToJson(report);
  EXPECT_EQ(json["turns"]["scores"]["streaming"][0][1], 0.0);
}

}  // namespace
}  // namespace shadowkv::eval
