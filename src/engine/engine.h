// Engine: runs generation requests over one model and KV policy with continuous batching.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/sampler.h"
#include "kv/kv_policy.h"
#include "model/cpu_model.h"

namespace shadowkv {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int max_new_tokens = 128;
  SamplingParams sampling;
  bool stop_at_end_of_generation = true;  // stop on EOS / end-of-turn tokens
};

enum class FinishReason { kStop, kLength, kError };
const char* FinishReasonName(FinishReason reason);

struct GenerationResult {
  Status status;                // error of this request only; others are unaffected
  std::vector<int32_t> tokens;  // generated tokens (without the prompt)
  FinishReason finish_reason = FinishReason::kLength;
  double prefill_seconds = 0.0;  // from admission to the first generated token
  kv::PolicyStats kv_stats;
  kv::MemoryUsage kv_memory;  // at the end of the request
};

struct EngineOptions {
  int prefill_chunk = 512;      // prompt tokens per forward step and sequence
  int max_batch = 16;           // sequences decoding together
  int64_t kv_memory_limit = 0;  // fast-tier bytes for KV states (0 = no limit)
};

// Progress of prefill, for progress lines: (request, prompt tokens done, prompt tokens).
using PrefillProgress = std::function<void(int, int64_t, int64_t)>;
// A generated token: (request, token). Return false to stop that request.
using TokenCallback = std::function<bool(int, int32_t)>;

class Engine {
 public:
  Engine(CpuModel& model, const kv::KvPolicy& policy, EngineOptions options)
      : model_(model), policy_(policy), options_(options) {}

  // Runs all requests to completion, batching decode steps across them and admitting new
  // prefills as running sequences finish. Results are in request order.
  std::vector<GenerationResult> Run(std::span<const GenerationRequest> requests,
                                    const TokenCallback& on_token = nullptr,
                                    const PrefillProgress& on_prefill = nullptr);

  // Checks a request against the model and policy (context length, sampling settings).
  Status Validate(const GenerationRequest& request) const;

 private:
  CpuModel& model_;
  const kv::KvPolicy& policy_;
  EngineOptions options_;
};

}  // namespace shadowkv
