// Engine: runs a set of generation requests to completion through the engine loop (Scheduler),
// the loop `serve` runs, on any ServingModel (the CPU model, or the GPU's). `generate` and
// `bench` use it, so what they print is what the server does without HTTP.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/status.h"
#include "engine/sampler.h"
#include "engine/serving_model.h"
#include "kv/kv_policy.h"

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
  // Seconds from Run's start to the engine loop's handing out of each token.
  std::vector<double> token_seconds;
  FinishReason finish_reason = FinishReason::kLength;
  double prefill_seconds = 0.0;  // from Run's start to the first generated token
  kv::PolicyStats kv_stats;
  kv::MemoryUsage kv_memory;  // at the end of the request
};

struct EngineOptions {
  int prefill_chunk = 512;      // prompt tokens per step, over every prefilling sequence
  int max_batch = 16;           // sequences running together
  int64_t kv_memory_limit = 0;  // fast-tier bytes for KV states (0 = no limit)
};

// Progress of prefill, for progress lines: (request, prompt tokens done, prompt tokens).
using PrefillProgress = std::function<void(int, int64_t, int64_t)>;
// A generated token: (request, token). Return false to stop that request.
using TokenCallback = std::function<bool(int, int32_t)>;

class Engine {
 public:
  // `model` and `policy` (one of the model's, MakePolicy) outlive the engine.
  Engine(engine::ServingModel& model, const kv::KvPolicy& policy, EngineOptions options)
      : model_(model), policy_(policy), options_(options) {}

  // Runs all requests to completion in one engine loop (continuous batching, prompts admitted
  // as running sequences finish), turned by the caller's thread: tokens reach the callbacks
  // between steps, as a single process would want. Results are in request order.
  std::vector<GenerationResult> Run(std::span<const GenerationRequest> requests,
                                    const TokenCallback& on_token = nullptr,
                                    const PrefillProgress& on_prefill = nullptr);

  // Checks a request against the model and policy (context length, sampling settings).
  Status Validate(const GenerationRequest& request) const;

 private:
  engine::ServingModel& model_;
  const kv::KvPolicy& policy_;
  EngineOptions options_;
};

}  // namespace shadowkv
