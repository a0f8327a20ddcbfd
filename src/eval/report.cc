// Eval report summaries and their text, JSON and CSV forms.
#include "eval/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace shadowkv::eval {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string RowLabel(EvalMode mode, const QuestionOutcome& q) {
  switch (mode) {
    case EvalMode::kTasks:
      return q.task;
    case EvalMode::kNiahGrid:
      return fmt::format("depth {:g}%", q.depth);
    case EvalMode::kMultiTurn:
      return fmt::format("turn {}", q.turn);
  }
  return "";
}

double RowValue(EvalMode mode, const QuestionOutcome& q) {
  return mode == EvalMode::kNiahGrid ? q.depth : mode == EvalMode::kMultiTurn ? q.turn : 0.0;
}

nlohmann::ordered_json KvConfigJson(const kv::KvPolicyConfig& c) {
  return {{"policy", c.policy},
          {"label", c.display_name()},
          {"budget_tokens", c.budget_tokens},
          {"budget_fraction", c.budget_fraction},
          {"budget_min_tokens", c.budget_min_tokens},
          {"chunk_size", c.chunk_size},
          {"rank", c.rank},
          {"rank_ratio", c.rank_ratio},
          {"outlier_chunks", c.outlier_chunks},
          {"local_window", c.local_window},
          {"value_store_path", c.value_store_path},
          {"snap_window", c.snap_window},
          {"snap_kernel", c.snap_kernel},
          {"snap_pooling", c.snap_pooling},
          {"quest_page_size", c.quest_page_size},
          {"quest_dense_layers", c.quest_dense_layers},
          {"sink_tokens", c.sink_tokens}};
}

std::string KvConfigText(const kv::KvPolicyConfig& c) {
  return fmt::format(
      "budget={};fraction={};min={};chunk={};rank={};rank_ratio={:.4f};outliers={};window={};"
      "snap_window={};snap_kernel={};snap_pooling={};page={};dense_layers={};sinks={}",
      c.budget_tokens, c.budget_fraction, c.budget_min_tokens, c.chunk_size, c.rank, c.rank_ratio,
      c.outlier_chunks, c.local_window, c.snap_window, c.snap_kernel, c.snap_pooling,
      c.quest_page_size, c.quest_dense_layers, c.sink_tokens);
}

// JSON number, or null for NaN.
nlohmann::ordered_json Number(double value) {
  return std::isnan(value) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(value);
}

}  // namespace

ScoreSummary Summarize(const EvalReport& report) {
  const EvalMode mode = report.settings.mode;
  ScoreSummary s;
  for (const auto& config : report.settings.policies) s.policies.push_back(config.display_name());
  std::map<int64_t, size_t> length_index;
  std::map<std::string, size_t> row_index;
  for (const QuestionOutcome& q : report.questions) {
    if (!length_index.contains(q.length)) {
      length_index[q.length] = s.lengths.size();
      s.lengths.push_back(q.length);
    }
    const std::string label = RowLabel(mode, q);
    if (!row_index.contains(label)) {
      row_index[label] = s.rows.size();
      s.rows.push_back(label);
      s.row_values.push_back(RowValue(mode, q));
    }
  }
  const size_t num_policies = s.policies.size();
  std::vector<std::vector<std::vector<double>>> sums(
      s.lengths.size(),
      std::vector<std::vector<double>>(s.rows.size(), std::vector<double>(num_policies, 0.0)));
  s.counts.assign(s.lengths.size(),
                  std::vector<std::vector<int>>(s.rows.size(), std::vector<int>(num_policies, 0)));
  for (const QuestionOutcome& q : report.questions) {
    const size_t l = length_index[q.length], r = row_index[RowLabel(mode, q)];
    for (size_t p = 0; p < q.outputs.size() && p < num_policies; ++p) {
      sums[l][r][p] += 100.0 * q.outputs[p].score;
      s.counts[l][r][p]++;
    }
  }
  s.scores = sums;
  s.averages.assign(s.lengths.size(), std::vector<double>(num_policies, kNaN));
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    for (size_t p = 0; p < num_policies; ++p) {
      double total = 0;
      int rows = 0;
      for (size_t r = 0; r < s.rows.size(); ++r) {
        const int count = s.counts[l][r][p];
        s.scores[l][r][p] = count ? sums[l][r][p] / count : kNaN;
        if (count) {
          total += s.scores[l][r][p];
          rows++;
        }
      }
      if (rows) s.averages[l][p] = total / rows;
    }
  }
  return s;
}

std::string FormatTables(const EvalReport& report) {
  const ScoreSummary s = Summarize(report);
  const char* row_title = report.settings.mode == EvalMode::kTasks      ? "task"
                          : report.settings.mode == EvalMode::kNiahGrid ? "needle depth"
                                                                        : "question";
  size_t width = std::string_view(row_title).size();
  for (const auto& row : s.rows) width = std::max(width, row.size());
  width = std::max<size_t>(width, 7) + 2;
  std::string out;
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    out += fmt::format("context {} tokens (prompt + answer), {} sample(s) per row, score %:\n",
                       s.lengths[l], report.settings.samples);
    // Each column as wide as its policy's name (variants such as shadowkv:budget=1024 are
    // long), at least 11, with two spaces before it.
    std::vector<size_t> columns;
    out += fmt::format("{:<{}}", row_title, width);
    for (const auto& policy : s.policies) {
      columns.push_back(std::max<size_t>(11, policy.size() + 2));
      out += fmt::format("{:>{}}", policy, columns.back());
    }
    out += "\n";
    auto add_row = [&](const std::string& label, const std::vector<double>& values) {
      out += fmt::format("{:<{}}", label, width);
      for (size_t p = 0; p < values.size(); ++p) {
        const double v = values[p];
        out += std::isnan(v) ? fmt::format("{:>{}}", "-", columns[p])
                             : fmt::format("{:>{}.1f}", v, columns[p]);
      }
      out += "\n";
    };
    for (size_t r = 0; r < s.rows.size(); ++r) add_row(s.rows[r], s.scores[l][r]);
    add_row("average", s.averages[l]);
    out += "\n";
  }
  if (report.settings.mode == EvalMode::kTasks) out += std::string(kUnavailableTasksNote) + "\n";
  return out;
}

nlohmann::ordered_json ReportToJson(const EvalReport& report) {
  const EvalSettings& st = report.settings;
  const ScoreSummary s = Summarize(report);
  nlohmann::ordered_json policies = nlohmann::ordered_json::array();
  for (size_t p = 0; p < st.policies.size(); ++p) {
    const kv::KvPolicyConfig& config = st.policies[p];
    nlohmann::ordered_json budgets = nlohmann::ordered_json::object();
    nlohmann::ordered_json resolved = nlohmann::ordered_json::object();
    for (int64_t length : st.lengths) {
      budgets[std::to_string(length)] = config.policy == "full"
                                            ? nlohmann::ordered_json(nullptr)
                                            : nlohmann::ordered_json(config.BudgetTokens(length));
      // What the policy really used on the first question at this length.
      for (const QuestionOutcome& q : report.questions) {
        if (q.length != length || p >= q.outputs.size()) continue;
        const PolicyOutput& o = q.outputs[p];
        nlohmann::ordered_json used = {{"prompt_tokens", q.prompt_tokens}};
        if (config.policy != "full") used["budget_tokens"] = o.budget_tokens;
        if (o.rank > 0) {
          used["rank"] = o.rank;
          used["outlier_chunks_per_kv_head"] = o.outlier_chunks;
        }
        resolved[std::to_string(length)] = used;
        break;
      }
    }
    policies.push_back({{"name", config.display_name()},
                        {"config", KvConfigJson(config)},
                        {"budget_tokens_at_length", budgets},
                        {"resolved_on_first_question", resolved}});
  }
  nlohmann::ordered_json settings = {{"mode", EvalModeName(st.mode)},
                                     {"tasks", st.tasks},
                                     {"lengths", st.lengths},
                                     {"samples", st.samples},
                                     {"seed", st.seed},
                                     {"prefill_chunk", st.prefill_chunk},
                                     {"prompt_format", report.prompt_format},
                                     {"haystack", report.haystack_source},
                                     {"decoding", "greedy"},
                                     {"policies", policies}};
  if (st.mode == EvalMode::kTasks)
    settings["depth"] =
        st.depth < 0 ? nlohmann::ordered_json("random") : nlohmann::ordered_json(st.depth);
  if (st.mode == EvalMode::kNiahGrid) settings["grid_depths"] = st.grid_depths;
  if (st.mode == EvalMode::kMultiTurn) settings["turns"] = st.turns;

  nlohmann::ordered_json scores = nlohmann::ordered_json::object();
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    nlohmann::ordered_json by_row = nlohmann::ordered_json::object();
    for (size_t r = 0; r < s.rows.size(); ++r) {
      nlohmann::ordered_json by_policy = nlohmann::ordered_json::object();
      for (size_t p = 0; p < s.policies.size(); ++p) {
        by_policy[s.policies[p]] = Number(s.scores[l][r][p]);
      }
      by_row[s.rows[r]] = by_policy;
    }
    nlohmann::ordered_json average = nlohmann::ordered_json::object();
    for (size_t p = 0; p < s.policies.size(); ++p)
      average[s.policies[p]] = Number(s.averages[l][p]);
    by_row["average"] = average;
    scores[std::to_string(s.lengths[l])] = by_row;
  }

  nlohmann::ordered_json questions = nlohmann::ordered_json::array();
  for (const QuestionOutcome& q : report.questions) {
    nlohmann::ordered_json outputs = nlohmann::ordered_json::array();
    for (const PolicyOutput& o : q.outputs) {
      nlohmann::ordered_json out = {
          {"policy", o.policy},
          {"text", o.text},
          {"score", o.score},
          {"generated_tokens", o.generated_tokens},
          {"truncated", o.truncated},
          {"kv_fast_bytes", o.memory.fast_bytes},
          {"kv_slow_bytes", o.memory.slow_bytes},
          {"attended_fraction",
           o.stats.context_tokens
               ? static_cast<double>(o.stats.attended_tokens) / o.stats.context_tokens
               : 1.0}};
      if (o.policy != "full") out["budget_tokens"] = o.budget_tokens;
      if (o.stats.chunk_selections > 0) out["chunk_hit_rate"] = o.stats.hit_rate();
      outputs.push_back(out);
    }
    nlohmann::ordered_json item = {{"task", q.task},
                                   {"length", q.length},
                                   {"sample", q.index},
                                   {"prompt_tokens", q.prompt_tokens},
                                   {"answers", q.answers},
                                   {"outputs", outputs},
                                   {"prefill_seconds", q.prefill_seconds},
                                   {"decode_seconds", q.decode_seconds}};
    if (q.turn > 0) item["turn"] = q.turn;
    if (q.depth >= 0) item["depth"] = q.depth;
    questions.push_back(item);
  }

  nlohmann::ordered_json out = {{"model",
                                 {{"path", report.model_path},
                                  {"summary", report.model_summary},
                                  {"numerics", report.numerics}}},
                                {"settings", settings},
                                {"scores", scores},
                                {"questions", questions},
                                {"seconds", report.seconds}};
  if (!report.model_sha256.empty()) out["model"]["sha256"] = report.model_sha256;
  if (st.mode == EvalMode::kTasks) out["unavailable"] = std::string(kUnavailableTasksNote);
  if (st.mode != EvalMode::kTasks) {
    // Per policy a [length][row] matrix for plotting (rows: depths or turns).
    nlohmann::ordered_json matrix = nlohmann::ordered_json::object();
    for (size_t p = 0; p < s.policies.size(); ++p) {
      nlohmann::ordered_json rows = nlohmann::ordered_json::array();
      for (size_t l = 0; l < s.lengths.size(); ++l) {
        nlohmann::ordered_json row = nlohmann::ordered_json::array();
        for (size_t r = 0; r < s.rows.size(); ++r) row.push_back(Number(s.scores[l][r][p]));
        rows.push_back(row);
      }
      matrix[s.policies[p]] = rows;
    }
    const char* key = st.mode == EvalMode::kNiahGrid ? "grid" : "turns";
    out[key] = {{"lengths", s.lengths},
                {st.mode == EvalMode::kNiahGrid ? "depths" : "turns", s.row_values},
                {"scores", matrix}};
  }
  return out;
}

std::string ReportToCsv(const EvalReport& report) {
  const EvalSettings& st = report.settings;
  const ScoreSummary s = Summarize(report);
  std::string out =
      "mode,model,numerics,seed,samples,length,row,policy,budget_tokens,score,questions,"
      "kv_settings\n";
  auto quote = [](const std::string& text) {
    std::string q = "\"";
    for (char c : text) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  };
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    for (size_t p = 0; p < s.policies.size(); ++p) {
      const kv::KvPolicyConfig& config = st.policies[p];
      const std::string budget =
          config.policy == "full" ? "" : std::to_string(config.BudgetTokens(s.lengths[l]));
      auto line = [&](const std::string& row, double score, int count) {
        out += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{}\n", EvalModeName(st.mode),
                           quote(report.model_path), report.numerics, st.seed, st.samples,
                           s.lengths[l], quote(row), config.display_name(), budget,
                           std::isnan(score) ? "" : fmt::format("{:.2f}", score), count,
                           quote(KvConfigText(config)));
      };
      int total = 0;
      for (size_t r = 0; r < s.rows.size(); ++r) {
        line(s.rows[r], s.scores[l][r][p], s.counts[l][r][p]);
        total += s.counts[l][r][p];
      }
      line("average", s.averages[l][p], total);
    }
  }
  return out;
}

}  // namespace shadowkv::eval
