// Scheduler on a tiny random model: batched output equals greedy decoding alone, reuse continues a
// held state exactly, queue bound, memory admission, cancel, timeout and shutdown.
#include "engine/scheduler.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "../../tests/unit/tiny_model.h"
#include "support/greedy_by_hand.h"

namespace shadowkv::engine {
namespace {

using namespace std::chrono_literals;

class SchedulerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    testing::TinyModelSpec spec;
    spec.context = 2048;
    model_ = CpuModel::Load(testing::WriteTinyModel(spec, "scheduler"), 1).value().release();
    serving_ = new CpuServingModel(*model_);
  }
  static void TearDownTestSuite() {
    delete serving_;
    serving_ = nullptr;
    delete model_;
    model_ = nullptr;
  }

  std::unique_ptr<kv::KvPolicy> Policy(const std::string& name) {
    kv::KvPolicyConfig config;
    config.policy = name;
    config.budget_tokens = 64;
    return kv::MakeKvPolicy(config, model_->kv_geometry()).value();
  }

  static std::vector<int32_t> RandomPrompt(int length, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> tokens(length);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % 256);
    return tokens;
  }

  SequenceRequest Request(const kv::KvPolicy& policy, std::vector<int32_t> prompt, int max_new) {
    SequenceRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = max_new;
    r.policy = &policy;
    r.policy_key = std::string(policy.name());
    r.stop_at_end_of_generation = false;  // a random model may end its turn anywhere
    return r;
  }

  // Waits for the end and returns every generated token.
  static std::vector<int32_t> Collect(SequenceHandle& handle) {
    std::vector<int32_t> tokens;
    while (!handle.Wait(1000ms, &tokens)) {
    }
    return tokens;
  }

  // Greedy decoding of one prompt by hand, straight on the CPU model: prefill in chunks of
  // `chunk`, then one token per step.
  static std::vector<int32_t> GreedyAlone(const kv::KvPolicy& policy,
                                          const std::vector<int32_t>& prompt, int max_new,
                                          int chunk) {
    auto kv = policy.NewSequence().value();
    return testing::GreedyByHand(*model_, *kv, prompt, chunk, true, max_new);
  }

  // Every request ended by its length with the tokens greedy decoding gives it alone.
  static void ExpectEachAsAlone(const std::vector<SequenceRequest>& requests,
                                const std::vector<std::shared_ptr<SequenceHandle>>& handles,
                                const kv::KvPolicy& policy) {
    for (size_t i = 0; i < requests.size(); ++i) {
      const std::vector<int32_t> got = Collect(*handles[i]);
      EXPECT_EQ(handles[i]->end_reason(), EndReason::kLength) << handles[i]->status().ToString();
      EXPECT_EQ(got, GreedyAlone(policy, requests[i].prompt, requests[i].max_new_tokens, 32))
          << "request " << i;
    }
  }

  static CpuModel* model_;
  static CpuServingModel* serving_;
};

CpuModel* SchedulerTest::model_ = nullptr;
CpuServingModel* SchedulerTest::serving_ = nullptr;

TEST_F(SchedulerTest, ConcurrentRequestsMatchEngineRunAlone) {
  auto policy = Policy("full");
  SchedulerOptions options;
  options.prefill_chunk = 32;
  options.max_batch = 4;  // fewer slots than requests: later ones join a running batch
  Scheduler scheduler(*serving_, options, nullptr);
  std::vector<SequenceRequest> requests;
  const int lengths[] = {5, 40, 100, 1, 33, 64, 70};
  const int new_tokens[] = {12, 3, 20, 7, 15, 1, 9};
  for (int i = 0; i < 7; ++i) {
    requests.push_back(Request(*policy, RandomPrompt(lengths[i], 100 + i), new_tokens[i]));
  }
  std::vector<std::shared_ptr<SequenceHandle>> handles;
  for (const auto& r : requests) {
    SubmitResult s = scheduler.Submit(r);
    ASSERT_EQ(s.code, SubmitResult::Code::kOk) << s.message;
    handles.push_back(s.handle);
  }
  ExpectEachAsAlone(requests, handles, *policy);
}

// The reference for a continued conversation: one KV state fed turn 1, its decode, then turn 2.
std::vector<int32_t> ContinueByHand(CpuModel& model, const kv::KvPolicy& policy,
                                    const std::vector<int32_t>& prompt,
                                    const std::vector<int32_t>& turn1, size_t fed_turn1,
                                    const std::vector<int32_t>& turn2_new, int chunk, int max_new) {
  auto kv = policy.NewSequence().value();
  std::vector<float> logits;
  testing::FeedByHand(model, *kv, prompt, chunk, true, logits);
  testing::FeedByHand(model, *kv, std::span<const int32_t>(turn1).first(fed_turn1), 1, false,
                      logits);
  return testing::GreedyByHand(model, *kv, turn2_new, chunk, false, max_new);
}

TEST_F(SchedulerTest, SecondTurnReusesTheHeldStateForEveryPolicy) {
  for (const char* name : {"full", "shadowkv", "snapkv", "quest", "streaming"}) {
    SCOPED_TRACE(name);
    auto policy = Policy(name);
    SchedulerOptions options;
    options.prefill_chunk = 64;
    Scheduler scheduler(*serving_, options, nullptr);
    const std::vector<int32_t> prompt = RandomPrompt(300, 7);
    auto first = scheduler.Submit(Request(*policy, prompt, 6));
    ASSERT_EQ(first.code, SubmitResult::Code::kOk);
    const std::vector<int32_t> turn1 = Collect(*first.handle);
    ASSERT_EQ(turn1.size(), 6u);
    EXPECT_EQ(first.handle->reused_tokens(), 0);

    // Turn 2: the whole conversation so far (the last generated token was never fed, so it is
    // part of the new text here) plus a follow-up.
    std::vector<int32_t> turn2 = prompt;
    turn2.insert(turn2.end(), turn1.begin(), turn1.end());
    const std::vector<int32_t> followup = RandomPrompt(90, 8);
    turn2.insert(turn2.end(), followup.begin(), followup.end());
    auto second = scheduler.Submit(Request(*policy, turn2, 8));
    ASSERT_EQ(second.code, SubmitResult::Code::kOk);
    const std::vector<int32_t> got = Collect(*second.handle);
    EXPECT_EQ(second.handle->reused_tokens(), static_cast<int64_t>(prompt.size() + 5));

    std::vector<int32_t> new_part(turn2.begin() + static_cast<ptrdiff_t>(prompt.size() + 5),
                                  turn2.end());
    EXPECT_EQ(got, ContinueByHand(*model_, *policy, prompt, turn1, 5, new_part, 64, 8));

    // Without reuse the same prompt is prefilled from scratch.
    SequenceRequest fresh = Request(*policy, turn2, 2);
    fresh.reuse = false;
    auto third = scheduler.Submit(fresh);
    Collect(*third.handle);
    EXPECT_EQ(third.handle->reused_tokens(), 0);
  }
}

// A policy with room for `slots` live sequences (as the GPU's fixed slots): NewSequence answers
// kResourceExhausted beyond them.
class SlottedPolicy : public kv::KvPolicy {
 public:
  SlottedPolicy(std::unique_ptr<kv::KvPolicy> inner, int slots)
      : KvPolicy(inner->config(), inner->geometry()),
        inner_(std::move(inner)),
        free_(std::make_shared<int>(slots)) {}
  std::string_view name() const override { return inner_->name(); }
  kv::MemoryUsage EstimateMemory(int64_t n) const override { return inner_->EstimateMemory(n); }
  Result<std::unique_ptr<kv::SequenceKv>> NewSequence() const override {
    if (*free_ == 0) return Error(ErrorCode::kResourceExhausted, "no free slot");
    SKV_ASSIGN_OR_RETURN(auto kv, inner_->NewSequence());
    --*free_;
    return std::unique_ptr<kv::SequenceKv>(new Slot(std::move(kv), free_));
  }
  int free() const { return *free_; }

 private:
  struct Slot : kv::ForwardingSequenceKv {
    Slot(std::unique_ptr<kv::SequenceKv> kv, std::shared_ptr<int> free)
        : ForwardingSequenceKv(std::move(kv)), free(std::move(free)) {}
    ~Slot() override { ++*free; }
    std::shared_ptr<int> free;
  };
  std::unique_ptr<kv::KvPolicy> inner_;
  std::shared_ptr<int> free_;
};

// A policy whose sequences report, as their cumulative statistics, one chunk selection per
// token they hold: a state continued over turns keeps counting from where it was.
class TokenCountingPolicy : public kv::KvPolicy {
 public:
  explicit TokenCountingPolicy(std::unique_ptr<kv::KvPolicy> inner)
      : KvPolicy(inner->config(), inner->geometry()), inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  kv::MemoryUsage EstimateMemory(int64_t n) const override { return inner_->EstimateMemory(n); }
  Result<std::unique_ptr<kv::SequenceKv>> NewSequence() const override {
    SKV_ASSIGN_OR_RETURN(auto kv, inner_->NewSequence());
    return std::unique_ptr<kv::SequenceKv>(new Counted(std::move(kv)));
  }

 private:
  struct Counted : kv::ForwardingSequenceKv {
    using ForwardingSequenceKv::ForwardingSequenceKv;
    const kv::PolicyStats& stats() const override {
      counted.chunk_selections = inner_->num_tokens();
      return counted;
    }
    mutable kv::PolicyStats counted;
  };
  std::unique_ptr<kv::KvPolicy> inner_;
};

// Sums what the loop reports of each policy's statistics.
class PolicyStatsObserver : public EngineObserver {
 public:
  void AddPolicyStats(std::string_view policy, const kv::PolicyStats& stats) override {
    std::lock_guard lock(mutex_);
    stats_[std::string(policy)] += stats;
  }
  int64_t selections(const std::string& policy) {
    std::lock_guard lock(mutex_);
    return stats_[policy].chunk_selections;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, kv::PolicyStats> stats_;
};

// The metrics count each turn of a held state once: after two turns of one conversation they
// hold the state's final statistics, not the first turn's twice.
TEST_F(SchedulerTest, MetricsCountEachTurnOfAHeldStateOnce) {
  TokenCountingPolicy policy(Policy("full"));
  SchedulerOptions options;
  options.prefill_chunk = 32;
  PolicyStatsObserver metrics;
  Scheduler scheduler(*serving_, options, &metrics);
  const std::vector<int32_t> prompt = RandomPrompt(40, 21);
  auto first = scheduler.Submit(Request(policy, prompt, 5));
  ASSERT_EQ(first.code, SubmitResult::Code::kOk);
  std::vector<int32_t> turn2 = prompt;
  const std::vector<int32_t> turn1 = Collect(*first.handle);
  ASSERT_EQ(turn1.size(), 5u);
  turn2.insert(turn2.end(), turn1.begin(), turn1.end());
  const std::vector<int32_t> followup = RandomPrompt(12, 22);
  turn2.insert(turn2.end(), followup.begin(), followup.end());
  auto second = scheduler.Submit(Request(policy, turn2, 7));
  ASSERT_EQ(second.code, SubmitResult::Code::kOk);
  EXPECT_EQ(Collect(*second.handle).size(), 7u);
  ASSERT_EQ(second.handle->reused_tokens(), 44);  // the first turn's state: 40 + 5 - 1
  // The state ends holding the second prompt and every generated token but the last.
  const int64_t final_tokens = static_cast<int64_t>(turn2.size()) + 7 - 1;
  EXPECT_EQ(metrics.selections("full"), final_tokens);
}

// An observer slow to take each step's timings: the loop's work after a step's replies ended
// then lasts long enough for a client to look at the gauges in between.
class SlowStepObserver : public EngineObserver {
 public:
  void AddStep(const StepTimes& /*times*/) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
};

// A client that reads the gauges (what /metrics shows) once its reply has ended sees its own
// sequence gone and its state held: they are published before the end is, not after the step.
TEST_F(SchedulerTest, GaugesAreCurrentWhenAReplyEnds) {
  auto policy = Policy("full");
  SchedulerOptions options;
  options.max_held_states = 4;
  SlowStepObserver observer;
  Scheduler scheduler(*serving_, options, &observer);
  for (int i = 0; i < 6; ++i) {
    auto submitted = scheduler.Submit(Request(*policy, RandomPrompt(12, 400 + i), 3));
    ASSERT_EQ(submitted.code, SubmitResult::Code::kOk) << submitted.message;
    EXPECT_EQ(Collect(*submitted.handle).size(), 3u);
    const EngineGauges gauges = scheduler.gauges();
    EXPECT_EQ(gauges.running_sequences, 0) << "request " << i;
    EXPECT_EQ(gauges.held_states, std::min(i + 1, 4)) << "request " << i;
  }
}

TEST_F(SchedulerTest, RequestsWaitForAFreeSlotAndHeldStatesGiveTheirsUp) {
  SlottedPolicy policy(Policy("full"), 2);
  SchedulerOptions options;
  options.prefill_chunk = 32;
  options.max_batch = 4;  // more batch places than slots
  options.max_held_states = 4;
  Scheduler scheduler(*serving_, options, nullptr);
  std::vector<SequenceRequest> requests;
  std::vector<std::shared_ptr<SequenceHandle>> handles;
  for (int i = 0; i < 5; ++i) {
    requests.push_back(Request(policy, RandomPrompt(20 + 7 * i, 200 + i), 6 + i));
    SubmitResult s = scheduler.Submit(requests.back());
    ASSERT_EQ(s.code, SubmitResult::Code::kOk) << s.message;
    handles.push_back(s.handle);
  }
  ExpectEachAsAlone(requests, handles, *Policy("full"));
  // Finished states are held (both slots), yet a new request still gets one.
  while (scheduler.gauges().running_sequences != 0) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(policy.free(), 0);
  auto later = scheduler.Submit(Request(policy, RandomPrompt(9, 300), 3));
  ASSERT_EQ(later.code, SubmitResult::Code::kOk);
  EXPECT_EQ(Collect(*later.handle).size(), 3u);
  EXPECT_EQ(later.handle->end_reason(), EndReason::kLength);
}

TEST_F(SchedulerTest, QueueBoundRefusesAndAcceptedRequestsFinish) {
  auto policy = Policy("full");
  SchedulerOptions options;
  options.max_batch = 1;
  options.max_queue = 2;
  Scheduler scheduler(*serving_, options, nullptr);
  auto running = scheduler.Submit(Request(*policy, RandomPrompt(8, 1), 1500));
  ASSERT_EQ(running.code, SubmitResult::Code::kOk);
  while (scheduler.gauges().running_sequences == 0) std::this_thread::sleep_for(1ms);
  auto b = scheduler.Submit(Request(*policy, RandomPrompt(8, 2), 3));
  auto c = scheduler.Submit(Request(*policy, RandomPrompt(8, 3), 3));
  auto d = scheduler.Submit(Request(*policy, RandomPrompt(8, 4), 3));
  EXPECT_EQ(b.code, SubmitResult::Code::kOk);
  EXPECT_EQ(c.code, SubmitResult::Code::kOk);
  EXPECT_EQ(d.code, SubmitResult::Code::kQueueFull);
  EXPECT_GE(scheduler.RetryAfterSeconds(), 1);
  EXPECT_EQ(Collect(*running.handle).size(), 1500u);
  EXPECT_EQ(Collect(*b.handle).size(), 3u);
  EXPECT_EQ(Collect(*c.handle).size(), 3u);
}

TEST_F(SchedulerTest, MemoryLimitAdmitsOneAtATimeAndRefusesTheImpossible) {
  auto policy = Policy("full");
  SchedulerOptions options;
  options.fast_memory_limit = policy->EstimateMemory(300).fast_bytes;
  options.max_held_states = 0;
  Scheduler scheduler(*serving_, options, nullptr);
  auto a = scheduler.Submit(Request(*policy, RandomPrompt(100, 1), 150));
  auto b = scheduler.Submit(Request(*policy, RandomPrompt(100, 2), 150));
  ASSERT_EQ(a.code, SubmitResult::Code::kOk);
  ASSERT_EQ(b.code, SubmitResult::Code::kOk);
  std::vector<int32_t> b_tokens;
  while (b_tokens.empty()) b.handle->Wait(1000ms, &b_tokens);
  // Two sequences of 250 tokens do not fit a budget of 300: b started only after a ended.
  EXPECT_EQ(a.handle->end_reason(), EndReason::kLength);
  Collect(*b.handle);
  auto too_big = scheduler.Submit(Request(*policy, RandomPrompt(100, 3), 250));
  EXPECT_EQ(too_big.code, SubmitResult::Code::kTooLarge);
  EXPECT_EQ(scheduler.Submit(Request(*policy, {}, 3)).code, SubmitResult::Code::kInvalid);
  EXPECT_EQ(scheduler.Submit(Request(*policy, RandomPrompt(2000, 3), 100)).code,
            SubmitResult::Code::kInvalid);
}

TEST_F(SchedulerTest, CancelTimeoutAndShutdownEndSequences) {
  auto policy = Policy("full");
  Scheduler scheduler(*serving_, SchedulerOptions{}, nullptr);
  auto cancelled = scheduler.Submit(Request(*policy, RandomPrompt(10, 1), 2000));
  std::vector<int32_t> tokens;
  while (tokens.empty()) cancelled.handle->Wait(1000ms, &tokens);
  cancelled.handle->Cancel();
  Collect(*cancelled.handle);
  EXPECT_EQ(cancelled.handle->end_reason(), EndReason::kCancelled);

  SequenceRequest slow = Request(*policy, RandomPrompt(10, 2), 2000);
  slow.deadline = Clock::now() + 30ms;
  auto timed = scheduler.Submit(slow);
  Collect(*timed.handle);
  EXPECT_EQ(timed.handle->end_reason(), EndReason::kTimeout);

  auto pending = scheduler.Submit(Request(*policy, RandomPrompt(10, 3), 2000));
  scheduler.Shutdown(0ms);
  Collect(*pending.handle);
  EXPECT_EQ(pending.handle->end_reason(), EndReason::kShutdown);
  EXPECT_EQ(scheduler.Submit(Request(*policy, RandomPrompt(10, 4), 3)).code,
            SubmitResult::Code::kShuttingDown);
  EXPECT_EQ(scheduler.gauges().running_sequences, 0);
}

}  // namespace
}  // namespace shadowkv::engine

namespace shadowkv::engine {
namespace {

// A request with sampling draws the same tokens alone and in a batch: a draw depends on (seed,
// the sequence's draw count) only, never on the row or the step.
TEST_F(SchedulerTest, SampledRequestsDrawTheSameTokensAloneAndBatched) {
  auto policy = Policy("full");
  auto sampled = [&](uint64_t seed) {
    SequenceRequest r = Request(*policy, RandomPrompt(30, 40), 24);
    r.sampling.temperature = 8.0f;  // the tiny model is peaked: flatten it
    r.sampling.top_k = 40;
    r.sampling.top_p = 0.98f;
    r.sampling.seed = seed;
    return r;
  };
  SchedulerOptions options;
  options.prefill_chunk = 16;
  options.max_batch = 1;
  std::vector<int32_t> alone;
  {
    Scheduler scheduler(*serving_, options, nullptr);
    auto s = scheduler.Submit(sampled(5));
    ASSERT_EQ(s.code, SubmitResult::Code::kOk);
    alone = Collect(*s.handle);
  }
  ASSERT_EQ(alone.size(), 24u);
  options.max_batch = 4;
  Scheduler scheduler(*serving_, options, nullptr);
  std::vector<std::shared_ptr<SequenceHandle>> handles;
  // Others first, so the request joins a running batch in a later row and step.
  for (uint32_t i = 0; i < 3; ++i) {
    handles.push_back(scheduler.Submit(Request(*policy, RandomPrompt(50, 60 + i), 30)).handle);
  }
  auto batched = scheduler.Submit(sampled(5));
  auto other_seed = scheduler.Submit(sampled(6));
  ASSERT_EQ(batched.code, SubmitResult::Code::kOk);
  ASSERT_EQ(other_seed.code, SubmitResult::Code::kOk);
  EXPECT_EQ(Collect(*batched.handle), alone);
  // The seed matters (24 draws at temperature 8 from 40 candidates do not all coincide).
  EXPECT_NE(Collect(*other_seed.handle), alone);
  for (auto& h : handles) Collect(*h);
}

// A held prompt whose state forks serves several requests at once: each starts from a copy
// (no prefill of the shared part) and decodes as if alone.
TEST_F(SchedulerTest, AHeldPromptServesConcurrentRequestsThroughCopies) {
  auto policy = Policy("full");  // its states fork
  SchedulerOptions options;
  options.prefill_chunk = 32;
  options.max_batch = 4;
  Scheduler scheduler(*serving_, options, nullptr);
  const std::vector<int32_t> shared = RandomPrompt(70, 31);
  auto warm = scheduler.Submit(Request(*policy, shared, 1));
  ASSERT_EQ(warm.code, SubmitResult::Code::kOk);
  Collect(*warm.handle);  // its state (the 70 prompt tokens) is now held
  std::vector<SequenceRequest> requests;
  std::vector<std::shared_ptr<SequenceHandle>> handles;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> prompt = shared;
    prompt.push_back(10 + i);
    requests.push_back(Request(*policy, prompt, 6 + i));
    handles.push_back(scheduler.Submit(requests.back()).handle);
  }
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> got = Collect(*handles[i]);
    EXPECT_EQ(handles[i]->reused_tokens(), 70) << "request " << i;
    // The copy holds the prompt prefilled in chunks of 32; the new token goes in alone.
    auto kv = policy->NewSequence().value();
    std::vector<float> logits;
    testing::FeedByHand(*model_, *kv, shared, 32, true, logits);
    const std::vector<int32_t> want =
        testing::GreedyByHand(*model_, *kv, std::span<const int32_t>(&requests[i].prompt.back(), 1),
                              1, false, requests[i].max_new_tokens);
    EXPECT_EQ(got, want) << "request " << i;
  }
}

// Records every step's rows before passing it on; its first step waits until released, so the
// requests submitted meanwhile are admitted together.
class RecordingModel : public ServingModel {
 public:
  explicit RecordingModel(ServingModel& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  const Tokenizer& tokenizer() const override { return inner_.tokenizer(); }
  const gguf::GgufFile& file() const override { return inner_.file(); }
  std::string device() const override { return inner_.device(); }
  Result<std::unique_ptr<kv::KvPolicy>> MakePolicy(
      const kv::KvPolicyConfig& config) const override {
    return inner_.MakePolicy(config);
  }
  Status Step(std::span<const StepRow> rows, std::span<int32_t> next_tokens) override {
    released_.wait(false);
    {
      std::lock_guard lock(mutex_);
      std::vector<int64_t> sizes;
      for (const StepRow& row : rows) sizes.push_back(std::ssize(row.tokens));
      steps_.push_back(std::move(sizes));
    }
    return inner_.Step(rows, next_tokens);
  }
  void Release() {
    released_ = true;
    released_.notify_all();
  }
  std::vector<std::vector<int64_t>> steps() {
    std::lock_guard lock(mutex_);
    return steps_;
  }

 private:
  ServingModel& inner_;
  std::atomic<bool> released_{false};
  std::mutex mutex_;
  std::vector<std::vector<int64_t>> steps_;  // per step, each row's token count
};

// Prompts share a step's prompt budget: short prompts and last chunks go together, a long
// prompt is cut into chunks of the budget (as alone), and no step carries more than the budget.
TEST_F(SchedulerTest, PromptChunksOfSeveralRequestsShareTheStepBudget) {
  auto policy = Policy("full");
  RecordingModel recording(*serving_);
  SchedulerOptions options;
  options.prefill_chunk = 48;
  options.max_batch = 8;
  Scheduler scheduler(recording, options, nullptr);
  std::vector<SequenceRequest> requests;
  std::vector<std::shared_ptr<SequenceHandle>> handles;
  const int lengths[] = {10, 20, 70, 5};
  for (int i = 0; i < 4; ++i) {
    requests.push_back(Request(*policy, RandomPrompt(lengths[i], 500 + i), 4));
  }
  // The first request's step holds the loop while the other three queue.
  handles.push_back(scheduler.Submit(requests[0]).handle);
  while (scheduler.gauges().running_sequences == 0) std::this_thread::sleep_for(1ms);
  for (int i = 1; i < 4; ++i) handles.push_back(scheduler.Submit(requests[i]).handle);
  recording.Release();
  ExpectEachAsAlone(requests, handles, *policy);
  const auto steps = recording.steps();
  bool shared = false;
  for (const auto& rows : steps) {
    int64_t prompt_tokens = 0, prompt_rows = 0;
    for (int64_t n : rows) {
      if (n > 1) {
        prompt_tokens += n;
        ++prompt_rows;
      }
    }
    EXPECT_LE(prompt_tokens, options.prefill_chunk);
    shared |= prompt_rows >= 2;
  }
  EXPECT_TRUE(shared) << "no step carried two prompts' chunks";
  // Chunks [10], [20], [48, 22], [5]: the first alone, then 20 + 5 together, then 48 and 22
  // (with 22 + nothing else left): 4 steps where one chunk per step takes 5.
  int prompt_steps = 0;
  for (const auto& rows : steps) {
    prompt_steps += std::any_of(rows.begin(), rows.end(), [](int64_t n) { return n > 1; });
    for (int64_t n : rows)
      EXPECT_TRUE(n == 1 || n == 10 || n == 20 || n == 48 || n == 22 || n == 5) << n;
  }
  EXPECT_EQ(prompt_steps, 4);
}

}  // namespace
}  // namespace shadowkv::engine
