// Eval report summaries (means, bootstrap intervals, attended tokens) and their text, JSON and
// CSV forms.
#include "eval/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "format/unicode.h"
#include "kv/policies.h"

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
          {"budget_max_tokens", c.budget_max_tokens},
          {"chunk_size", c.chunk_size},
          {"rank", c.rank},
          {"rank_ratio", c.rank_ratio},
          {"rank_energy", c.rank_energy},
          {"rank_min", c.rank_min},
          {"rank_head_ratio", c.rank_head_ratio},
          {"rank_max", c.rank_max},
          {"selection", c.selection},
          {"rerank_factor", c.rerank_factor},
          {"rerank_min_tokens", c.rerank_min_tokens},
          {"rerank_rank", c.rerank_rank},
          {"select_mass", c.select_mass},
          {"paper", c.paper},
          {"outlier_chunks", c.outlier_chunks},
          {"local_window", c.local_window},
          {"basis_groups", c.basis_groups},
          {"select_successors", c.select_successors},
          {"select_interval", c.select_interval},
          {"select_drift", c.select_drift},
          {"select_drift_small", c.select_drift_small},
          {"drift_small_below", c.drift_small_below},
          {"select_sample", c.select_sample},
          {"exact_layers", c.exact_layers},
          {"exact_keys", c.exact_keys},
          {"fp8_values", c.fp8_values},
          {"fp8_landmarks", c.fp8_landmarks},
          {"fp8_keys", c.fp8_keys},
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
      "budget={};fraction={};min={};max={};chunk={};rank={};rank_ratio={:.4f};rank_energy={};"
      "rank_min={};rank_head_ratio={};rank_max={};select={};rerank_factor={};rerank_min={};"
      "rerank_rank={};mass={};paper={};outliers={};window={};basis_groups={};successors={};"
      "interval={};drift={};drift_small={};drift_small_below={};sample={};"
      "exact_layers={};exact_keys={};fp8_values={};fp8_landmarks={};fp8_keys={};"
      "snap_window={};snap_kernel={};snap_pooling={};page={};dense_layers={};sinks={}",
      c.budget_tokens, c.budget_fraction, c.budget_min_tokens, c.budget_max_tokens, c.chunk_size,
      c.rank, c.rank_ratio, c.rank_energy, c.rank_min, c.rank_head_ratio, c.rank_max, c.selection,
      c.rerank_factor, c.rerank_min_tokens, c.rerank_rank, c.select_mass, c.paper, c.outlier_chunks,
      c.local_window, c.basis_groups, c.select_successors, c.select_interval, c.select_drift,
      c.select_drift_small, c.drift_small_below, c.select_sample, c.exact_layers, c.exact_keys,
      c.fp8_values, c.fp8_landmarks, c.fp8_keys, c.snap_window, c.snap_kernel, c.snap_pooling,
      c.quest_page_size, c.quest_dense_layers, c.sink_tokens);
}

// `text` with every malformed UTF-8 byte replaced by U+FFFD: a model's answer can stop inside
// a character or be raw byte tokens, and JSON text must be valid UTF-8 (dump() throws on it).
std::string ValidUtf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  unicode::AppendValidUtf8(text, out);
  return out;
}

// JSON number, or null for NaN.
nlohmann::ordered_json Number(double value) {
  return std::isnan(value) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(value);
}

// The table's footer at one length: every policy's attended tokens per query and layer, and
// how far apart the sparse policies are, so that "at equal attended tokens" can be checked.
std::string AttendedFooter(const std::vector<kv::KvPolicyConfig>& policies,
                           const std::vector<double>& attended) {
  std::string listed, missing;
  double least = kNaN, most = kNaN;
  int sparse = 0;
  for (size_t p = 0; p < policies.size() && p < attended.size(); ++p) {
    if (std::isnan(attended[p])) {
      missing += (missing.empty() ? "" : ", ") + policies[p].display_name();
      continue;
    }
    listed += fmt::format("{}{} {:.1f}", listed.empty() ? "" : ", ", policies[p].display_name(),
                          attended[p]);
    if (kv::IsPolicy(policies[p], kv::PolicyKind::kFull)) continue;
    least = sparse ? std::min(least, attended[p]) : attended[p];
    most = sparse ? std::max(most, attended[p]) : attended[p];
    sparse++;
  }
  if (listed.empty()) return "attended tokens per query and layer: not reported by this backend\n";
  std::string out = "attended tokens per query and layer (mean over questions): " + listed +
                    (missing.empty() ? "" : "; not reported: " + missing) + "\n";
  if (sparse > 1) {
    out += fmt::format(
        "sparse policies attend {:.1f} to {:.1f} tokens (the most {:.1f}% above the "
        "least)\n",
        least, most, 100.0 * (most - least) / least);
  }
  return out;
}

// The footer's memory lines at length `l`: fast-tier and slow-tier KV bytes per token of every
// policy that reports them, and the ranks ShadowKV chose per layer (min/mean/max over compressed
// layers and questions).
std::string MemoryFooter(const ScoreSummary& s, size_t l) {
  std::string bytes, slow, ranks;
  for (size_t p = 0; p < s.policies.size(); ++p) {
    if (!std::isnan(s.fast_bytes_per_token[l][p])) {
      bytes += fmt::format("{}{} {:.0f}", bytes.empty() ? "" : ", ", s.policies[p],
                           s.fast_bytes_per_token[l][p]);
    }
    if (!std::isnan(s.slow_bytes_per_token[l][p])) {
      slow += fmt::format("{}{} {:.0f}", slow.empty() ? "" : ", ", s.policies[p],
                          s.slow_bytes_per_token[l][p]);
    }
    const ScoreSummary::RankSpread& r = s.ranks[l][p];
    if (!std::isnan(r.mean)) {
      ranks += fmt::format("{}{} {:.0f}/{:.1f}/{:.0f}", ranks.empty() ? "" : ", ", s.policies[p],
                           r.min, r.mean, r.max);
    }
  }
  std::string fidelity;
  for (size_t p = 1; p < s.policies.size(); ++p) {
    if (std::isnan(s.same_top[l][p])) continue;
    fidelity += fmt::format("{}{} {:.2f}% / {:.4f}", fidelity.empty() ? "" : ", ", s.policies[p],
                            s.same_top[l][p], s.mean_kl[l][p]);
  }
  std::string out;
  if (!fidelity.empty()) {
    out += fmt::format(
        "teacher-forced along {}'s answers ({} steps), same top token / mean KL in nats: {}\n",
        s.policies[0], s.fidelity_steps[l][0], fidelity);
  }
  if (!bytes.empty()) out += "fast-tier KV bytes per token (mean over questions): " + bytes + "\n";
  if (!slow.empty()) out += "slow-tier KV bytes per token (mean over questions): " + slow + "\n";
  if (!ranks.empty()) {
    out +=
        "key rank per layer (min/mean/max over compressed layers and questions): " + ranks + "\n";
  }
  return out;
}

nlohmann::ordered_json IntervalJson(const Interval& ci) {
  if (std::isnan(ci.low)) return nullptr;
  return nlohmann::ordered_json::array({ci.low, ci.high});
}

}  // namespace

double AttendedTokensPerQuery(const PolicyOutput& output) {
  // A policy always reads at least the current token, so zero means "not counted" (the CUDA
  // backend counts chunk selections only).
  if (output.stats.prepare_calls <= 0 || output.stats.attended_tokens <= 0) return kNaN;
  return static_cast<double>(output.stats.attended_tokens) / output.stats.prepare_calls;
}

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
  const size_t num_lengths = s.lengths.size(), num_rows = s.rows.size();
  const size_t num_policies = s.policies.size();
  // Scores in percent and differences to the first policy, [length][policy][row][question].
  using Strata = std::vector<std::vector<double>>;
  std::vector<std::vector<Strata>> values(num_lengths,
                                          std::vector<Strata>(num_policies, Strata(num_rows)));
  std::vector<std::vector<Strata>> deltas = values;
  std::vector<std::vector<double>> attended_sum(num_lengths, std::vector<double>(num_policies, 0));
  std::vector<std::vector<int>> attended_count(num_lengths, std::vector<int>(num_policies, 0));
  auto bytes_sum = attended_sum, slow_sum = attended_sum;
  auto bytes_count = attended_count, slow_count = attended_count;
  std::vector<std::vector<std::vector<int>>> ranks(num_lengths,
                                                   std::vector<std::vector<int>>(num_policies));
  s.fidelity_steps.assign(num_lengths, std::vector<int64_t>(num_policies, 0));
  auto same_top_sum = attended_sum, kl_sum = attended_sum;
  for (const QuestionOutcome& q : report.questions) {
    const size_t l = length_index[q.length], r = row_index[RowLabel(mode, q)];
    for (size_t p = 0; p < q.outputs.size() && p < num_policies; ++p) {
      values[l][p][r].push_back(100.0 * q.outputs[p].score);
      if (p > 0) deltas[l][p][r].push_back(100.0 * (q.outputs[p].score - q.outputs[0].score));
      const double attended = AttendedTokensPerQuery(q.outputs[p]);
      if (!std::isnan(attended)) {
        attended_sum[l][p] += attended;
        attended_count[l][p]++;
      }
      const PolicyOutput& o = q.outputs[p];
      if (o.kv_tokens > 0 && o.memory.fast_bytes > 0) {
        bytes_sum[l][p] += static_cast<double>(o.memory.fast_bytes) / o.kv_tokens;
        bytes_count[l][p]++;
      }
      if (o.kv_tokens > 0 && o.memory.slow_bytes > 0) {
        slow_sum[l][p] += static_cast<double>(o.memory.slow_bytes) / o.kv_tokens;
        slow_count[l][p]++;
      }
      // Compressed layers only: a layer kept exact (a windowed layer of gemma3, exact_layers)
      // reports rank 0.
      for (int rank : o.layer_ranks) {
        if (rank > 0) ranks[l][p].push_back(rank);
      }
      s.fidelity_steps[l][p] += o.fidelity.steps;
      same_top_sum[l][p] += o.fidelity.same_top;
      kl_sum[l][p] += o.fidelity.kl_sum;
    }
  }
  auto grid = [&](auto value) {
    using T = decltype(value);
    return std::vector<std::vector<std::vector<T>>>(
        num_lengths, std::vector<std::vector<T>>(num_rows, std::vector<T>(num_policies, value)));
  };
  s.scores = grid(kNaN);
  s.counts = grid(0);
  s.intervals = grid(Interval{});
  s.differences = grid(kNaN);
  s.difference_intervals = grid(Interval{});
  s.averages.assign(num_lengths, std::vector<double>(num_policies, kNaN));
  s.average_differences = s.averages;
  s.attended_tokens = s.averages;
  s.fast_bytes_per_token = s.averages;
  s.slow_bytes_per_token = s.averages;
  s.same_top = s.averages;
  s.mean_kl = s.averages;
  s.ranks.assign(num_lengths, std::vector<ScoreSummary::RankSpread>(num_policies));
  s.average_intervals.assign(num_lengths, std::vector<Interval>(num_policies));
  s.average_difference_intervals = s.average_intervals;
  for (size_t l = 0; l < num_lengths; ++l) {
    const uint64_t average_seed = BootstrapSeed(report.settings.seed, s.lengths[l], "");
    for (size_t p = 0; p < num_policies; ++p) {
      for (size_t r = 0; r < num_rows; ++r) {
        // Every policy of a row draws the same resamples: their intervals move together.
        const uint64_t seed = BootstrapSeed(report.settings.seed, s.lengths[l], s.rows[r]);
        const Strata row = {values[l][p][r]};
        s.counts[l][r][p] = static_cast<int>(row[0].size());
        s.scores[l][r][p] = MeanOfMeans(row);
        s.intervals[l][r][p] = BootstrapMeanOfMeans(row, seed);
        if (p == 0) continue;
        const Strata delta = {deltas[l][p][r]};
        s.differences[l][r][p] = MeanOfMeans(delta);
        s.difference_intervals[l][r][p] = BootstrapMeanOfMeans(delta, seed);
      }
      s.averages[l][p] = MeanOfMeans(values[l][p]);
      s.average_intervals[l][p] = BootstrapMeanOfMeans(values[l][p], average_seed);
      if (p > 0) {
        s.average_differences[l][p] = MeanOfMeans(deltas[l][p]);
        s.average_difference_intervals[l][p] = BootstrapMeanOfMeans(deltas[l][p], average_seed);
      }
      if (attended_count[l][p]) s.attended_tokens[l][p] = attended_sum[l][p] / attended_count[l][p];
      if (bytes_count[l][p]) s.fast_bytes_per_token[l][p] = bytes_sum[l][p] / bytes_count[l][p];
      if (slow_count[l][p]) s.slow_bytes_per_token[l][p] = slow_sum[l][p] / slow_count[l][p];
      if (const int64_t steps = s.fidelity_steps[l][p]; steps > 0) {
        s.same_top[l][p] = 100.0 * same_top_sum[l][p] / steps;
        s.mean_kl[l][p] = kl_sum[l][p] / steps;
      }
      const std::vector<int>& r = ranks[l][p];
      if (!r.empty()) {
        s.ranks[l][p] = {static_cast<double>(*std::min_element(r.begin(), r.end())),
                         std::accumulate(r.begin(), r.end(), 0.0) / r.size(),
                         static_cast<double>(*std::max_element(r.begin(), r.end()))};
      }
    }
  }
  return s;
}

std::string FormatTables(const EvalReport& report) {
  const ScoreSummary s = Summarize(report);
  const char* row_title = report.settings.mode == EvalMode::kTasks      ? "task"
                          : report.settings.mode == EvalMode::kNiahGrid ? "needle depth"
                                                                        : "question";
  const std::string difference_row =
      s.policies.empty() ? std::string() : fmt::format("average - {}", s.policies[0]);
  size_t width = std::max(std::string_view(row_title).size(), difference_row.size());
  for (const auto& row : s.rows) width = std::max(width, row.size());
  width = std::max<size_t>(width, 7) + 2;
  std::string out;
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    out +=
        fmt::format("context {} tokens (prompt + answer), {} sample(s) per row, score % [95%]:\n",
                    s.lengths[l], report.settings.samples);
    // Each column as wide as its policy's name (variants such as shadowkv:budget=1024 are
    // long) or a cell with its interval, "100.0 [100.0, 100.0]", with two spaces before it.
    std::vector<size_t> columns;
    out += fmt::format("{:<{}}", row_title, width);
    for (const auto& policy : s.policies) {
      columns.push_back(std::max<size_t>(22, policy.size() + 2));
      out += fmt::format("{:>{}}", policy, columns.back());
    }
    out += "\n";
    auto add_row = [&](const std::string& label, const std::vector<double>& values,
                       const std::vector<Interval>& intervals) {
      out += fmt::format("{:<{}}", label, width);
      for (size_t p = 0; p < values.size(); ++p) {
        const double v = values[p];
        const Interval& ci = intervals[p];
        const std::string cell = std::isnan(v) ? "-"
                                 : std::isnan(ci.low)
                                     ? fmt::format("{:.1f}", v)
                                     : fmt::format("{:.1f} [{:.1f}, {:.1f}]", v, ci.low, ci.high);
        out += fmt::format("{:>{}}", cell, columns[p]);
      }
      out += "\n";
    };
    for (size_t r = 0; r < s.rows.size(); ++r)
      add_row(s.rows[r], s.scores[l][r], s.intervals[l][r]);
    add_row("average", s.averages[l], s.average_intervals[l]);
    if (s.policies.size() > 1)
      add_row(difference_row, s.average_differences[l], s.average_difference_intervals[l]);
    out += AttendedFooter(report.settings.policies, s.attended_tokens[l]);
    out += MemoryFooter(s, l);
    out += "\n";
  }
  out += fmt::format(
      "[95%]: percentile bootstrap over the questions, {} resamples seeded from the report's "
      "seed; the average resamples within each row; \"{}\": each policy minus {} on the same "
      "questions (paired).\n",
      kBootstrapResamples, difference_row, s.policies.empty() ? "" : s.policies[0]);
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
      budgets[std::to_string(length)] = kv::IsPolicy(config, kv::PolicyKind::kFull)
                                            ? nlohmann::ordered_json(nullptr)
                                            : nlohmann::ordered_json(config.BudgetTokens(length));
      // What the policy really used on the first question at this length.
      for (const QuestionOutcome& q : report.questions) {
        if (q.length != length || p >= q.outputs.size()) continue;
        const PolicyOutput& o = q.outputs[p];
        nlohmann::ordered_json used = {{"prompt_tokens", q.prompt_tokens}};
        if (!kv::IsPolicy(config, kv::PolicyKind::kFull)) used["budget_tokens"] = o.budget_tokens;
        if (o.rank > 0) {
          used["rank"] = o.rank;
          used["outlier_chunks_per_kv_head"] = o.outlier_chunks;
          if (!o.layer_ranks.empty()) used["layer_ranks"] = o.layer_ranks;
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
  if (st.mode == EvalMode::kMultiTurn) {
    settings["turns"] = st.turns;
    settings["kv_across_turns"] = st.fresh_turns ? "fresh prefill" : "reused";
  }

  settings["bootstrap"] = {
      {"method", "percentile bootstrap over questions; the average resamples within each row"},
      {"resamples", kBootstrapResamples},
      {"level", kBootstrapLevel},
      {"seed", "derived from settings.seed per length and row"}};

  // {length: {row..., "average": {policy: cell(l, r, p)}}}, r == rows.size() being the average.
  auto by_length = [&](auto cell, size_t first_policy) {
    nlohmann::ordered_json out = nlohmann::ordered_json::object();
    for (size_t l = 0; l < s.lengths.size(); ++l) {
      nlohmann::ordered_json by_row = nlohmann::ordered_json::object();
      for (size_t r = 0; r <= s.rows.size(); ++r) {
        nlohmann::ordered_json by_policy = nlohmann::ordered_json::object();
        for (size_t p = first_policy; p < s.policies.size(); ++p)
          by_policy[s.policies[p]] = cell(l, r, p);
        by_row[r < s.rows.size() ? s.rows[r] : std::string("average")] = by_policy;
      }
      out[std::to_string(s.lengths[l])] = by_row;
    }
    return out;
  };
  const size_t num_rows = s.rows.size();
  const nlohmann::ordered_json scores = by_length(
      [&](size_t l, size_t r, size_t p) {
        return Number(r < num_rows ? s.scores[l][r][p] : s.averages[l][p]);
      },
      0);
  const nlohmann::ordered_json intervals = by_length(
      [&](size_t l, size_t r, size_t p) {
        return IntervalJson(r < num_rows ? s.intervals[l][r][p] : s.average_intervals[l][p]);
      },
      0);
  const nlohmann::ordered_json differences = by_length(
      [&](size_t l, size_t r, size_t p) {
        const double mean = r < num_rows ? s.differences[l][r][p] : s.average_differences[l][p];
        const Interval& ci =
            r < num_rows ? s.difference_intervals[l][r][p] : s.average_difference_intervals[l][p];
        return nlohmann::ordered_json{{"mean", Number(mean)}, {"interval", IntervalJson(ci)}};
      },
      1);
  nlohmann::ordered_json attended = nlohmann::ordered_json::object();
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    nlohmann::ordered_json by_policy = nlohmann::ordered_json::object();
    for (size_t p = 0; p < s.policies.size(); ++p)
      by_policy[s.policies[p]] = Number(s.attended_tokens[l][p]);
    attended[std::to_string(s.lengths[l])] = by_policy;
  }

  nlohmann::ordered_json questions = nlohmann::ordered_json::array();
  for (const QuestionOutcome& q : report.questions) {
    nlohmann::ordered_json outputs = nlohmann::ordered_json::array();
    for (const PolicyOutput& o : q.outputs) {
      nlohmann::ordered_json out = {
          {"policy", ValidUtf8(o.policy)},
          {"text", ValidUtf8(o.text)},
          {"score", o.score},
          {"generated_tokens", o.generated_tokens},
          {"truncated", o.truncated},
          {"kv_fast_bytes", o.memory.fast_bytes},
          {"kv_slow_bytes", o.memory.slow_bytes},
          {"attended_fraction",
           o.stats.context_tokens
               ? static_cast<double>(o.stats.attended_tokens) / o.stats.context_tokens
               : 1.0},
          {"attended_tokens_per_query", Number(AttendedTokensPerQuery(o))}};
      if (o.kv_tokens > 0 && o.memory.fast_bytes > 0) {
        out["kv_fast_bytes_per_token"] = static_cast<double>(o.memory.fast_bytes) / o.kv_tokens;
      }
      if (!o.layer_ranks.empty()) out["layer_ranks"] = o.layer_ranks;
      if (kv::PolicyKindOf(o.policy) != kv::PolicyKind::kFull) {
        out["budget_tokens"] = o.budget_tokens;
      }
      if (o.stats.chunk_selections > 0) out["chunk_hit_rate"] = o.stats.hit_rate();
      if (o.stats.head_steps > 0) out["selection_share"] = o.stats.selection_share();
      if (o.fidelity.steps > 0) {
        out["fidelity"] = {{"steps", o.fidelity.steps},
                           {"same_top", o.fidelity.same_top},
                           {"kl_sum", o.fidelity.kl_sum}};
      }
      outputs.push_back(out);
    }
    nlohmann::ordered_json answers = nlohmann::ordered_json::array();
    for (const std::string& answer : q.answers) answers.push_back(ValidUtf8(answer));
    nlohmann::ordered_json item = {{"task", q.task},
                                   {"length", q.length},
                                   {"sample", q.index},
                                   {"prompt_tokens", q.prompt_tokens},
                                   {"answers", answers},
                                   {"outputs", outputs},
                                   {"prefill_seconds", q.prefill_seconds},
                                   {"decode_seconds", q.decode_seconds}};
    if (q.turn > 0) item["turn"] = q.turn;
    if (q.depth >= 0) item["depth"] = q.depth;
    questions.push_back(item);
  }

  nlohmann::ordered_json out = {
      {"model",
       {{"path", ValidUtf8(report.model_path)},
        {"summary", ValidUtf8(report.model_summary)},
        {"numerics", report.numerics}}},
      {"settings", settings},
      {"scores", scores},
      {"intervals", intervals},
      {"differences",
       {{"baseline", s.policies.empty() ? "" : s.policies[0]}, {"scores", differences}}},
      {"attended_tokens_per_query", attended},
      {"questions", questions},
      {"seconds", report.seconds},
      {"complete", report.complete}};
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
      "score_low,score_high,diff_to_first,diff_low,diff_high,attended_tokens_per_query,"
      "kv_settings\n";
  auto quote = [](const std::string& text) {
    std::string q = "\"";
    for (char c : text) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  };
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    for (size_t p = 0; p < s.policies.size(); ++p) {
      const kv::KvPolicyConfig& config = st.policies[p];
      const std::string budget = kv::IsPolicy(config, kv::PolicyKind::kFull)
                                     ? ""
                                     : std::to_string(config.BudgetTokens(s.lengths[l]));
      auto number = [](double v) {
        return std::isnan(v) ? std::string() : fmt::format("{:.2f}", v);
      };
      auto line = [&](const std::string& row, double score, int count, const Interval& ci,
                      double diff, const Interval& diff_ci) {
        out += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                           EvalModeName(st.mode), quote(report.model_path), report.numerics,
                           st.seed, st.samples, s.lengths[l], quote(row), config.display_name(),
                           budget, number(score), count, number(ci.low), number(ci.high),
                           number(diff), number(diff_ci.low), number(diff_ci.high),
                           number(s.attended_tokens[l][p]), quote(KvConfigText(config)));
      };
      int total = 0;
      for (size_t r = 0; r < s.rows.size(); ++r) {
        line(s.rows[r], s.scores[l][r][p], s.counts[l][r][p], s.intervals[l][r][p],
             s.differences[l][r][p], s.difference_intervals[l][r][p]);
        total += s.counts[l][r][p];
      }
      line("average", s.averages[l][p], total, s.average_intervals[l][p],
           s.average_differences[l][p], s.average_difference_intervals[l][p]);
    }
  }
  return out;
}

}  // namespace shadowkv::eval
