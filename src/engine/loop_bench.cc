// RunLoopBench: a warm-up request holds the shared prompt, then the batch runs to its end while
// one thread takes every request's tokens with their push times.
#include "engine/loop_bench.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "engine/scheduler.h"

namespace shadowkv::engine {
namespace {

// Sums the loop's decode-only steps.
class StepTotals : public EngineObserver {
 public:
  void AddStep(const StepTimes& t) override {
    if (t.prompt_tokens > 0) return;
    std::lock_guard lock(mutex_);
    totals_ += t;
    ++steps_;
  }
  void Reset() {
    std::lock_guard lock(mutex_);
    totals_ = {};
    steps_ = 0;
  }
  std::pair<StepTimes, int64_t> Get() {
    std::lock_guard lock(mutex_);
    return {totals_, steps_};
  }

 private:
  std::mutex mutex_;
  StepTimes totals_;
  int64_t steps_ = 0;
};

Result<std::shared_ptr<SequenceHandle>> Admitted(SubmitResult s) {
  SKV_RETURN_IF_ERROR(s.ToStatus());
  return std::move(s.handle);
}

Status EndStatus(const SequenceHandle& handle, const char* what) {
  if (handle.end_reason() == EndReason::kLength) return Status::Ok();
  if (!handle.status().ok()) return handle.status();
  return Error(ErrorCode::kInternal, "the {} ended before its length", what);
}

}  // namespace

Result<LoopBenchResult> RunLoopBench(ServingModel& model, const kv::KvPolicy& policy,
                                     const LoopBenchCase& c) {
  if (c.context < 1 || c.batch < 1 || c.gen_tokens < 2 || c.prefill_chunk < 1) {
    return Error(ErrorCode::kInvalidArgument,
                 "context {}, batch {}, {} new tokens and prefill chunk {}: all positive, at "
                 "least 2 new tokens",
                 c.context, c.batch, c.gen_tokens, c.prefill_chunk);
  }
  const int64_t vocab = model.config().vocab_size;
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  // The shared part is context - 1 tokens; each request adds one of its own.
  std::vector<int32_t> shared(static_cast<size_t>(c.context - 1));
  for (auto& t : shared) t = token(rng);

  StepTotals totals;
  SchedulerOptions options;
  options.max_batch = c.batch;
  options.max_queue = c.batch + 1;
  options.prefill_chunk = c.prefill_chunk;
  options.max_held_states = c.shared_prompt ? 1 : 0;
  Scheduler scheduler(model, options, &totals);
  auto request = [&](std::vector<int32_t> prompt, int new_tokens) {
    SequenceRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = new_tokens;
    r.stop_at_end_of_generation = false;
    r.policy = &policy;
    r.reuse = c.shared_prompt;
    return r;
  };

  std::vector<int32_t> tokens;
  std::vector<Clock::time_point> pushed;
  auto wait_end = [&](SequenceHandle& h) {
    while (!h.Wait(std::chrono::milliseconds(100), &tokens)) {
    }
  };

  LoopBenchResult result;
  result.batch = c.batch;
  if (c.shared_prompt) {
    const Clock::time_point start = Clock::now();
    SKV_ASSIGN_OR_RETURN(auto warm, Admitted(scheduler.Submit(request(shared, 1))));
    wait_end(*warm);
    SKV_RETURN_IF_ERROR(EndStatus(*warm, "shared prompt's prefill"));
    result.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  totals.Reset();
  const Clock::time_point start = Clock::now();
  // Queued at once, so that the loop admits them together.
  std::vector<SequenceRequest> batch;
  for (int i = 0; i < c.batch; ++i) {
    std::vector<int32_t> prompt = shared;
    prompt.push_back(token(rng));
    batch.push_back(request(std::move(prompt), c.gen_tokens));
  }
  std::vector<std::shared_ptr<SequenceHandle>> handles;
  for (SubmitResult& s : scheduler.SubmitAll(std::move(batch))) {
    SKV_ASSIGN_OR_RETURN(auto h, Admitted(std::move(s)));
    handles.push_back(std::move(h));
  }
  std::vector<std::vector<Clock::time_point>> times(c.batch);
  std::vector<bool> ended(c.batch, false);
  // The times are the loop's push times, so taking the tokens late changes nothing: a long
  // wait on the first unfinished request, then whatever the others have, keeps this thread off
  // the cores the model's threads spin on.
  for (int left = c.batch; left > 0;) {
    bool waited = false;
    for (int i = 0; i < c.batch; ++i) {
      if (ended[i]) continue;
      tokens.clear();
      const auto timeout = std::chrono::milliseconds(waited ? 0 : 50);
      waited = true;
      if (handles[i]->Wait(timeout, &tokens, &times[i])) {
        ended[i] = true;
        --left;
      }
    }
  }
  const Clock::time_point end = Clock::now();
  result.forked = c.shared_prompt;
  int64_t total_tokens = 0;
  Clock::time_point window_start = start, window_end = end;
  double slowest_first = 0;
  kv::PolicyStats stats;
  for (int i = 0; i < c.batch; ++i) {
    SKV_RETURN_IF_ERROR(EndStatus(*handles[i], "request"));
    result.forked &= handles[i]->reused_tokens() == static_cast<int64_t>(shared.size());
    result.memory += handles[i]->final_memory();
    stats += handles[i]->final_stats();
    total_tokens += std::ssize(times[i]);
    window_start = std::max(window_start, times[i].front());
    window_end = std::min(window_end, times[i].back());
    slowest_first =
        std::max(slowest_first, std::chrono::duration<double>(times[i].front() - start).count());
  }
  if (!c.shared_prompt) result.prefill_seconds = slowest_first;
  result.hit_rate = stats.hit_rate();
  result.selection_share = stats.selection_share();
  result.whole_tokens_per_s =
      total_tokens / std::max(std::chrono::duration<double>(end - start).count(), 1e-9);
  // The steady state: tokens handed out inside the window, and the gaps between a request's
  // consecutive tokens there.
  int64_t in_window = 0;
  std::vector<double> gaps;
  for (const auto& t : times) {
    for (size_t k = 0; k < t.size(); ++k) {
      if (t[k] <= window_start || t[k] > window_end) continue;
      ++in_window;
      if (k > 0) gaps.push_back(std::chrono::duration<double>(t[k] - t[k - 1]).count());
    }
  }
  const double window = std::chrono::duration<double>(window_end - window_start).count();
  if (window > 0 && in_window > 0) result.steady_tokens_per_s = in_window / window;
  if (!gaps.empty()) {
    std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
    result.steady_itl_p50_ms = 1000.0 * gaps[gaps.size() / 2];
  }
  const auto [step_totals, steps] = totals.Get();
  if (steps > 0) {
    result.model_ms = 1000.0 * step_totals.model_seconds / steps;
    result.schedule_ms = 1000.0 * step_totals.schedule_seconds / steps;
    result.publish_ms = 1000.0 * step_totals.publish_seconds / steps;
    result.step_ms = result.model_ms + result.schedule_ms + result.publish_ms;
  }
  return result;
}

}  // namespace shadowkv::engine
