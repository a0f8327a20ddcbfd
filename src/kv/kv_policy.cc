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
  bytes_fetched += o.bytes_fetched;
  return *this;
}

PolicyStats& PolicyStats::operator-=(const PolicyStats& o) {
  prepare_calls -= o.prepare_calls;
  context_tokens -= o.context_tokens;
  attended_tokens -= o.attended_tokens;
  chunk_selections -= o.chunk_selections;
  chunk_hits -= o.chunk_hits;
  bytes_fetched -= o.bytes_fetched;
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

Result<std::unique_ptr<KvPolicy>> MakeKvPolicy(const KvPolicyConfig& config,
                                               const KvGeometry& geometry) {
  SKV_RETURN_IF_ERROR(config.Validate());
  if (geometry.num_kv_heads <= 0 || geometry.num_query_heads % geometry.num_kv_heads != 0) {
    return Error(ErrorCode::kInvalidArgument, "{} query heads do not group over {} KV heads",
                 geometry.num_query_heads, geometry.num_kv_heads);
  }
  const int64_t windowed =
      std::count(geometry.layer_windowed.begin(), geometry.layer_windowed.end(), true);
  if (const std::optional<PolicyKind> kind = PolicyKindOf(config.policy)) {
    if (windowed > 0 && *kind != PolicyKind::kFull) {
      return Error(ErrorCode::kUnsupported,
                   "KV policy '{}' cannot serve this model: {} of its {} layers attend to a "
                   "sliding window of {} tokens, which only the 'full' policy keeps positioned "
                   "for the attention op to mask",
                   config.policy, windowed, geometry.num_layers, geometry.sliding_window);
    }
    switch (*kind) {
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
  }
  return Error(ErrorCode::kUnsupported, "KV policy '{}' is not built into this binary",
               config.policy);
}

}  // namespace shadowkv::kv
