// KvPolicyConfig validation and budget arithmetic.
#include "kv/kv_config.h"

#include <algorithm>
#include <cmath>

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
  if (chunk_size <= 0) {
    return Error(ErrorCode::kInvalidArgument, "chunk size {} must be positive", chunk_size);
  }
  if (rank < 0) return Error(ErrorCode::kInvalidArgument, "rank {} is negative", rank);
  if (rank == 0 && !(rank_ratio > 0.0 && rank_ratio <= 1.0)) {
    return Error(ErrorCode::kInvalidArgument, "rank ratio {} is not in (0, 1]", rank_ratio);
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
  return std::max(budget_min_tokens, scaled);
}

}  // namespace shadowkv::kv
