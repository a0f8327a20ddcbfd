// Decode speed through the engine loop: what `bench` reports as a served figure without HTTP.
// Runs `batch` requests of `context` prompt tokens through a Scheduler on any ServingModel and
// measures the steady state from the times the loop hands out tokens, as the serving benchmark
// (bench/serve_bench.py) measures it from stream timestamps.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "engine/engine_observer.h"
#include "engine/serving_model.h"
#include "kv/kv_policy.h"

namespace shadowkv::engine {

struct LoopBenchCase {
  int64_t context = 0;      // prompt tokens of every request
  int batch = 1;            // requests, all admitted together (the loop's batch)
  int gen_tokens = 128;     // new tokens of every request (end-of-text ignored)
  int prefill_chunk = 512;  // the loop's prompt tokens per step
  uint64_t seed = 1;        // prompt tokens
  // One prompt shared by every request: prefilled once by a first request, whose held state
  // each request then starts from (a copy, where the model's sequences fork; the rest prefill
  // their own). Decode speed does not depend on the values in the cache.
  bool shared_prompt = true;
};

struct LoopBenchResult {
  int batch = 0;
  bool forked = false;         // every request started from a copy of the shared prompt
  double prefill_seconds = 0;  // the first request's prefill (shared prompt) or the slowest
  // Output tokens per second while every request is decoding: from the last request's first
  // token to the first request's last token; and the median gap between a request's tokens
  // there.
  double steady_tokens_per_s = 0;
  double steady_itl_p50_ms = 0;
  double whole_tokens_per_s = 0;  // every token over the whole run, prefills included
  // The loop's host time per step, decode-only steps (no prompt tokens).
  double step_ms = 0;   // wall time of a decode-only step
  double model_ms = 0;  // of which the model's step
  double schedule_ms = 0;
  double publish_ms = 0;
  kv::MemoryUsage memory;  // all the requests' KV at their end
  double hit_rate = 0;     // chunk hits of the sparse policies
  // Selections per (layer, KV head) decode step, where the policy counts them (select_drift on
  // the GPU; the CPU ShadowKV policy always), else 0.
  double selection_share = 0;
};

// kResourceExhausted when the model has no room for the batch; the model's own errors
// otherwise.
Result<LoopBenchResult> RunLoopBench(ServingModel& model, const kv::KvPolicy& policy,
                                     const LoopBenchCase& c);

}  // namespace shadowkv::engine
