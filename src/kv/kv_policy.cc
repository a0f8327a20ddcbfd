// MakeKvPolicy: the one place that maps a policy name to its implementation.
#include "kv/kv_policy.h"

#include <algorithm>
#include <iterator>

#include "kv/policies.h"

namespace shadowkv::kv {

PolicyStats& PolicyStats::operator+=(const PolicyStats& o) {
  prepare_calls += o.prepare_calls;
  context_tokens += o.context_tokens;
  attended_tokens += o.attended_tokens;
  chunk_selections += o.chunk_selections;
  chunk_hits += o.chunk_hits;
  head_steps += o.head_steps;
  head_selections += o.head_selections;
  bytes_fetched += o.bytes_fetched;
  compress_seconds += o.compress_seconds;
  return *this;
}

PolicyStats& PolicyStats::operator-=(const PolicyStats& o) {
  prepare_calls -= o.prepare_calls;
  context_tokens -= o.context_tokens;
  attended_tokens -= o.attended_tokens;
  chunk_selections -= o.chunk_selections;
  chunk_hits -= o.chunk_hits;
  head_steps -= o.head_steps;
  head_selections -= o.head_selections;
  bytes_fetched -= o.bytes_fetched;
  compress_seconds -= o.compress_seconds;
  return *this;
}

std::optional<PolicyKind> PolicyKindOf(std::string_view name) {
  constexpr PolicyKind kKinds[] = {PolicyKind::kFull, PolicyKind::kShadowKv, PolicyKind::kSnapKv,
                                   PolicyKind::kQuest, PolicyKind::kStreaming};
  const std::vector<std::string>& names = KnownKvPolicies();
  for (size_t i = 0; i < names.size() && i < std::size(kKinds); ++i) {
    if (names[i] == name) return kKinds[i];
  }
  return std::nullopt;
}

namespace {

Result<std::unique_ptr<KvPolicy>> MakeOfKind(PolicyKind kind, const KvPolicyConfig& config,
                                             const KvGeometry& geometry) {
  switch (kind) {
    case PolicyKind::kFull:
      return MakeFullPolicy(config, geometry);
    case PolicyKind::kShadowKv:
      return MakeShadowKvPolicy(config, geometry);
    case PolicyKind::kSnapKv:
      return MakeSnapKvPolicy(config, geometry);
    case PolicyKind::kQuest:
      return MakeQuestPolicy(config, geometry);
    case PolicyKind::kStreaming:
      return MakeStreamingPolicy(config, geometry);
  }
  return Error(ErrorCode::kInternal, "policy kind {}", static_cast<int>(kind));
}

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeKvPolicy(const KvPolicyConfig& config,
                                               const KvGeometry& geometry) {
  SKV_RETURN_IF_ERROR(config.Validate());
  if (geometry.num_kv_heads <= 0 || geometry.num_query_heads % geometry.num_kv_heads != 0) {
    return Error(ErrorCode::kInvalidArgument, "{} query heads do not group over {} KV heads",
                 geometry.num_query_heads, geometry.num_kv_heads);
  }
  const std::optional<PolicyKind> kind = PolicyKindOf(config.policy);
  if (!kind) {
    return Error(ErrorCode::kUnsupported, "KV policy '{}' is not built into this binary",
                 config.policy);
  }
  if (geometry.layer_windowed.empty()) return MakeOfKind(*kind, config, geometry);
  if (static_cast<int>(geometry.layer_windowed.size()) != geometry.num_layers ||
      geometry.sliding_window <= 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "{} windowed-layer flags and a sliding window of {} tokens for {} layers",
                 geometry.layer_windowed.size(), geometry.sliding_window, geometry.num_layers);
  }
  // Sliding-window models: the windowed layers keep their window exactly, the global layers
  // take the named policy (sliding_split_policy.cc).
  const int64_t windowed =
      std::count(geometry.layer_windowed.begin(), geometry.layer_windowed.end(), true);
  if (windowed == geometry.num_layers && *kind != PolicyKind::kFull) {
    return Error(ErrorCode::kUnsupported,
                 "KV policy '{}' has nothing to serve on this model: all {} of its layers attend "
                 "to a sliding window of {} tokens, which they keep exactly; it applies to "
                 "global layers only, and this model has none (use 'full')",
                 config.policy, geometry.num_layers, geometry.sliding_window);
  }
  SKV_ASSIGN_OR_RETURN(
      std::unique_ptr<KvPolicy> global,
      MakeOfKind(*kind, GlobalLayersConfig(config, geometry), GlobalLayersGeometry(geometry)));
  return MakeSlidingSplitPolicy(config, geometry, std::move(global));
}

}  // namespace shadowkv::kv
