// Engine::Run on a tiny random model: every policy's output equals greedy decoding by hand, a
// bad request fails alone, on_token can stop a request, token times are in order.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <random>

#include "../../tests/unit/tiny_model.h"
#include "kv/policies.h"
#include "support/greedy_by_hand.h"

namespace shadowkv {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    testing::TinyModelSpec spec;
    spec.context = 1024;
    model_ = CpuModel::Load(testing::WriteTinyModel(spec, "engine"), 1).value().release();
    serving_ = new engine::CpuServingModel(*model_);
  }
  static void TearDownTestSuite() {
    delete serving_;
    delete model_;
  }

  static std::unique_ptr<kv::KvPolicy> Policy(const std::string& name) {
    kv::KvPolicyConfig config;
    config.policy = name;
    config.budget_tokens = 64;
    return serving_->MakePolicy(config).value();
  }

  static GenerationRequest Request(int length, uint32_t seed, int max_new) {
    std::mt19937 rng(seed);
    GenerationRequest r;
    r.prompt.resize(length);
    for (auto& t : r.prompt) t = static_cast<int32_t>(rng() % 256);
    r.max_new_tokens = max_new;
    r.stop_at_end_of_generation = false;
    return r;
  }

  // One prompt in one chunk, then greedy decoding, straight on the model.
  static std::vector<int32_t> ByHand(const kv::KvPolicy& policy, const GenerationRequest& r) {
    auto kv = policy.NewSequence().value();
    return testing::GreedyByHand(*model_, *kv, r.prompt, r.prompt.size(), true, r.max_new_tokens);
  }

  static CpuModel* model_;
  static engine::CpuServingModel* serving_;
};

CpuModel* EngineTest::model_ = nullptr;
engine::CpuServingModel* EngineTest::serving_ = nullptr;

TEST_F(EngineTest, EveryPolicyMatchesGreedyDecodingByHand) {
  for (const char* name : {"full", "shadowkv", "snapkv", "quest", "streaming"}) {
    SCOPED_TRACE(name);
    auto policy = Policy(name);
    EngineOptions options;
    options.prefill_chunk = 512;  // every prompt in one chunk, as ByHand feeds it
    options.max_batch = 2;        // fewer than the requests: later ones wait for a place
    Engine engine(*serving_, *policy, options);
    std::vector<GenerationRequest> requests = {Request(300, 1, 9), Request(40, 2, 5),
                                               Request(200, 3, 12)};
    const auto results = engine.Run(requests);
    ASSERT_EQ(results.size(), requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_TRUE(results[i].status.ok()) << results[i].status.ToString();
      EXPECT_EQ(results[i].finish_reason, FinishReason::kLength);
      EXPECT_EQ(results[i].tokens, ByHand(*policy, requests[i])) << "request " << i;
      ASSERT_EQ(results[i].token_seconds.size(), results[i].tokens.size());
      EXPECT_TRUE(std::is_sorted(results[i].token_seconds.begin(), results[i].token_seconds.end()));
      EXPECT_EQ(results[i].prefill_seconds, results[i].token_seconds.front());
      EXPECT_GT(results[i].kv_memory.fast_bytes, 0);
    }
  }
}

TEST_F(EngineTest, ABadRequestFailsAloneAndOnTokenStopsARequest) {
  auto policy = Policy("full");
  Engine engine(*serving_, *policy, EngineOptions{});
  std::vector<GenerationRequest> requests = {Request(20, 4, 6), Request(1020, 5, 10),
                                             Request(30, 6, 8)};
  requests.push_back(Request(25, 7, 4));
  requests.back().sampling.top_p = 0.0f;  // impossible
  std::vector<int> seen(requests.size(), 0);
  const auto results = engine.Run(requests, [&](int request, int32_t) {
    return ++seen[request] < 3 || request != 2;  // request 2 stops after its third token
  });
  EXPECT_TRUE(results[0].status.ok());
  EXPECT_EQ(results[0].tokens, ByHand(*policy, requests[0]));
  EXPECT_EQ(results[1].status.code(), ErrorCode::kOutOfRange) << results[1].status.ToString();
  EXPECT_EQ(results[1].finish_reason, FinishReason::kError);
  EXPECT_TRUE(results[2].status.ok());
  EXPECT_EQ(results[2].finish_reason, FinishReason::kStop);
  EXPECT_EQ(results[2].tokens.size(), 3u);
  EXPECT_EQ(seen[2], 3);
  EXPECT_EQ(results[3].status.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(results[3].tokens.empty());
}

}  // namespace
}  // namespace shadowkv
