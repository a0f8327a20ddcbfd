// Factories of the KV policies (one per policy file); MakeKvPolicy dispatches to them.
#pragma once

#include <memory>

#include "kv/kv_policy.h"

namespace shadowkv::kv {

Result<std::unique_ptr<KvPolicy>> MakeFullPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeShadowKvPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeSnapKvPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeQuestPolicy(const KvPolicyConfig&, const KvGeometry&);
Result<std::unique_ptr<KvPolicy>> MakeStreamingPolicy(const KvPolicyConfig&, const KvGeometry&);

}  // namespace shadowkv::kv
