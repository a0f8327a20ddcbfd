// Report summaries on hand-made outcomes: means per row and policy, averages, bootstrap
// intervals, paired differences, attended tokens; table, JSON, CSV.
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
  const char* names[] = {"full", "streaming", "snapkv"};
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
  // Intervals by hand: full's vt {40, 60} resamples to 40, 50 or 60 beside a constant 100, so
  // its average is 70, 75 or 80; streaming's rows {0, 100} and {0, 20} reach 0 and 60; the
  // paired differences {-100, 0} and {-40, -40} reach -70 and -20.
  EXPECT_NE(table.find("average              75.0 [70.0, 80.0]      30.0 [0.0, 60.0]"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("average - full                       -  -45.0 [-70.0, -20.0]"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("vt                   50.0 [40.0, 60.0]      10.0 [0.0, 20.0]"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("percentile bootstrap over the questions, 2000 resamples"),
            std::string::npos);
  EXPECT_NE(table.find("attended tokens per query and layer: not reported"), std::string::npos);
  EXPECT_NE(table.find("qa_1, qa_2: not available"), std::string::npos);
  // A long variant name gets a column of its own width, two spaces from the previous one.
  EvalReport variant = report;
  for (QuestionOutcome& q : variant.questions) q.outputs[1].policy = "streaming:budget=1024";
  variant.settings.policies[1].label = "streaming:budget=1024";
  const std::string wide = FormatTables(variant);
  EXPECT_NE(wide.find("full  streaming:budget=1024"), std::string::npos) << wide;
  EXPECT_NE(wide.find("average              75.0 [70.0, 80.0]       30.0 [0.0, 60.0]"),
            std::string::npos)
      << wide;

  const auto json = ReportToJson(report);
  EXPECT_EQ(json["scores"]["2048"]["vt"]["streaming"], 10.0);
  EXPECT_TRUE(json["scores"]["4096"]["vt"]["full"].is_null());
  EXPECT_EQ(json["settings"]["policies"][1]["budget_tokens_at_length"]["4096"], 300);
  EXPECT_TRUE(json["settings"]["policies"][0]["budget_tokens_at_length"]["4096"].is_null());
  EXPECT_EQ(json["settings"]["policies"][1]["config"]["budget_tokens"], 300);
  EXPECT_EQ(json["model"]["path"], "/models/m.gguf");
  EXPECT_EQ(json["intervals"]["2048"]["average"]["full"], (std::vector<double>{70.0, 80.0}));
  EXPECT_EQ(json["intervals"]["2048"]["vt"]["streaming"], (std::vector<double>{0.0, 20.0}));
  EXPECT_TRUE(json["intervals"]["4096"]["vt"]["full"].is_null());
  EXPECT_EQ(json["differences"]["baseline"], "full");
  const auto& difference = json["differences"]["scores"]["2048"]["average"]["streaming"];
  EXPECT_EQ(difference["mean"], -45.0);
  EXPECT_EQ(difference["interval"], (std::vector<double>{-70.0, -20.0}));
  EXPECT_FALSE(json["differences"]["scores"]["2048"]["average"].contains("full"));
  EXPECT_EQ(json["settings"]["bootstrap"]["resamples"], 2000);
  EXPECT_TRUE(json["attended_tokens_per_query"]["2048"]["streaming"].is_null());
  // Keys keep the run's order (not alphabetical): tasks, then the average.
  std::vector<std::string> rows;
  for (const auto& [key, value] : json["scores"]["2048"].items()) rows.push_back(key);
  EXPECT_EQ(rows, (std::vector<std::string>{"niah_single_1", "vt", "average"}));

  const std::string csv = ReportToCsv(report);
  EXPECT_NE(csv.find("tasks,\"/models/m.gguf\",exact,7,2,2048,\"vt\",streaming,300,10.00,2,0.00,"
                     "20.00,-40.00,-40.00,-40.00,,\"budget=300;"),
            std::string::npos)
      << csv;
  EXPECT_NE(csv.find(",2048,\"average\",full,,75.00,4,70.00,80.00,,,,,"), std::string::npos) << csv;
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 2 * 2 * 3);
}

TEST(ReportTest, APolicyAnsweringAsTheFirstDiffersByExactlyZero) {
  EvalReport report = TwoPolicies(EvalMode::kTasks);
  report.questions = {Question("vt", 2048, {1.0, 1.0}), Question("vt", 2048, {0.0, 0.0}),
                      Question("vt", 2048, {0.5, 0.5}), Question("qa", 2048, {0.25, 0.25}),
                      Question("qa", 2048, {1.0, 1.0})};
  const ScoreSummary s = Summarize(report);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(s.differences[0][r][1], 0.0);
    EXPECT_EQ(s.difference_intervals[0][r][1].low, 0.0);
    EXPECT_EQ(s.difference_intervals[0][r][1].high, 0.0);
    EXPECT_TRUE(std::isnan(s.differences[0][r][0]));  // the first policy has none
  }
  EXPECT_EQ(s.average_difference_intervals[0][1].low, 0.0);
  EXPECT_EQ(s.average_difference_intervals[0][1].high, 0.0);
  // The two policies draw the same resamples, so equal answers give equal intervals.
  EXPECT_EQ(s.intervals[0][0][0].low, s.intervals[0][0][1].low);
  EXPECT_EQ(s.average_intervals[0][0].high, s.average_intervals[0][1].high);
  EXPECT_LT(s.intervals[0][0][0].low, s.scores[0][0][0]);
  EXPECT_GT(s.intervals[0][0][0].high, s.scores[0][0][0]);
  // The intervals are drawn from the report's seed: the same report, the same intervals.
  const Interval row = BootstrapMeanOfMeans({{100, 0, 50}}, BootstrapSeed(7, 2048, "vt"));
  EXPECT_EQ(s.intervals[0][0][0].low, row.low);
  EXPECT_EQ(s.intervals[0][0][0].high, row.high);
  const Interval average =
      BootstrapMeanOfMeans({{100, 0, 50}, {25, 100}}, BootstrapSeed(7, 2048, ""));
  EXPECT_EQ(s.average_intervals[0][0].low, average.low);
  EXPECT_EQ(s.average_intervals[0][0].high, average.high);
  EXPECT_EQ(FormatTables(report), FormatTables(report));
}

TEST(ReportTest, AttendedTokensPerQueryAreShownPerPolicyAndTheSparseSpreadIsStated) {
  EvalReport report = TwoPolicies(EvalMode::kTasks);
  kv::KvPolicyConfig snap;
  snap.policy = "snapkv";
  snap.budget_tokens = 300;
  report.settings.policies.push_back(snap);
  // Per question: attended tokens summed over prepare calls (layers x decode steps).
  auto with_stats = [](QuestionOutcome q, std::vector<int64_t> attended) {
    for (size_t p = 0; p < q.outputs.size(); ++p) {
      q.outputs[p].stats.prepare_calls = 10;
      q.outputs[p].stats.context_tokens = 20000;
      q.outputs[p].stats.attended_tokens = attended[p];
    }
    return q;
  };
  report.questions = {with_stats(Question("vt", 2048, {1.0, 1.0, 0.0}), {20000, 3000, 3200}),
                      with_stats(Question("vt", 2048, {1.0, 0.0, 1.0}), {20000, 3000, 3400})};
  const ScoreSummary s = Summarize(report);
  EXPECT_DOUBLE_EQ(s.attended_tokens[0][0], 2000.0);
  EXPECT_DOUBLE_EQ(s.attended_tokens[0][1], 300.0);
  EXPECT_DOUBLE_EQ(s.attended_tokens[0][2], 330.0);
  const std::string table = FormatTables(report);
  EXPECT_NE(table.find("attended tokens per query and layer (mean over questions): full 2000.0, "
                       "streaming 300.0, snapkv 330.0"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("sparse policies attend 300.0 to 330.0 tokens (the most 10.0% above the "
                       "least)"),
            std::string::npos)
      << table;
  const auto json = ReportToJson(report);
  EXPECT_EQ(json["attended_tokens_per_query"]["2048"]["snapkv"], 330.0);
  EXPECT_EQ(json["questions"][1]["outputs"][2]["attended_tokens_per_query"], 340.0);
  EXPECT_NE(ReportToCsv(report).find(",\"vt\",snapkv,300,50.00,2,"), std::string::npos);
  EXPECT_NE(ReportToCsv(report).find(",330.00,\"budget=300;"), std::string::npos);
}

TEST(ReportTest, FastTierBytesPerTokenAndLayerRanksAreReported) {
  EvalReport report = TwoPolicies(EvalMode::kTasks);
  kv::KvPolicyConfig shadow;
  shadow.policy = "shadowkv";
  shadow.label = "shadowkv:rank_energy=0.9";
  report.settings.policies = {report.settings.policies[0], shadow};
  auto with_memory = [](QuestionOutcome q, std::vector<int> ranks, int64_t shadow_bytes) {
    q.outputs[0].memory.fast_bytes = 4000;
    q.outputs[0].kv_tokens = 1000;
    q.outputs[1].policy = "shadowkv:rank_energy=0.9";
    q.outputs[1].memory.fast_bytes = shadow_bytes;
    q.outputs[1].memory.slow_bytes = 3000;
    q.outputs[1].kv_tokens = 1000;
    q.outputs[1].layer_ranks = ranks;
    q.outputs[1].rank = ranks[0];
    return q;
  };
  report.questions = {with_memory(Question("vt", 2048, {1.0, 1.0}), {8, 16, 24}, 1000),
                      // a layer kept exact (rank 0) is left out of the spread
                      with_memory(Question("vt", 2048, {1.0, 0.0}), {0, 16, 16, 40}, 1500)};
  const ScoreSummary s = Summarize(report);
  EXPECT_DOUBLE_EQ(s.fast_bytes_per_token[0][0], 4.0);
  EXPECT_DOUBLE_EQ(s.fast_bytes_per_token[0][1], 1.25);
  EXPECT_DOUBLE_EQ(s.slow_bytes_per_token[0][1], 3.0);
  EXPECT_TRUE(std::isnan(s.slow_bytes_per_token[0][0]));  // full attention keeps no slow tier
  EXPECT_DOUBLE_EQ(s.ranks[0][1].min, 8.0);
  EXPECT_DOUBLE_EQ(s.ranks[0][1].mean, 20.0);
  EXPECT_DOUBLE_EQ(s.ranks[0][1].max, 40.0);
  EXPECT_TRUE(std::isnan(s.ranks[0][0].mean));  // full attention has no rank
  const std::string table = FormatTables(report);
  EXPECT_NE(table.find("fast-tier KV bytes per token (mean over questions): full 4, "
                       "shadowkv:rank_energy=0.9 1"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("slow-tier KV bytes per token (mean over questions): "
                       "shadowkv:rank_energy=0.9 3\n"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("key rank per layer (min/mean/max over compressed layers and questions): "
                       "shadowkv:rank_energy=0.9 8/20.0/40"),
            std::string::npos)
      << table;
  const auto json = ReportToJson(report);
  EXPECT_EQ(json["questions"][1]["outputs"][1]["layer_ranks"], nlohmann::json({0, 16, 16, 40}));
  EXPECT_EQ(json["questions"][1]["outputs"][1]["kv_fast_bytes_per_token"], 1.5);
  EXPECT_FALSE(json["questions"][0]["outputs"][0].contains("layer_ranks"));
  EXPECT_EQ(json["settings"]["policies"][1]["resolved_on_first_question"]["2048"]["layer_ranks"],
            nlohmann::json({8, 16, 24}));
}

TEST(ReportTest, AnAnswerEndingInsideACharacterStillMakesValidJson) {
  EvalReport report = TwoPolicies(EvalMode::kTasks);
  report.model_path = "/models/\xFFm.gguf";
  report.questions = {Question("vt", 2048, {0.0, 0.0})};
  report.questions[0].outputs[0].text = "ab\xE2\x82";    // "€" cut after two of its three bytes
  report.questions[0].outputs[1].text = "\xC3\xA9\x80";  // "é", then a stray continuation
  const auto json = ReportToJson(report);
  std::string dumped;
  EXPECT_NO_THROW(dumped = json.dump(1));
  EXPECT_EQ(json["questions"][0]["outputs"][0]["text"], "ab\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(json["questions"][0]["outputs"][1]["text"], "\xC3\xA9\xEF\xBF\xBD");
  EXPECT_EQ(json["model"]["path"], "/models/\xEF\xBF\xBDm.gguf");
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
