// scripts/eval_table.py re-tables a report JSON from a tiny eval with the intervals, paired
// differences and attended tokens the C++ summary gives, and joins the policies of two reports
// of the same questions.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "eval/report.h"
#include "eval/runner.h"
#include "model/cpu_model.h"
#include "tiny_model.h"

namespace shadowkv {
namespace {

eval::EssayCorpus Corpus() {
  eval::EssayCorpus corpus;
  corpus.source = "test";
  const char* words[] = {"stone", "water", "light", "cloud", "field", "river", "paper", "glass"};
  for (int s = 0; s < 600; ++s) {
    for (int w = 0; w < 7; ++w) corpus.words.push_back(words[(s * 5 + w * 3) % 8]);
    corpus.words.back() += ".";
  }
  return corpus;
}

// Runs `command` and returns its standard output; fails the test on a non-zero exit.
std::string Capture(const std::string& command) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  EXPECT_EQ(pclose(pipe), 0) << command;
  return out;
}

void ExpectInterval(const nlohmann::json& got, const eval::Interval& want, const std::string& at) {
  ASSERT_TRUE(got.is_array()) << at << ": " << got.dump();
  EXPECT_DOUBLE_EQ(got[0].get<double>(), want.low) << at;
  EXPECT_DOUBLE_EQ(got[1].get<double>(), want.high) << at;
}

TEST(EvalTableScriptTest, ReproducesTheEvalsIntervalsFromItsJson) {
  testing::TinyModelSpec spec;
  spec.layers = 2;
  spec.context = 2048;
  spec.seed = 5;
  auto model = CpuModel::Load(testing::WriteTinyModel(spec, "eval_table"), 1).value();
  const eval::EssayCorpus corpus = Corpus();
  const std::vector<std::string> vocabulary = {"alpha", "bravo", "delta", "gamma", "kappa"};
  const eval::PromptFormat format = eval::PromptFormat::Chat({ChatFormat::kChatML, ""});
  const eval::TaskContext tasks = eval::MakeTaskContext(*model, format, &corpus, &vocabulary);
  eval::EvalSettings settings;
  settings.tasks = {"niah_single_2", "passkey"};
  settings.lengths = {1200};
  settings.samples = 4;
  settings.seed = 17;
  for (const char* name : {"full", "streaming", "snapkv"}) {
    kv::KvPolicyConfig c;
    c.policy = name;
    c.budget_min_tokens = 64;
    settings.policies.push_back(c);
  }
  auto report = eval::RunEval(*model, format, tasks, settings);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  // A random tiny model answers nothing right; a fixed spread of scores gives the intervals
  // width, so that the script has to draw the same resamples to agree.
  int i = 0;
  for (eval::QuestionOutcome& q : report->questions) {
    for (size_t p = 0; p < q.outputs.size(); ++p)
      q.outputs[p].score = ((i * 37 + p * 11) % 17) / 16.0;
    i++;
  }
  const std::string path =
      ::testing::TempDir() + "/eval_table_" + std::to_string(static_cast<long>(getpid())) + ".json";
  std::ofstream(path) << eval::ReportToJson(*report).dump(1);
  const std::string script = std::string(SHADOWKV_SOURCE_DIR) + "/scripts/eval_table.py";
  const auto got = nlohmann::json::parse(Capture("python3 '" + script + "' --json '" + path + "'"));

  const eval::ScoreSummary s = eval::Summarize(*report);
  ASSERT_EQ(s.lengths.size(), 1u);
  const auto& table = got["1200"];
  const auto& rows = table["rows"];
  ASSERT_EQ(rows.size(), s.rows.size() + 1) << got.dump();
  int nonzero_widths = 0;
  for (size_t p = 0; p < s.policies.size(); ++p) {
    const std::string& policy = s.policies[p];
    for (size_t r = 0; r <= s.rows.size(); ++r) {
      const bool average = r == s.rows.size();
      const std::string row = average ? "average" : s.rows[r];
      const auto& c = rows[row][policy];
      const std::string at = row + "/" + policy;
      EXPECT_DOUBLE_EQ(c["mean"].get<double>(), average ? s.averages[0][p] : s.scores[0][r][p]);
      const eval::Interval& ci = average ? s.average_intervals[0][p] : s.intervals[0][r][p];
      ExpectInterval(c["interval"], ci, at);
      nonzero_widths += ci.high > ci.low;
      if (p == 0) {
        EXPECT_FALSE(c.contains("difference")) << at;
        continue;
      }
      EXPECT_DOUBLE_EQ(c["difference"]["mean"].get<double>(),
                       average ? s.average_differences[0][p] : s.differences[0][r][p]);
      ExpectInterval(
          c["difference"]["interval"],
          average ? s.average_difference_intervals[0][p] : s.difference_intervals[0][r][p],
          at + " difference");
    }
    ASSERT_FALSE(std::isnan(s.attended_tokens[0][p])) << policy;
    EXPECT_NEAR(table["attended_tokens_per_query"][policy].get<double>(), s.attended_tokens[0][p],
                1e-9 * s.attended_tokens[0][p]);
  }
  EXPECT_GT(nonzero_widths, 4);
  // The sparse policies read fewer tokens than full on these prompts.
  EXPECT_LT(s.attended_tokens[0][1], s.attended_tokens[0][0]);

  // The same questions split over two reports (full and streaming in one, snapkv in a later
  // run of the same seed) join into the one table.
  eval::EvalReport first = *report, second = *report;
  first.settings.policies.resize(2);
  second.settings.policies.erase(second.settings.policies.begin(),
                                 second.settings.policies.begin() + 2);
  for (size_t q = 0; q < report->questions.size(); ++q) {
    first.questions[q].outputs.resize(2);
    second.questions[q].outputs.erase(second.questions[q].outputs.begin(),
                                      second.questions[q].outputs.begin() + 2);
  }
  const std::string first_path = path + ".first.json", second_path = path + ".second.json";
  std::ofstream(first_path) << eval::ReportToJson(first).dump(1);
  std::ofstream(second_path) << eval::ReportToJson(second).dump(1);
  const auto joined = nlohmann::json::parse(
      Capture("python3 '" + script + "' --json '" + first_path + "' '" + second_path + "'"));
  EXPECT_EQ(joined, got);
  // A policy both reports ran counts once where it answered the same; a different answer fails.
  const auto repeated = nlohmann::json::parse(
      Capture("python3 '" + script + "' --json '" + path + "' '" + second_path + "'"));
  EXPECT_EQ(repeated, got);
  eval::EvalReport changed = second;
  changed.questions[0].outputs[0].text += " (changed)";
  const std::string changed_path = path + ".changed.json";
  std::ofstream(changed_path) << eval::ReportToJson(changed).dump(1);
  FILE* twice = popen(("python3 '" + script + "' --json '" + path + "' '" + changed_path +
                       "' 2>/dev/null").c_str(), "r");
  ASSERT_NE(twice, nullptr);
  char sink[4096];
  while (std::fread(sink, 1, sizeof(sink), twice) > 0) {
  }
  EXPECT_NE(pclose(twice), 0) << "snapkv answering the same question differently was accepted";
  std::remove(changed_path.c_str());
  std::remove(first_path.c_str());
  std::remove(second_path.c_str());

  // --baseline streaming: the paired differences against streaming, as the eval gives them when
  // streaming is its first policy (the resamples depend on the seed and the questions only).
  const auto against = nlohmann::json::parse(Capture("python3 '" + script +
                                                     "' --json --baseline streaming '" + path + "'"));
  std::rotate(report->settings.policies.begin(), report->settings.policies.begin() + 1,
              report->settings.policies.end());
  for (eval::QuestionOutcome& q : report->questions) {
    std::rotate(q.outputs.begin(), q.outputs.begin() + 1, q.outputs.end());
  }
  const eval::ScoreSummary b = eval::Summarize(*report);
  ASSERT_EQ(b.policies[0], "streaming");
  for (size_t p = 0; p < b.policies.size(); ++p) {
    const std::string& policy = b.policies[p];
    for (size_t r = 0; r <= b.rows.size(); ++r) {
      const bool average = r == b.rows.size();
      const std::string row = average ? "average" : b.rows[r];
      const auto& c = against["1200"]["rows"][row][policy];
      const std::string at = row + "/" + policy + " against streaming";
      if (p == 0) {
        EXPECT_FALSE(c.contains("difference")) << at;
        continue;
      }
      EXPECT_DOUBLE_EQ(c["difference"]["mean"].get<double>(),
                       average ? b.average_differences[0][p] : b.differences[0][r][p])
          << at;
      ExpectInterval(
          c["difference"]["interval"],
          average ? b.average_difference_intervals[0][p] : b.difference_intervals[0][r][p],
          at + " difference");
    }
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace shadowkv
