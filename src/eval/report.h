// Eval reports: mean scores per context length, row (task, needle depth or turn) and policy
// with bootstrap intervals, as text tables, JSON (settings, summaries, every answer) and CSV.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "eval/bootstrap.h"
#include "eval/runner.h"

namespace shadowkv::eval {

struct ScoreSummary {
  std::vector<int64_t> lengths;
  std::vector<std::string> rows;   // task names, "depth 50%" or "turn 2", in run order
  std::vector<double> row_values;  // the depth or turn of each row (tasks: 0)
  std::vector<std::string> policies;
  // Mean score in percent, [length][row][policy]; NaN where nothing was asked.
  std::vector<std::vector<std::vector<double>>> scores;
  std::vector<std::vector<std::vector<int>>> counts;  // questions behind each mean
  // Mean over the rows that have a score, [length][policy] (RULER's average over tasks).
  std::vector<std::vector<double>> averages;
  // 95% bootstrap intervals of `scores` and `averages` (bootstrap.h; the average's resamples
  // stay within each row). Seeded from the report's seed: the same report, the same intervals.
  std::vector<std::vector<std::vector<Interval>>> intervals;
  std::vector<std::vector<Interval>> average_intervals;
  // Each policy minus the first on the questions both answered (points), with its paired
  // interval; the first policy's own entry is NaN. Shapes as `scores` and `averages`.
  std::vector<std::vector<std::vector<double>>> differences;
  std::vector<std::vector<std::vector<Interval>>> difference_intervals;
  std::vector<std::vector<double>> average_differences;
  std::vector<std::vector<Interval>> average_difference_intervals;
  // Tokens each decode query read per layer (PolicyStats attended / prepare calls), mean over
  // questions, [length][policy]; NaN where the backend reports no attended tokens.
  std::vector<std::vector<double>> attended_tokens;
  // Fast-tier KV bytes per token the sequence held (PolicyOutput memory / kv_tokens), mean over
  // questions, [length][policy]; NaN where the backend reports no memory.
  std::vector<std::vector<double>> fast_bytes_per_token;
  // The same for the slow tier (ShadowKV's value store, and its exact keys with exact_keys);
  // NaN where a policy keeps none.
  std::vector<std::vector<double>> slow_bytes_per_token;
  // The layers' ranks (PolicyOutput::layer_ranks) over every layer and question, [length][policy];
  // NaN where no rank was reported (not ShadowKV, or a backend without them).
  struct RankSpread {
    double min = std::numeric_limits<double>::quiet_NaN();
    double mean = min, max = min;
  };
  std::vector<std::vector<RankSpread>> ranks;
  // EvalSettings::fidelity: over every teacher-forced step along the first policy's answers,
  // the share (percent) whose top token is the first policy's, and the mean KL divergence from
  // the first policy's distribution (nats), [length][policy]; NaN where not measured.
  std::vector<std::vector<double>> same_top;
  std::vector<std::vector<double>> mean_kl;
  std::vector<std::vector<int64_t>> fidelity_steps;
};

// A policy output's attended tokens per decode query and layer; NaN where not reported.
double AttendedTokensPerQuery(const PolicyOutput& output);

ScoreSummary Summarize(const EvalReport& report);

// One table per context length: rows as above plus "average", one column per policy.
std::string FormatTables(const EvalReport& report);

// Everything: settings (model, KV settings with budgets resolved per length, samples, seed),
// the summary, the grid (niah_grid mode), and each question with every policy's answer.
// Keys keep their order (tasks and policies as run).
nlohmann::ordered_json ReportToJson(const EvalReport& report);

// One line per (length, row, policy) including the averages, with the settings in columns.
std::string ReportToCsv(const EvalReport& report);

}  // namespace shadowkv::eval
