// EngineObserver: what the engine loop reports as it runs (token counts, latencies, step times,
// its state after each step), for whoever keeps metrics; the server's Metrics is one.
#pragma once

#include <cstdint>
#include <string_view>

#include "kv/kv_policy.h"

namespace shadowkv::engine {

// The engine loop's state after a step.
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

  StepTimes& operator+=(const StepTimes& o) {
    schedule_seconds += o.schedule_seconds;
    model_seconds += o.model_seconds;
    publish_seconds += o.publish_seconds;
    rows += o.rows;
    prompt_tokens += o.prompt_tokens;
    return *this;
  }
};

// Called from the engine loop's thread; implementations synchronise with their readers and
// override what they keep (every report is ignored by default).
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void AddPromptTokens(int64_t /*prompt_tokens*/, int64_t /*reused_tokens*/) {}
  virtual void AddGeneratedTokens(int64_t /*count*/) {}
  virtual void ObserveTimeToFirstToken(double /*seconds*/) {}
  virtual void ObserveInterTokenLatency(double /*seconds*/) {}
  // A finished request's share of its KV state's statistics.
  virtual void AddPolicyStats(std::string_view /*policy*/, const kv::PolicyStats& /*stats*/) {}
  virtual void SetEngineGauges(const EngineGauges& /*gauges*/) {}
  virtual void AddStep(const StepTimes& /*times*/) {}
};

}  // namespace shadowkv::engine
