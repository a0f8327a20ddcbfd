// Engine::Run: submits the requests to a Scheduler and hands their tokens to the caller.
#include "engine/engine.h"

#include <chrono>
#include <memory>

#include "engine/scheduler.h"

namespace shadowkv {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

Status Engine::Validate(const GenerationRequest& request) const {
  const int64_t context = model_.config().context_length;
  if (request.prompt.empty()) return Error(ErrorCode::kInvalidArgument, "the prompt is empty");
  if (request.max_new_tokens < 1) {
    return Error(ErrorCode::kInvalidArgument, "max new tokens {} must be at least 1",
                 request.max_new_tokens);
  }
  const int64_t needed = static_cast<int64_t>(request.prompt.size()) + request.max_new_tokens;
  if (needed > context) {
    return Error(ErrorCode::kOutOfRange,
                 "prompt of {} tokens plus {} new tokens exceeds the model's context of {} tokens",
                 request.prompt.size(), request.max_new_tokens, context);
  }
  for (int32_t token : request.prompt) {
    if (token < 0 || token >= model_.config().vocab_size) {
      return Error(ErrorCode::kInvalidArgument, "prompt token id {} is outside the vocabulary",
                   token);
    }
  }
  SKV_RETURN_IF_ERROR(request.sampling.Validate());
  if (options_.kv_memory_limit > 0 &&
      policy_.EstimateMemory(needed).fast_bytes > options_.kv_memory_limit) {
    return Error(ErrorCode::kResourceExhausted,
                 "a sequence of {} tokens needs {} bytes of KV memory, more than the limit of {}",
                 needed, policy_.EstimateMemory(needed).fast_bytes, options_.kv_memory_limit);
  }
  return Status::Ok();
}

std::vector<GenerationResult> Engine::Run(std::span<const GenerationRequest> requests,
                                          const TokenCallback& on_token,
                                          const PrefillProgress& on_prefill) {
  using engine::Clock;
  const Clock::time_point start = Clock::now();
  std::vector<GenerationResult> results(requests.size());
  engine::SchedulerOptions options;
  options.max_batch = options_.max_batch;
  options.max_queue = static_cast<int>(requests.size());
  options.prefill_chunk = options_.prefill_chunk;
  options.fast_memory_limit = options_.kv_memory_limit;
  options.max_held_states = 0;
  options.own_thread = false;  // this thread runs the loop: no token crosses threads
  engine::Scheduler scheduler(model_, options, nullptr);

  struct Live {
    int request;
    std::shared_ptr<engine::SequenceHandle> handle;
    int64_t reported_prompt = 0;
    bool done = false;
    bool cancelled = false;  // by on_token: later tokens are not handed out
  };
  std::vector<Live> live;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& req = requests[i];
    GenerationResult& res = results[i];
    res.status = Validate(req);
    if (!res.status.ok()) {
      res.finish_reason = FinishReason::kError;
      continue;
    }
    engine::SequenceRequest seq;
    seq.prompt = req.prompt;
    seq.max_new_tokens = req.max_new_tokens;
    seq.sampling = req.sampling;
    seq.stop_at_end_of_generation = req.stop_at_end_of_generation;
    seq.policy = &policy_;
    seq.reuse = false;
    engine::SubmitResult submitted = scheduler.Submit(std::move(seq));
    if (Status refused = submitted.ToStatus(); !refused.ok()) {
      res.status = std::move(refused);
      res.finish_reason = FinishReason::kError;
      continue;
    }
    live.push_back(Live{static_cast<int>(i), std::move(submitted.handle)});
  }

  // One turn of the loop, then every token it pushed to the callbacks.
  std::vector<int32_t> tokens;
  std::vector<Clock::time_point> pushed;
  size_t remaining = live.size();
  while (remaining > 0) {
    scheduler.RunStep();
    for (Live& l : live) {
      if (l.done) continue;
      tokens.clear();
      pushed.clear();
      const bool ended = l.handle->Wait(std::chrono::milliseconds(0), &tokens, &pushed);
      GenerationResult& res = results[l.request];
      const GenerationRequest& req = requests[l.request];
      const int64_t prompt_done = l.handle->prompt_done();
      if (on_prefill && prompt_done != l.reported_prompt) {
        on_prefill(l.request, prompt_done, static_cast<int64_t>(req.prompt.size()));
        l.reported_prompt = prompt_done;
      }
      for (size_t k = 0; k < tokens.size() && !l.cancelled; ++k) {
        const double at = std::chrono::duration<double>(pushed[k] - start).count();
        if (res.tokens.empty()) res.prefill_seconds = at;
        res.tokens.push_back(tokens[k]);
        res.token_seconds.push_back(at);
        if (on_token && !on_token(l.request, tokens[k])) {
          l.handle->Cancel();  // the rest is not wanted; tokens already pushed are dropped
          l.cancelled = true;
        }
      }
      if (!ended) continue;
      l.done = true;
      --remaining;
      // A request its caller stopped ended there, whatever the loop did meanwhile.
      switch (l.cancelled ? engine::EndReason::kCancelled : l.handle->end_reason()) {
        case engine::EndReason::kLength:
          res.finish_reason = FinishReason::kLength;
          break;
        case engine::EndReason::kEndOfGeneration:
        case engine::EndReason::kCancelled:
          res.finish_reason = FinishReason::kStop;
          break;
        default:
          res.finish_reason = FinishReason::kError;
          res.status = l.handle->status().ok()
                           ? Error(ErrorCode::kInternal, "the engine loop stopped the request")
                           : l.handle->status();
      }
      res.kv_stats = l.handle->final_stats();
      res.kv_memory = l.handle->final_memory();
    }
  }
  return results;
}

}  // namespace shadowkv
