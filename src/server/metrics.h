// Server metrics: counters, gauges and histograms rendered in the Prometheus text format.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kv/kv_policy.h"

namespace shadowkv::server {

// Cumulative histogram with fixed upper bounds (seconds), as Prometheus expects.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}
  void Observe(double value);
  // Lines "<name>_bucket{le=...} n", "<name>_sum", "<name>_count".
  void Render(std::string_view name, std::string* out) const;
  int64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0.0;
  int64_t count_ = 0;
};

// What the engine loop reports about its state after each step.
struct EngineGauges {
  int64_t queue_depth = 0;        // requests waiting for admission
  int64_t running_sequences = 0;  // admitted (prefilling or decoding)
  int64_t held_states = 0;        // finished sequences kept for reuse
  kv::MemoryUsage active_memory;  // KV bytes of running sequences
  kv::MemoryUsage held_memory;    // KV bytes of held states
};

// Where one engine step's host time went (seconds).
struct StepTimes {
  double schedule_seconds = 0;  // choosing the rows
  double model_seconds = 0;     // the model's step: launch, device work, the ids back
  double publish_seconds = 0;   // handing tokens to requests, ending finished ones
  int64_t rows = 0;             // sequences in the step
  int64_t prompt_tokens = 0;    // prompt tokens in the step
};

// A request handler's time on its stream (seconds), reported when the response ends.
struct HandlerTimes {
  double handoff_seconds = 0;     // from the engine's push to the handler holding the tokens
  int64_t handoffs = 0;           // wake-ups that brought tokens
  double detokenize_seconds = 0;  // token ids to text, stop sequences
  double write_seconds = 0;       // writing events to the socket
  int64_t tokens = 0;
};

class Metrics {
 public:
  Metrics();
  void CountRequest(std::string_view endpoint, int http_status);
  void AddPromptTokens(int64_t prompt_tokens, int64_t reused_tokens);
  void AddGeneratedTokens(int64_t count);
  void ObserveTimeToFirstToken(double seconds);
  void ObserveInterTokenLatency(double seconds);
  void AddPolicyStats(std::string_view policy, const kv::PolicyStats& stats);
  void SetEngineGauges(const EngineGauges& gauges);
  void AddStep(const StepTimes& times);
  void AddHandlerTimes(const HandlerTimes& times);

  int64_t requests_total(std::string_view endpoint, int http_status) const;
  std::string Render() const;

 private:
  using Clock = std::chrono::steady_clock;
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> requests_;  // (endpoint, status) -> count
  int64_t prompt_tokens_ = 0;
  int64_t reused_tokens_ = 0;
  int64_t generated_tokens_ = 0;
  std::deque<std::pair<Clock::time_point, int64_t>> recent_tokens_;  // for tokens/s
  Histogram time_to_first_token_;
  Histogram inter_token_latency_;
  std::map<std::string, kv::PolicyStats> policy_stats_;
  EngineGauges gauges_;
  StepTimes step_totals_;  // summed over steps
  int64_t steps_ = 0;
  int64_t decode_only_steps_ = 0;
  double decode_only_model_seconds_ = 0;  // model time of steps without prompt tokens
  HandlerTimes handler_totals_;
};

}  // namespace shadowkv::server
