// PrefixCache: longest proper token prefix under the same policy key, exclusive use of states
// that do not fork, shared use of those that do, LRU order.
#include "engine/prefix_cache.h"

#include <gtest/gtest.h>

namespace shadowkv::engine {
namespace {

// A KV state that only knows its size (the cache never runs attention).
class FakeSequence : public kv::SequenceKv {
 public:
  explicit FakeSequence(int64_t tokens) : tokens_(tokens) {}
  Status Append(int, const kv::TokenBlock&) override { return Status::Ok(); }
  Status Prepare(int, const float*, int, kv::AttentionInput*) override { return Status::Ok(); }
  Status FinishPrefill(int) override { return Status::Ok(); }
  int64_t num_tokens() const override { return tokens_; }
  kv::MemoryUsage memory() const override { return {tokens_ * 10, tokens_}; }
  const kv::PolicyStats& stats() const override { return stats_; }

 private:
  int64_t tokens_;
  kv::PolicyStats stats_;
};

// One that forks while `room` copies are left (then kResourceExhausted, as a full GPU pool).
class ForkingSequence : public FakeSequence {
 public:
  ForkingSequence(int64_t tokens, std::shared_ptr<int> room)
      : FakeSequence(tokens), room_(std::move(room)) {}
  Result<std::unique_ptr<kv::SequenceKv>> Fork() const override {
    if (*room_ == 0) return Error(ErrorCode::kResourceExhausted, "no room");
    --*room_;
    return std::unique_ptr<kv::SequenceKv>(new ForkingSequence(num_tokens(), room_));
  }

 private:
  std::shared_ptr<int> room_;
};

HeldState Held(std::string key, std::vector<int32_t> tokens) {
  HeldState s;
  s.policy_key = std::move(key);
  s.kv = std::make_unique<FakeSequence>(static_cast<int64_t>(tokens.size()));
  s.tokens = std::move(tokens);
  return s;
}

TEST(PrefixCacheTest, TakesLongestProperPrefixOfTheSamePolicy) {
  PrefixCache cache(8);
  cache.Put(Held("", {1, 2}));
  cache.Put(Held("", {1, 2, 3, 4}));
  cache.Put(Held("", {1, 2, 3, 4, 5, 6}));         // as long as the prompt: nothing left to run
  cache.Put(Held("", {1, 9, 3}));                  // diverges
  cache.Put(Held("shadowkv/0", {1, 2, 3, 4, 5}));  // other settings
  EXPECT_EQ(cache.size(), 5u);
  EXPECT_EQ(cache.memory().fast_bytes, (2 + 4 + 6 + 3 + 5) * 10);

  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  auto taken = cache.Take("", prompt);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->tokens, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(cache.size(), 4u);
  // In use by one request: a second identical prompt gets the next best.
  auto second = cache.Take("", prompt);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_FALSE(cache.Take("", prompt).has_value());
  auto other = cache.Take("shadowkv/0", prompt);
  ASSERT_TRUE(other.has_value());
  EXPECT_EQ(other->tokens.size(), 5u);
  EXPECT_FALSE(cache.Take("", std::vector<int32_t>{7, 8, 9}).has_value());
}

TEST(PrefixCacheTest, EvictsLeastRecentlyUsed) {
  PrefixCache cache(2);
  cache.Put(Held("", {1}));
  cache.Put(Held("", {2}));
  cache.Put(Held("", {3}));  // pushes out {1}
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_FALSE(cache.Take("", std::vector<int32_t>{1, 5}).has_value());
  auto two = cache.Take("", std::vector<int32_t>{2, 5});
  ASSERT_TRUE(two.has_value());
  cache.Put(std::move(*two));        // {2} is now the most recent
  ASSERT_TRUE(cache.EvictOldest());  // drops {3}
  EXPECT_FALSE(cache.Take("", std::vector<int32_t>{3, 5}).has_value());
  EXPECT_TRUE(cache.Take("", std::vector<int32_t>{2, 5}).has_value());
  EXPECT_FALSE(cache.EvictOldest());
}

// A state that forks serves every request with its prefix and stays held; once copies run
// out, the state itself goes to the next request.
TEST(PrefixCacheTest, ForkingStatesAreSharedUntilCopiesRunOut) {
  PrefixCache cache(4);
  auto room = std::make_shared<int>(2);
  HeldState shared;
  shared.tokens = {1, 2, 3};
  shared.kv = std::make_unique<ForkingSequence>(3, room);
  cache.Put(std::move(shared));
  cache.Put(Held("", {4}));  // the most recent until the shared one is used
  const std::vector<int32_t> prompt = {1, 2, 3, 4};
  for (int i = 0; i < 2; ++i) {
    auto copy = cache.Take("", prompt);
    ASSERT_TRUE(copy.has_value());
    EXPECT_TRUE(copy->copy);
    EXPECT_EQ(copy->tokens, (std::vector<int32_t>{1, 2, 3}));
    EXPECT_EQ(copy->kv->num_tokens(), 3);
    EXPECT_EQ(cache.size(), 2u);
  }
  ASSERT_TRUE(cache.EvictOldest());  // {4}: the shared state was used more recently
  auto last = cache.Take("", prompt);
  ASSERT_TRUE(last.has_value());
  EXPECT_FALSE(last->copy);
  EXPECT_EQ(cache.size(), 0u);
}

TEST(PrefixCacheTest, ZeroCapacityHoldsNothing) {
  PrefixCache cache(0);
  cache.Put(Held("", {1}));
  EXPECT_EQ(cache.size(), 0u);
}

}  // namespace
}  // namespace shadowkv::engine
