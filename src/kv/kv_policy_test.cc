// The policy kinds: every known policy name has its own kind, and MakeKvPolicy reaches each.
#include "kv/kv_policy.h"

#include <gtest/gtest.h>

#include <set>

#include "kv/policies.h"
#include "support/policy_test_util.h"

namespace shadowkv::kv {
namespace {

TEST(PolicyKindTest, EveryKnownNameHasItsOwnKind) {
  std::set<PolicyKind> kinds;
  for (const std::string& name : KnownKvPolicies()) {
    const std::optional<PolicyKind> kind = PolicyKindOf(name);
    ASSERT_TRUE(kind.has_value()) << name;
    EXPECT_TRUE(kinds.insert(*kind).second) << name << " shares its kind";
  }
  EXPECT_EQ(PolicyKindOf("shadowkv"), PolicyKind::kShadowKv);
  EXPECT_EQ(PolicyKindOf("streaming"), PolicyKind::kStreaming);
  EXPECT_FALSE(PolicyKindOf("ShadowKV").has_value());
  EXPECT_FALSE(PolicyKindOf("").has_value());
}

TEST(PolicyKindTest, IsPolicyComparesTheNamedKind) {
  KvPolicyConfig config;
  config.policy = "snapkv";
  EXPECT_TRUE(IsPolicy(config, PolicyKind::kSnapKv));
  EXPECT_FALSE(IsPolicy(config, PolicyKind::kFull));
  config.policy = "nonsense";
  EXPECT_FALSE(IsPolicy(config, PolicyKind::kFull));
}

TEST(PolicyKindTest, MakeKvPolicyBuildsEveryKnownPolicy) {
  const KvGeometry geometry = testing::SmallGeometry();
  for (const std::string& name : KnownKvPolicies()) {
    KvPolicyConfig config;
    config.policy = name;
    auto policy = MakeKvPolicy(config, geometry);
    EXPECT_TRUE(policy.ok()) << name << ": " << policy.status().ToString();
  }
}

}  // namespace
}  // namespace shadowkv::kv
