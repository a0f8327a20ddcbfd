// KvPolicyConfig validation and budget arithmetic.
#include "kv/kv_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <string_view>
#include <type_traits>
#include <utility>

namespace shadowkv::kv {

const std::vector<std::string>& KnownKvPolicies() {
  static const std::vector<std::string> names = {"full", "shadowkv", "snapkv", "quest",
                                                 "streaming"};
  return names;
}

Status KvPolicyConfig::Validate() const {
  const auto& names = KnownKvPolicies();
  if (std::find(names.begin(), names.end(), policy) == names.end()) {
    return Error(ErrorCode::kInvalidArgument, "unknown KV policy '{}' (known: {})", policy,
                 fmt::join(names, ", "));
  }
  if (select_successors != 0 && select_successors != 1) {
    return Error(ErrorCode::kInvalidArgument, "successors must be 0 or 1, not {}",
                 select_successors);
  }
  if (select_interval < 1 || select_interval > 64) {
    return Error(ErrorCode::kInvalidArgument,
                 "select interval {} is not in [1, 64] (decode steps one chunk selection serves)",
                 select_interval);
  }
  if (!(select_drift >= 0.0 && select_drift <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "select drift {} is not in [0, 1]", select_drift);
  }
  if (!(select_drift_small >= 0.0 && select_drift_small <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "small-budget drift {} is not in [0, 1]",
                 select_drift_small);
  }
  if (drift_small_below < 0) {
    return Error(ErrorCode::kInvalidArgument, "small-budget drift bound {} is negative",
                 drift_small_below);
  }
  if (select_drift_small > 0.0 && select_drift <= 0.0) {
    return Error(ErrorCode::kInvalidArgument,
                 "small-budget drift {} needs drift on (select drift is 0)", select_drift_small);
  }
  if (!(select_sample >= 0.0 && select_sample < 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "sampled share {} of the budget is not in [0, 1)",
                 select_sample);
  }
  if (select_sample > 0.0 && selection != "landmarks" && selection != "rerank") {
    return Error(ErrorCode::kInvalidArgument,
                 "sample applies to select=landmarks or rerank, not '{}'", selection);
  }
  if (select_sample > 0.0 && select_successors != 0) {
    return Error(ErrorCode::kInvalidArgument, "sample does not apply with successors");
  }
  if (paper != 0 && paper != 1) {
    return Error(ErrorCode::kInvalidArgument, "paper must be 0 or 1, not {}", paper);
  }
  if (exact_keys != 0 && exact_keys != 1) {
    return Error(ErrorCode::kInvalidArgument, "exact_keys must be 0 or 1, not {}", exact_keys);
  }
  if (fp8_values != 0 && fp8_values != 1) {
    return Error(ErrorCode::kInvalidArgument, "fp8_values must be 0 or 1, not {}", fp8_values);
  }
  if (fp8_landmarks != 0 && fp8_landmarks != 1) {
    return Error(ErrorCode::kInvalidArgument, "fp8_landmarks must be 0 or 1, not {}",
                 fp8_landmarks);
  }
  if (fp8_keys != 0 && fp8_keys != 1) {
    return Error(ErrorCode::kInvalidArgument, "fp8_keys must be 0 or 1, not {}", fp8_keys);
  }
  if (fp8_keys != 0 && exact_keys == 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "fp8_keys stores the exact keys as FP8; it needs exact_keys=1");
  }
  if (budget_tokens < 0) {
    return Error(ErrorCode::kInvalidArgument, "budget of {} tokens is negative", budget_tokens);
  }
  if (!(budget_fraction > 0.0 && budget_fraction <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "budget fraction {} is not in (0, 1]",
                 budget_fraction);
  }
  if (budget_min_tokens < 0) {
    return Error(ErrorCode::kInvalidArgument, "budget floor {} is negative", budget_min_tokens);
  }
  if (budget_max_tokens < 0) {
    return Error(ErrorCode::kInvalidArgument, "budget ceiling {} is negative", budget_max_tokens);
  }
  if (budget_max_tokens > 0 && budget_max_tokens < budget_min_tokens) {
    return Error(ErrorCode::kInvalidArgument, "budget ceiling {} is below the budget floor {}",
                 budget_max_tokens, budget_min_tokens);
  }
  if (chunk_size <= 0) {
    return Error(ErrorCode::kInvalidArgument, "chunk size {} must be positive", chunk_size);
  }
  if (rank < 0) return Error(ErrorCode::kInvalidArgument, "rank {} is negative", rank);
  if (basis_groups < 1) {
    return Error(ErrorCode::kInvalidArgument, "basis groups {} must be at least 1", basis_groups);
  }
  if (rank == 0 && !(rank_ratio > 0.0 && rank_ratio <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "rank ratio {} is not in (0, 1]", rank_ratio);
  }
  if (!(rank_energy >= 0.0 && rank_energy <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "rank energy {} is not in [0, 1]", rank_energy);
  }
  if (rank_min < 0 || rank_max < 0) {
    return Error(ErrorCode::kInvalidArgument, "rank bounds [{}, {}] must not be negative", rank_min,
                 rank_max);
  }
  if (!(rank_head_ratio >= 0.0 && rank_head_ratio <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "rank head ratio {} is not in [0, 1]",
                 rank_head_ratio);
  }
  if (rank_max > 0 && rank_min > rank_max) {
    return Error(ErrorCode::kInvalidArgument, "rank floor {} is above the rank cap {}", rank_min,
                 rank_max);
  }
  if (selection != "landmarks" && selection != "rerank" && selection != "heads" &&
      selection != "mass") {
    return Error(ErrorCode::kInvalidArgument,
                 "chunk selection '{}' is not landmarks, rerank, heads or mass", selection);
  }
  if (rerank_factor < 1) {
    return Error(ErrorCode::kInvalidArgument, "rerank factor {} must be at least 1", rerank_factor);
  }
  if (rerank_min_tokens < 0) {
    return Error(ErrorCode::kInvalidArgument, "rerank floor {} is negative", rerank_min_tokens);
  }
  if (rerank_rank < 0 || rerank_rank % 8 != 0) {
    return Error(ErrorCode::kInvalidArgument, "rerank rank {} is not a multiple of 8 (0 = all)",
                 rerank_rank);
  }
  if (rerank_rank > 0 && basis_groups > 1) {
    return Error(ErrorCode::kInvalidArgument,
                 "rerank rank {} needs one key basis for all heads (basis_groups is {})",
                 rerank_rank, basis_groups);
  }
  if (!(select_mass > 0.0 && select_mass <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "selection mass {} is not in (0, 1]", select_mass);
  }
  if (exact_layers < 0) {
    return Error(ErrorCode::kInvalidArgument, "exact layers {} is negative", exact_layers);
  }
  if (local_window < 0) {
    return Error(ErrorCode::kInvalidArgument, "local window {} is negative", local_window);
  }
  if (snap_window <= 0) {
    return Error(ErrorCode::kInvalidArgument, "SnapKV window {} must be positive", snap_window);
  }
  if (snap_kernel <= 0 || snap_kernel % 2 == 0) {
    return Error(ErrorCode::kInvalidArgument, "SnapKV pooling kernel {} must be odd and positive",
                 snap_kernel);
  }
  if (snap_pooling != "max" && snap_pooling != "avg") {
    return Error(ErrorCode::kInvalidArgument, "SnapKV pooling '{}' is not max or avg",
                 snap_pooling);
  }
  if (quest_page_size <= 0) {
    return Error(ErrorCode::kInvalidArgument, "Quest page size {} must be positive",
                 quest_page_size);
  }
  if (quest_dense_layers < 0) {
    return Error(ErrorCode::kInvalidArgument, "Quest dense layers {} is negative",
                 quest_dense_layers);
  }
  if (sink_tokens < 0) {
    return Error(ErrorCode::kInvalidArgument, "sink tokens {} is negative", sink_tokens);
  }
  return Status::Ok();
}

int64_t KvPolicyConfig::BudgetTokens(int64_t context_tokens) const {
  if (budget_tokens > 0) return budget_tokens;
  const auto scaled = static_cast<int64_t>(std::llround(budget_fraction * context_tokens));
  const int64_t floored = std::max(budget_min_tokens, scaled);
  return budget_max_tokens > 0 ? std::min(floored, budget_max_tokens) : floored;
}

namespace {

// Parses all of `text` as a number of type T.
template <typename T>
Result<T> ParseNumber(std::string_view key, std::string_view text) {
  T value{};
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || text.empty()) {
    return Error(ErrorCode::kInvalidArgument, "'{}' is not a valid value for '{}'", text, key);
  }
  return value;
}

using Setter = std::function<Status(KvPolicyConfig&, std::string_view)>;

template <typename T>
Setter Assign(T KvPolicyConfig::*field) {
  return [field](KvPolicyConfig& config, std::string_view value) -> Status {
    if constexpr (std::is_same_v<T, std::string>) {
      config.*field = std::string(value);
    } else {
      SKV_ASSIGN_OR_RETURN(config.*field, ParseNumber<T>("setting", value));
    }
    return Status::Ok();
  };
}

const std::map<std::string, Setter, std::less<>>& VariantKeys() {
  static const std::map<std::string, Setter, std::less<>> keys = {
      {"budget", Assign(&KvPolicyConfig::budget_tokens)},
      {"budget_fraction", Assign(&KvPolicyConfig::budget_fraction)},
      {"budget_min", Assign(&KvPolicyConfig::budget_min_tokens)},
      {"budget_max", Assign(&KvPolicyConfig::budget_max_tokens)},
      {"chunk", Assign(&KvPolicyConfig::chunk_size)},
      {"rank", Assign(&KvPolicyConfig::rank)},
      {"rank_ratio", Assign(&KvPolicyConfig::rank_ratio)},
      {"rank_energy", Assign(&KvPolicyConfig::rank_energy)},
      {"rank_min", Assign(&KvPolicyConfig::rank_min)},
      {"rank_head_ratio", Assign(&KvPolicyConfig::rank_head_ratio)},
      {"rank_max", Assign(&KvPolicyConfig::rank_max)},
      {"select", Assign(&KvPolicyConfig::selection)},
      {"rerank_factor", Assign(&KvPolicyConfig::rerank_factor)},
      {"rerank_min", Assign(&KvPolicyConfig::rerank_min_tokens)},
      {"rerank_rank", Assign(&KvPolicyConfig::rerank_rank)},
      {"mass", Assign(&KvPolicyConfig::select_mass)},
      {"basis_groups", Assign(&KvPolicyConfig::basis_groups)},
      {"outliers", Assign(&KvPolicyConfig::outlier_chunks)},
      {"window", Assign(&KvPolicyConfig::local_window)},
      {"successors", Assign(&KvPolicyConfig::select_successors)},
      {"interval", Assign(&KvPolicyConfig::select_interval)},
      {"drift", Assign(&KvPolicyConfig::select_drift)},
      {"drift_small", Assign(&KvPolicyConfig::select_drift_small)},
      {"drift_small_below", Assign(&KvPolicyConfig::drift_small_below)},
      {"sample", Assign(&KvPolicyConfig::select_sample)},
      {"exact_layers", Assign(&KvPolicyConfig::exact_layers)},
      {"exact_keys", Assign(&KvPolicyConfig::exact_keys)},
      {"fp8_values", Assign(&KvPolicyConfig::fp8_values)},
      {"fp8_landmarks", Assign(&KvPolicyConfig::fp8_landmarks)},
      {"fp8_keys", Assign(&KvPolicyConfig::fp8_keys)},
      {"snap_window", Assign(&KvPolicyConfig::snap_window)},
      {"snap_kernel", Assign(&KvPolicyConfig::snap_kernel)},
      {"snap_pooling", Assign(&KvPolicyConfig::snap_pooling)},
      {"page", Assign(&KvPolicyConfig::quest_page_size)},
      {"dense_layers", Assign(&KvPolicyConfig::quest_dense_layers)},
      {"sinks", Assign(&KvPolicyConfig::sink_tokens)},
      {"paper", Assign(&KvPolicyConfig::paper)},
  };
  return keys;
}

// The variant keys whose settings paper=1 forces.
// clang-format off
constexpr std::string_view kPaperForcedKeys[] = {
    "budget", "budget_fraction", "budget_min", "budget_max", "chunk", "rank", "rank_ratio",
    "rank_energy", "rank_min", "rank_head_ratio", "rank_max", "select", "rerank_factor",
    "rerank_min", "rerank_rank", "mass", "outliers", "window", "successors", "interval", "drift",
    "drift_small", "drift_small_below", "sample", "exact_layers", "exact_keys", "fp8_values",
    "fp8_landmarks", "fp8_keys"};
// clang-format on

// The accurate setting (accurate=1; see ParseKvVariant): each variant key with its value.
// clang-format off
constexpr std::pair<std::string_view, std::string_view> kAccurateSettings[] = {
    {"exact_keys", "1"},
    {"rank", "8"},
    {"budget_fraction", "0.125"},
    {"budget_min", "768"},
    {"budget_max", "2048"},
    {"rerank_factor", "3"},
    {"rerank_min", "8192"},
    {"interval", "8"},
    {"drift", "0.85"},
    {"drift_small", "0.9"},
    {"drift_small_below", "3072"},
    {"sample", "0.25"}};
// clang-format on

}  // namespace

int RankFloor(const KvPolicyConfig& config, int head_dim) {
  // The small slack keeps exact products (0.5 · 256 = 128) from rounding up.
  const auto head = static_cast<int>(std::ceil(config.rank_head_ratio * head_dim - 1e-6));
  return (std::max({config.rank_min, head, 0}) + 7) / 8 * 8;
}

KvPolicyConfig WithPaperSettings(KvPolicyConfig config) {
  if (config.paper != 1) return config;
  const KvPolicyConfig defaults;
  config.budget_tokens = 0;
  config.budget_fraction = 0.015625;
  config.budget_min_tokens = 256;
  config.budget_max_tokens = 0;
  config.chunk_size = 8;
  config.rank = 0;
  config.rank_ratio = 1 / 6.4;
  config.rank_energy = 0.0;
  config.rank_min = 0;
  config.rank_head_ratio = 0.0;
  config.rank_max = 0;
  config.selection = "landmarks";
  config.rerank_factor = defaults.rerank_factor;
  config.rerank_min_tokens = defaults.rerank_min_tokens;
  config.rerank_rank = defaults.rerank_rank;
  config.select_mass = defaults.select_mass;
  config.outlier_chunks = -1;
  config.local_window = 32;
  config.select_successors = 0;
  config.select_interval = 1;
  config.select_drift = 0.0;
  config.select_drift_small = 0.0;
  config.drift_small_below = 0;
  config.select_sample = 0.0;
  config.exact_layers = 0;
  config.exact_keys = 0;
  config.fp8_keys = 0;
  config.fp8_values = 0;
  config.fp8_landmarks = 0;
  return config;
}

Result<KvPolicyConfig> ParseKvVariant(const std::string& text, const KvPolicyConfig& base) {
  KvPolicyConfig config = base;
  std::vector<std::string_view> named;
  bool accurate = false;
  config.label.clear();
  std::string_view rest = text;
  const size_t name_end = rest.find(':');
  config.policy = std::string(rest.substr(0, name_end));
  if (name_end != std::string_view::npos) {
    config.label = text;
    rest.remove_prefix(name_end + 1);
    while (true) {
      const size_t item_end = rest.find(':');
      const std::string_view item = rest.substr(0, item_end);
      const size_t equals = item.find('=');
      if (equals == std::string_view::npos || equals == 0) {
        return Error(ErrorCode::kInvalidArgument, "KV policy variant '{}': '{}' is not KEY=VALUE",
                     text, item);
      }
      const std::string_view key = item.substr(0, equals);
      if (key == "accurate") {
        const std::string_view value = item.substr(equals + 1);
        if (value != "0" && value != "1") {
          return Error(ErrorCode::kInvalidArgument,
                       "KV policy variant '{}': accurate must be 0 or 1, not '{}'", text, value);
        }
        accurate = value == "1";
        if (item_end == std::string_view::npos) break;
        rest.remove_prefix(item_end + 1);
        continue;
      }
      const auto setter = VariantKeys().find(key);
      if (setter == VariantKeys().end()) {
        std::vector<std::string> known;
        for (const auto& [name, unused] : VariantKeys()) known.push_back(name);
        return Error(ErrorCode::kInvalidArgument,
                     "KV policy variant '{}': unknown setting '{}' (known: {})", text, key,
                     fmt::join(known, ", "));
      }
      named.push_back(key);
      if (Status s = setter->second(config, item.substr(equals + 1)); !s.ok()) {
        return Error(ErrorCode::kInvalidArgument, "KV policy variant '{}': {} '{}' for '{}'", text,
                     "bad value", item.substr(equals + 1), key);
      }
      if (item_end == std::string_view::npos) break;
      rest.remove_prefix(item_end + 1);
    }
  }
  std::vector<std::string> implied;  // what accurate=1 filled in, for the error below
  if (accurate) {
    if (config.policy != "shadowkv" || config.paper == 1) {
      return Error(ErrorCode::kInvalidArgument,
                   "KV policy variant '{}': accurate=1 is a ShadowKV setting and not one with "
                   "paper=1",
                   text);
    }
    for (const auto& [key, value] : kAccurateSettings) {
      if (std::find(named.begin(), named.end(), key) != named.end()) continue;
      SKV_RETURN_IF_ERROR(VariantKeys().find(key)->second(config, value));
      implied.push_back(fmt::format("{}={}", key, value));
    }
  }
  if (Status s = config.Validate(); !s.ok()) {
    if (implied.empty()) return s;
    // The error may come from a value the user did not write: say where it came from.
    return Error(ErrorCode::kInvalidArgument, "KV policy variant '{}': {} (accurate=1 sets {})",
                 text, s.message(), fmt::join(implied, ":"));
  }
  if (config.paper == 1) {
    for (std::string_view key : named) {
      if (std::find(std::begin(kPaperForcedKeys), std::end(kPaperForcedKeys), key) !=
          std::end(kPaperForcedKeys)) {
        return Error(ErrorCode::kInvalidArgument,
                     "KV policy variant '{}': paper=1 fixes '{}'; name one or the other", text,
                     key);
      }
    }
    config = WithPaperSettings(std::move(config));
  }
  return config;
}

}  // namespace shadowkv::kv
