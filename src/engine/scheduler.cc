// Scheduler: admission by KV memory, prompt chunks up to a token budget per step beside all
// decode rows, the model's sampled tokens handed to their requests, reuse of held KV states,
// cancellation and deadlines checked between steps.
#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>

namespace shadowkv::engine {

// ---- SequenceHandle ----

bool SequenceHandle::Wait(std::chrono::milliseconds timeout, std::vector<int32_t>* tokens,
                          std::vector<Clock::time_point>* pushed) {
  std::unique_lock lock(mutex_);
  cv_.wait_for(lock, timeout, [&] { return !pending_.empty() || reason_ != EndReason::kNone; });
  tokens->insert(tokens->end(), pending_.begin(), pending_.end());
  if (pushed) pushed->insert(pushed->end(), pending_times_.begin(), pending_times_.end());
  pending_.clear();
  pending_times_.clear();
  return reason_ != EndReason::kNone;
}

EndReason SequenceHandle::end_reason() const {
  std::lock_guard lock(mutex_);
  return reason_;
}

Status SequenceHandle::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

int64_t SequenceHandle::reused_tokens() const {
  std::lock_guard lock(mutex_);
  return reused_;
}

void SequenceHandle::Push(int32_t token) {
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(token);
    pending_times_.push_back(Clock::now());
  }
  cv_.notify_all();
}

void SequenceHandle::End(EndReason reason, Status status) {
  {
    std::lock_guard lock(mutex_);
    reason_ = reason;
    status_ = std::move(status);
  }
  cv_.notify_all();
}

kv::PolicyStats SequenceHandle::final_stats() const {
  std::lock_guard lock(mutex_);
  return final_stats_;
}

kv::MemoryUsage SequenceHandle::final_memory() const {
  std::lock_guard lock(mutex_);
  return final_memory_;
}

void SequenceHandle::SetFinal(const kv::PolicyStats& stats, const kv::MemoryUsage& memory) {
  std::lock_guard lock(mutex_);
  final_stats_ = stats;
  final_memory_ = memory;
}

void SequenceHandle::SetReused(int64_t tokens) {
  std::lock_guard lock(mutex_);
  reused_ = tokens;
}

Status SubmitResult::ToStatus() const {
  if (code == Code::kOk) return Status::Ok();
  return Status(
      code == Code::kTooLarge ? ErrorCode::kResourceExhausted : ErrorCode::kInvalidArgument,
      message);
}

// ---- Scheduler ----

struct Scheduler::Running {
  SequenceRequest request;
  std::shared_ptr<SequenceHandle> handle;
  std::unique_ptr<kv::SequenceKv> kv;
  int64_t prompt_done = 0;  // prompt tokens already in the KV state
  bool reused = false;      // started from a held state (its prefill is already finished)
  kv::MemoryUsage reserved;
  std::vector<int32_t> generated;
  Clock::time_point arrival;
  Clock::time_point last_token;
  kv::PolicyStats reported;  // of a reused state: its statistics the metrics already counted

  bool prefilling() const { return prompt_done < static_cast<int64_t>(request.prompt.size()); }
};

Scheduler::Scheduler(ServingModel& model, SchedulerOptions options, EngineObserver* metrics)
    : model_(model), options_(options), metrics_(metrics), held_(options.max_held_states) {
  if (options_.own_thread) thread_ = std::thread([this] { Loop(); });
}

bool Scheduler::RunStep() { return Turn(); }

Scheduler::~Scheduler() { Shutdown(std::chrono::milliseconds(0)); }

SubmitResult Scheduler::Check(const SequenceRequest& request) const {
  SubmitResult result;
  using Code = SubmitResult::Code;
  const int64_t context = model_.config().context_length;
  const int64_t total = static_cast<int64_t>(request.prompt.size()) + request.max_new_tokens;
  if (request.prompt.empty() || request.max_new_tokens < 1 || total > context || !request.policy) {
    result.code = Code::kInvalid;
    result.message = fmt::format(
        "a prompt of {} tokens plus {} new tokens does not fit the "
        "context of {} tokens",
        request.prompt.size(), request.max_new_tokens, context);
    return result;
  }
  const kv::MemoryUsage need = request.policy->EstimateMemory(total);
  if (!Fits(need, {})) {
    result.code = Code::kTooLarge;
    result.message = fmt::format(
        "a sequence of {} tokens needs {} bytes of fast-tier and {} bytes of slow-tier KV memory, "
        "more than the server's limits ({} and {} bytes; 0 = none)",
        total, need.fast_bytes, need.slow_bytes, options_.fast_memory_limit,
        options_.slow_memory_limit);
  }
  return result;
}

SubmitResult Scheduler::Submit(SequenceRequest request) {
  std::vector<SequenceRequest> one;
  one.push_back(std::move(request));
  return std::move(SubmitAll(std::move(one)).front());
}

std::vector<SubmitResult> Scheduler::SubmitAll(std::vector<SequenceRequest> requests) {
  using Code = SubmitResult::Code;
  std::vector<SubmitResult> results;
  for (const SequenceRequest& request : requests) results.push_back(Check(request));
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < requests.size(); ++i) {
      SubmitResult& result = results[i];
      if (result.code != Code::kOk) continue;
      if (!accepting_) {
        result.code = Code::kShuttingDown;
        result.message = "the server is shutting down";
        continue;
      }
      if (static_cast<int>(waiting_.size()) >= options_.max_queue) {
        result.code = Code::kQueueFull;
        result.message = fmt::format("the request queue is full ({} waiting)", waiting_.size());
        continue;
      }
      auto handle = std::make_shared<SequenceHandle>();
      handle->prompt_tokens_ = static_cast<int64_t>(requests[i].prompt.size());
      waiting_.push_back(Waiting{std::move(requests[i]), handle, Clock::now()});
      result.handle = std::move(handle);
    }
    gauges_.queue_depth = static_cast<int64_t>(waiting_.size());
  }
  cv_.notify_all();
  return results;
}

void Scheduler::Shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard lock(mutex_);
    accepting_ = false;
  }
  const Clock::time_point until = Clock::now() + grace;
  while (Clock::now() < until) {
    {
      std::lock_guard lock(mutex_);
      if (waiting_.empty() && gauges_.running_sequences == 0) break;
    }
    if (options_.own_thread) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } else {
      Turn();  // the caller drives the loop: run it out here
    }
  }
  {
    std::lock_guard lock(mutex_);
    stop_now_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  } else if (!options_.own_thread) {
    StopNow();
  }
}

int Scheduler::RetryAfterSeconds() const {
  std::lock_guard lock(mutex_);
  const double rounds = std::ceil((waiting_.size() + 1.0) / std::max(1, options_.max_batch));
  return std::max(1, static_cast<int>(std::ceil(rounds * mean_request_seconds_)));
}

EngineGauges Scheduler::gauges() const {
  std::lock_guard lock(mutex_);
  return gauges_;
}

bool Scheduler::Fits(const kv::MemoryUsage& need, const kv::MemoryUsage& used) const {
  const bool fast_ok = options_.fast_memory_limit <= 0 ||
                       used.fast_bytes + need.fast_bytes <= options_.fast_memory_limit;
  const bool slow_ok = options_.slow_memory_limit <= 0 ||
                       used.slow_bytes + need.slow_bytes <= options_.slow_memory_limit;
  return fast_ok && slow_ok;
}

void Scheduler::Loop() {
  while (true) {
    {
      std::unique_lock lock(mutex_);
      if (running_.empty() && waiting_.empty() && !stop_now_) {
        cv_.wait_for(lock, std::chrono::milliseconds(100));
      }
      if (stop_now_) break;
    }
    Turn();
  }
  StopNow();
}

bool Scheduler::Turn() {
  {
    std::lock_guard lock(mutex_);
    if (running_.empty() && waiting_.empty()) return false;
    Admit();
  }
  EndExpired(Clock::now());
  if (!running_.empty()) Step();
  PublishAndEnd();
  return true;
}

void Scheduler::StopNow() {
  {
    std::lock_guard lock(mutex_);
    for (Waiting& w : waiting_) w.handle->End(EndReason::kShutdown, Status::Ok());
    waiting_.clear();
  }
  for (auto& r : running_) Finish(*r, EndReason::kShutdown, Status::Ok());
  running_.clear();
  held_.Clear();
  PublishAndEnd();
}

void Scheduler::Admit() {
  const Clock::time_point now = Clock::now();
  // Requests cancelled or expired while queued leave without running.
  std::erase_if(waiting_, [&](Waiting& w) {
    if (w.handle->cancel_.load()) {
      w.handle->End(EndReason::kCancelled, Status::Ok());
      return true;
    }
    if (now >= w.request.deadline) {
      w.handle->End(EndReason::kTimeout, Status::Ok());
      return true;
    }
    return false;
  });
  while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_batch) {
    Waiting& w = waiting_.front();
    const SequenceRequest& req = w.request;
    const int64_t total = static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens;
    const kv::MemoryUsage need = req.policy->EstimateMemory(total);
    std::optional<HeldState> held;
    if (req.reuse) held = held_.Take(req.policy_key, req.prompt);
    kv::MemoryUsage used = reserved_;
    used += held_.memory();
    // Held states give way to running work, oldest first.
    while (!Fits(need, used) && held_.EvictOldest()) {
      used = reserved_;
      used += held_.memory();
    }
    if (!Fits(need, used) && !running_.empty()) {
      if (held && !held->copy) held_.Put(std::move(*held));  // a copy is just dropped
      break;  // wait for a running sequence to finish
    }
    std::unique_ptr<kv::SequenceKv> kv;
    if (held) {
      kv = std::move(held->kv);
    } else {
      // A model with a fixed number of sequences (the GPU's slots) answers kResourceExhausted
      // when all are taken: held states give theirs back first, then the request waits.
      auto fresh = req.policy->NewSequence();
      while (!fresh.ok() && fresh.status().code() == ErrorCode::kResourceExhausted &&
             held_.EvictOldest()) {
        fresh = req.policy->NewSequence();
      }
      if (!fresh.ok() && fresh.status().code() == ErrorCode::kResourceExhausted &&
          !running_.empty()) {
        break;
      }
      if (!fresh.ok()) {
        w.handle->End(EndReason::kError, fresh.status());
        waiting_.pop_front();
        continue;
      }
      kv = std::move(fresh).value();
    }
    auto running = std::make_unique<Running>(Running{std::move(w.request),
                                                     w.handle,
                                                     std::move(kv),
                                                     0,
                                                     false,
                                                     need,
                                                     {},
                                                     w.arrival,
                                                     w.arrival,
                                                     {}});
    if (held) {
      running->prompt_done = static_cast<int64_t>(held->tokens.size());
      running->reused = true;
      running->reported = held->reported;
      running->handle->SetReused(running->prompt_done);
      running->handle->prompt_done_.store(running->prompt_done);
    }
    if (metrics_) {
      metrics_->AddPromptTokens(static_cast<int64_t>(running->request.prompt.size()),
                                running->prompt_done);
    }
    reserved_ += need;
    running_.push_back(std::move(running));
    waiting_.pop_front();
  }
  // Shutdown reads these to know when the work is done; admission just changed them.
  gauges_.queue_depth = static_cast<int64_t>(waiting_.size());
  gauges_.running_sequences = static_cast<int64_t>(running_.size());
}

void Scheduler::EndExpired(Clock::time_point now) {
  for (auto& r : running_) {
    if (r->handle->cancel_.load()) {
      Finish(*r, EndReason::kCancelled, Status::Ok());
    } else if (now >= r->request.deadline) {
      Finish(*r, EndReason::kTimeout, Status::Ok());
    }
  }
  std::erase_if(running_, [](const auto& r) { return r->kv == nullptr; });
}

bool Scheduler::Step() {
  const Clock::time_point begin = Clock::now();
  rows_.clear();
  owners_.clear();
  // Decode rows first, then prompt chunks in admission order while they fit the step's prompt
  // budget (--prefill-chunk tokens; the first chunk always goes). A prompt is cut into chunks of
  // the budget whatever the load, so its arithmetic is the same alone or beside others; short
  // prompts and last chunks share a step.
  int64_t budget = options_.prefill_chunk;
  for (auto& owned : running_) {
    Running& r = *owned;
    if (r.prefilling()) continue;
    StepRow row;
    row.kv = r.kv.get();
    row.tokens = std::span<const int32_t>(&r.generated.back(), 1);
    row.sampling = &r.request.sampling;
    row.draw = r.generated.size();
    rows_.push_back(row);
    owners_.push_back(&r);
  }
  int64_t prompt_tokens = 0;
  for (auto& owned : running_) {
    Running& r = *owned;
    if (!r.prefilling()) continue;
    const int64_t size = static_cast<int64_t>(r.request.prompt.size());
    const int64_t count = std::min<int64_t>(options_.prefill_chunk, size - r.prompt_done);
    if (count > budget) continue;
    budget -= count;
    prompt_tokens += count;
    StepRow row;
    row.kv = r.kv.get();
    row.tokens = std::span<const int32_t>(r.request.prompt.data() + r.prompt_done,
                                          static_cast<size_t>(count));
    const bool last = r.prompt_done + count == size;
    // A reused state finished its prefill in an earlier turn; new tokens just extend it.
    row.finish_prefill = last && !r.reused;
    row.sampling = last ? &r.request.sampling : nullptr;
    row.draw = 0;
    rows_.push_back(row);
    owners_.push_back(&r);
  }
  if (rows_.empty()) return false;
  next_tokens_.assign(rows_.size(), 0);

  const Clock::time_point launched = Clock::now();
  const Status status = model_.Step(rows_, next_tokens_);
  const Clock::time_point now = Clock::now();
  if (!status.ok()) {
    // The step's sequences are in an unknown state: end them with the error, keep none.
    for (Running* r : owners_) {
      r->request.reuse = false;
      Finish(*r, EndReason::kError, status);
    }
    std::erase_if(running_, [](const auto& r) { return r->kv == nullptr; });
    return true;
  }
  int64_t sampled = 0;
  for (size_t i = 0; i < rows_.size(); ++i) {
    Running& r = *owners_[i];
    if (r.prefilling()) {
      r.prompt_done += static_cast<int64_t>(rows_[i].tokens.size());
      r.handle->prompt_done_.store(r.prompt_done);
      if (r.prefilling()) continue;
      if (metrics_) {
        metrics_->ObserveTimeToFirstToken(std::chrono::duration<double>(now - r.arrival).count());
      }
    } else if (metrics_) {
      metrics_->ObserveInterTokenLatency(std::chrono::duration<double>(now - r.last_token).count());
    }
    r.generated.push_back(next_tokens_[i]);
    r.last_token = now;
    owners_[sampled++] = &r;  // the rows that drew a token, in order
  }
  // Counted before any client sees the tokens, so /metrics is never behind a finished reply.
  if (metrics_ && sampled > 0) metrics_->AddGeneratedTokens(sampled);
  for (int64_t i = 0; i < sampled; ++i) {
    Running* r = owners_[i];
    const int32_t token = r->generated.back();
    r->handle->Push(token);
    if (r->request.stop_at_end_of_generation && model_.tokenizer().IsEndOfGeneration(token)) {
      Finish(*r, EndReason::kEndOfGeneration, Status::Ok());
    } else if (static_cast<int>(r->generated.size()) >= r->request.max_new_tokens) {
      Finish(*r, EndReason::kLength, Status::Ok());
    }
  }
  std::erase_if(running_, [](const auto& r) { return r->kv == nullptr; });
  if (metrics_) {
    StepTimes times;
    times.schedule_seconds = std::chrono::duration<double>(launched - begin).count();
    times.model_seconds = std::chrono::duration<double>(now - launched).count();
    times.publish_seconds = std::chrono::duration<double>(Clock::now() - now).count();
    times.rows = static_cast<int64_t>(rows_.size());
    times.prompt_tokens = prompt_tokens;
    metrics_->AddStep(times);
  }
  return true;
}

void Scheduler::Finish(Running& r, EndReason reason, Status status) {
  // A state's statistics are cumulative over its turns: the metrics take this turn's part. (Read
  // once: a GPU sequence's counts come from the device.)
  const kv::PolicyStats stats = r.kv->stats();
  r.handle->SetFinal(stats, r.kv->memory());
  if (metrics_) {
    kv::PolicyStats turn = stats;
    turn -= r.reported;
    metrics_->AddPolicyStats(r.request.policy->name(), turn);
  }
  reserved_.fast_bytes -= r.reserved.fast_bytes;
  reserved_.slow_bytes -= r.reserved.slow_bytes;
  // The state holds the prompt and every generated token but the last (never fed). Only states
  // past their prefill are held: an unfinished prefill was never compressed.
  const bool past_prefill = !r.prefilling() && !r.generated.empty();
  if (status.ok() && past_prefill && options_.max_held_states > 0 &&
      reason != EndReason::kShutdown) {
    HeldState held;
    held.policy_key = r.request.policy_key;
    held.tokens = std::move(r.request.prompt);
    held.tokens.insert(held.tokens.end(), r.generated.begin(), r.generated.end() - 1);
    if (static_cast<int64_t>(held.tokens.size()) == r.kv->num_tokens()) {
      held.reported = stats;
      held.kv = std::move(r.kv);
      held_.Put(std::move(held));
    }
  }
  r.kv.reset();
  const double seconds = std::chrono::duration<double>(Clock::now() - r.arrival).count();
  {
    std::lock_guard lock(mutex_);
    mean_request_seconds_ = 0.9 * mean_request_seconds_ + 0.1 * seconds;
  }
  ending_.push_back({r.handle, reason, std::move(status)});
}

void Scheduler::PublishAndEnd() {
  // The gauges go out before the replies end, so a client that reads /metrics after its reply
  // never sees its own sequence still running.
  PublishGauges();
  for (Ending& e : ending_) e.handle->End(e.reason, std::move(e.status));
  ending_.clear();
}

void Scheduler::PublishGauges() {
  EngineGauges g;
  g.running_sequences = static_cast<int64_t>(running_.size());
  for (const auto& r : running_) g.active_memory += r->kv->memory();
  g.held_states = static_cast<int64_t>(held_.size());
  g.held_memory = held_.memory();
  {
    std::lock_guard lock(mutex_);
    g.queue_depth = static_cast<int64_t>(waiting_.size());
    gauges_ = g;
  }
  if (metrics_) metrics_->SetEngineGauges(g);
}

}  // namespace shadowkv::engine
