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

#include "engine/engine_observer.h"
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

// A request handler's time on its stream (seconds), reported when the response ends.
struct HandlerTimes {
  double handoff_seconds = 0;     // from the engine's push to the handler holding the tokens
  int64_t handoffs = 0;           // wake-ups that brought tokens
  double detokenize_seconds = 0;  // token ids to text, stop sequences
  double write_seconds = 0;       // writing events to the socket
  int64_t tokens = 0;

  HandlerTimes& operator+=(const HandlerTimes& o) {
    handoff_seconds += o.handoff_seconds;
    handoffs += o.handoffs;
    detokenize_seconds += o.detokenize_seconds;
    write_seconds += o.write_seconds;
    tokens += o.tokens;
    return *this;
  }
};

using engine::EngineGauges;
using engine::StepTimes;

// Also the engine loop's observer: what it reports shows in /metrics.
class Metrics : public engine::EngineObserver {
 public:
  Metrics();
  void CountRequest(std::string_view endpoint, int http_status);
  void AddPromptTokens(int64_t prompt_tokens, int64_t reused_tokens) override;
  void AddGeneratedTokens(int64_t count) override;
  void ObserveTimeToFirstToken(double seconds) override;
  void ObserveInterTokenLatency(double seconds) override;
  void AddPolicyStats(std::string_view policy, const kv::PolicyStats& stats) override;
  void SetEngineGauges(const EngineGauges& gauges) override;
  void AddStep(const StepTimes& times) override;
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
