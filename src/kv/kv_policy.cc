// MakeKvPolicy: the one place that maps a policy name to its implementation.
#include "kv/kv_policy.h"

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

Result<std::unique_ptr<KvPolicy>> MakeKvPolicy(const KvPolicyConfig& config,
                                                const KvGeometry& geometry) {
  SKV_RETURN_IF_ERROR(config.Validate());
  if (geometry.num_kv_heads <= 0 || geometry.num_query_heads % geometry.num_kv_heads != 0) {
    return Error(ErrorCode::kInvalidArgument, "{} query heads do not group over {} KV heads",
                 geometry.num_query_heads, geometry.num_kv_heads);
  }
  if (config.policy == "full") return MakeFullPolicy(config, geometry);
  if (config.policy == "shadowkv") return MakeShadowKvPolicy(config, geometry);
  if (config.policy == "snapkv") return MakeSnapKvPolicy(config, geometry);
  if (config.policy == "quest") return MakeQuestPolicy(config, geometry);
  if (config.policy == "streaming") return MakeStreamingPolicy(config, geometry);
  return Error(ErrorCode::kUnsupported, "KV policy '{}' is not built into this binary",
               config.policy);
}

}  // namespace shadowkv::kv
