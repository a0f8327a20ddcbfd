// Scheduler: the engine loop. One thread owns the model and runs steps that mix every decoding
// sequence's next token with prompt chunks up to a token budget; the model samples each row's
// next token. Requests arrive from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "engine/engine_observer.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "engine/serving_model.h"
#include "kv/kv_policy.h"

namespace shadowkv::engine {

using Clock = std::chrono::steady_clock;

struct SchedulerOptions {
  int max_batch = 16;             // sequences running together (prefilling or decoding)
  int max_queue = 64;             // requests waiting for admission; more are refused
  int prefill_chunk = 128;        // prompt tokens per step, over every prefilling sequence
  int64_t fast_memory_limit = 0;  // bytes of fast-tier KV (running + held); 0 = no limit
  int64_t slow_memory_limit = 0;  // bytes of slow-tier KV; 0 = no limit
  int max_held_states = 32;       // finished KV states kept for multi-turn reuse (0 = none)
  // The loop's thread: its own (the server), or the caller's, through RunStep (a single
  // caller such as `generate`, which would otherwise hand every token across threads).
  bool own_thread = true;
};

struct SequenceRequest {
  std::vector<int32_t> prompt;
  int max_new_tokens = 16;
  SamplingParams sampling;
  bool stop_at_end_of_generation = true;
  const kv::KvPolicy* policy = nullptr;  // outlives the scheduler
  std::string policy_key;                // held states are reused only under the same key
  bool reuse = true;                     // may start from a held state
  Clock::time_point deadline = Clock::time_point::max();
};

enum class EndReason {
  kNone,             // still running
  kEndOfGeneration,  // the model ended its turn (finish_reason "stop")
  kLength,           // max_new_tokens reached (finish_reason "length")
  kCancelled,        // Cancel(): client gone or a stop sequence matched
  kTimeout,          // the deadline passed
  kShutdown,         // the server stopped before the request finished
  kError,            // a forward step failed
};

// A submitted request as its HTTP handler sees it; shared with the engine loop.
class SequenceHandle {
 public:
  // Waits up to `timeout` for new tokens or the end; appends new tokens to *tokens and, when
  // `pushed` is not null, the time the engine pushed each of them to *pushed. Returns true once
  // the sequence has ended and every token has been handed out.
  bool Wait(std::chrono::milliseconds timeout, std::vector<int32_t>* tokens,
            std::vector<Clock::time_point>* pushed = nullptr);
  // Frees the sequence at the next step (its KV state may still be held for reuse).
  void Cancel() { cancel_.store(true); }

  EndReason end_reason() const;
  Status status() const;
  int64_t reused_tokens() const;
  int64_t prompt_tokens() const { return prompt_tokens_; }
  // Prompt tokens in the KV state so far (reused ones included), for progress lines.
  int64_t prompt_done() const { return prompt_done_.load(); }
  // The KV state's statistics and memory when the sequence ended (valid once ended).
  kv::PolicyStats final_stats() const;
  kv::MemoryUsage final_memory() const;

 private:
  friend class Scheduler;
  void Push(int32_t token);
  void End(EndReason reason, Status status);
  void SetReused(int64_t tokens);
  void SetFinal(const kv::PolicyStats& stats, const kv::MemoryUsage& memory);

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int32_t> pending_;
  std::vector<Clock::time_point> pending_times_;  // when each pending token was pushed
  EndReason reason_ = EndReason::kNone;
  Status status_;
  int64_t reused_ = 0;
  int64_t prompt_tokens_ = 0;
  kv::PolicyStats final_stats_;
  kv::MemoryUsage final_memory_;
  std::atomic<int64_t> prompt_done_{0};
  std::atomic<bool> cancel_{false};
};

struct SubmitResult {
  enum class Code { kOk, kQueueFull, kTooLarge, kShuttingDown, kInvalid } code = Code::kOk;
  std::string message;
  std::shared_ptr<SequenceHandle> handle;

  // For callers without HTTP statuses: Ok, kResourceExhausted (too large for the memory
  // limits) or kInvalidArgument (any other refusal), with the message.
  Status ToStatus() const;
};

class Scheduler {
 public:
  // `metrics` may be null. With options.own_thread the loop thread starts at once.
  Scheduler(ServingModel& model, SchedulerOptions options, EngineObserver* metrics);
  ~Scheduler();

  // Without its own thread: one turn of the loop on the caller's thread (admission, ends, one
  // step); false when there was nothing to run. Only for a scheduler made with own_thread off.
  bool RunStep();

  SubmitResult Submit(SequenceRequest request);
  // Several requests queued at once (admitted together while the batch has room), each
  // answered as Submit would.
  std::vector<SubmitResult> SubmitAll(std::vector<SequenceRequest> requests);
  // Stops admitting, lets running and queued requests finish for up to `grace`, ends the rest
  // (kShutdown) and joins the loop thread. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

  // A rough wait before a refused client should retry: queued work over batch slots times the
  // mean request time, at least one second.
  int RetryAfterSeconds() const;
  EngineGauges gauges() const;
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Running;
  struct Waiting {
    SequenceRequest request;
    std::shared_ptr<SequenceHandle> handle;
    Clock::time_point arrival;
  };

  SubmitResult Check(const SequenceRequest& request) const;  // kOk, or why it can never run
  void Loop();
  bool Turn();     // one turn of the loop; false when nothing ran
  void StopNow();  // ends every request (kShutdown), drops held states
  void Admit();    // under mutex_
  void EndExpired(Clock::time_point now);
  bool Step();  // one forward step; false when nothing ran
  // Releases a finished sequence; its reply ends at the next PublishAndEnd.
  void Finish(Running& running, EndReason reason, Status status);
  void PublishGauges();
  void PublishAndEnd();  // the gauges, then the replies of the sequences finished since
  bool Fits(const kv::MemoryUsage& need, const kv::MemoryUsage& used) const;

  ServingModel& model_;
  SchedulerOptions options_;
  EngineObserver* metrics_;

  mutable std::mutex mutex_;  // guards waiting_, accepting_, stop_now_, gauges_, mean_seconds_
  std::condition_variable cv_;
  std::deque<Waiting> waiting_;
  bool accepting_ = true;
  bool stop_now_ = false;
  EngineGauges gauges_;
  double mean_request_seconds_ = 1.0;

  // Loop thread only.
  std::vector<std::unique_ptr<Running>> running_;
  struct Ending {
    std::shared_ptr<SequenceHandle> handle;
    EndReason reason;
    Status status;
  };
  std::vector<Ending> ending_;  // finished sequences whose replies have not ended yet
  PrefixCache held_;
  kv::MemoryUsage reserved_;  // estimates of the running sequences
  // Step buffers, reused.
  std::vector<StepRow> rows_;
  std::vector<Running*> owners_;
  std::vector<int32_t> next_tokens_;
  std::thread thread_;
};

}  // namespace shadowkv::engine
