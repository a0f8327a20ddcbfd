// Factories of the KV policies (one per policy file); MakeKvPolicy dispatches to them. Also the
// policies by kind, for code that branches on which one a setting names.
#pragma once

#include <memory>
#include <optional>
#include <string_view>

#include "kv/kv_policy.h"

namespace shadowkv::kv {

// One per name of KnownKvPolicies(), in its order.
enum class PolicyKind { kFull, kShadowKv, kSnapKv, kQuest, kStreaming };

// The kind a policy name (KvPolicyConfig::policy) names; nullopt for a name that is not known.
std::optional<PolicyKind> PolicyKindOf(std::string_view name);
// Whether `config` names the policy of `kind`.
inline bool IsPolicy(const KvPolicyConfig& config, PolicyKind kind) {
  return PolicyKindOf(config.policy) == kind;
}

Result<std::unique_ptr<KvPolicy>> MakeFullPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeShadowKvPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeSnapKvPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeQuestPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeStreamingPolicy(const KvPolicyConfig&, const KvGeometry&);

// Sliding-window geometries (KvGeometry::layer_windowed one flag per layer and a positive window,
// as MakeKvPolicy checks before it calls this): the windowed layers keep the
// tokens their window reaches, exactly (sliding_split_policy.cc); the global layers go to
// `global`, the named policy made by its factory above for GlobalLayersGeometry(geometry) and
// GlobalLayersConfig(config, geometry). The result is named as `global` and reports `config`.
Result<std::unique_ptr<KvPolicy>> MakeSlidingSplitPolicy(const KvPolicyConfig& config,
                                                         const KvGeometry& geometry,
                                                         std::unique_ptr<KvPolicy> global);
// The global (not windowed) layers alone, numbered 0.. in the model's order; no window.
KvGeometry GlobalLayersGeometry(const KvGeometry& geometry);
// `config` for the global layers: settings that count the model's first layers (exact_layers,
// quest_dense_layers) count the global layers among those.
KvPolicyConfig GlobalLayersConfig(const KvPolicyConfig& config, const KvGeometry& geometry);

}  // namespace shadowkv::kv
