// Engine::Run: one loop of forward steps mixing prefill chunks and decode rows.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>

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

namespace {

struct Active {
  int request;
  std::unique_ptr<kv::SequenceKv> kv;
  Sampler sampler;
  int64_t prompt_done = 0;
  int32_t next_token = -1;
  int64_t reserved_bytes = 0;
  std::chrono::steady_clock::time_point start;
};

}  // namespace

std::vector<GenerationResult> Engine::Run(std::span<const GenerationRequest> requests,
                                          const TokenCallback& on_token,
                                          const PrefillProgress& on_prefill) {
  using Clock = std::chrono::steady_clock;
  std::vector<GenerationResult> results(requests.size());
  std::vector<Active> active;
  size_t next_request = 0;
  int64_t reserved = 0;
  const int vocab = static_cast<int>(model_.config().vocab_size);
  std::vector<float> logits;

  auto finish = [&](Active& a, FinishReason reason, Status status) {
    GenerationResult& r = results[a.request];
    r.finish_reason = reason;
    r.status = std::move(status);
    r.kv_stats = a.kv->stats();
    r.kv_memory = a.kv->memory();
    reserved -= a.reserved_bytes;
    a.kv.reset();
  };

  while (next_request < requests.size() || !active.empty()) {
    // Admit requests while the batch and the KV memory budget allow.
    while (next_request < requests.size() && static_cast<int>(active.size()) < options_.max_batch) {
      const GenerationRequest& req = requests[next_request];
      GenerationResult& res = results[next_request];
      res.status = Validate(req);
      if (!res.status.ok()) {
        res.finish_reason = FinishReason::kError;
        ++next_request;
        continue;
      }
      const int64_t need =
          policy_.EstimateMemory(static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens)
              .fast_bytes;
      if (options_.kv_memory_limit > 0 && !active.empty() &&
          reserved + need > options_.kv_memory_limit) {
        break;  // wait for running sequences to finish
      }
      auto kv = policy_.NewSequence();
      if (!kv.ok()) {
        res.status = kv.status();
        res.finish_reason = FinishReason::kError;
        ++next_request;
        continue;
      }
      active.push_back(Active{static_cast<int>(next_request), std::move(kv).value(),
                              Sampler(req.sampling), 0, -1, need, Clock::now()});
      reserved += need;
      ++next_request;
    }

    // One step: a prefill chunk for sequences still reading their prompt, one token for others.
    std::vector<StepInput> inputs;
    std::vector<int32_t> single_tokens(active.size());
    inputs.reserve(active.size());
    logits.resize(active.size() * static_cast<size_t>(vocab));
    for (size_t i = 0; i < active.size(); ++i) {
      Active& a = active[i];
      const GenerationRequest& req = requests[a.request];
      StepInput in;
      in.kv = a.kv.get();
      in.logits_out = logits.data() + i * vocab;
      const int64_t prompt_size = static_cast<int64_t>(req.prompt.size());
      if (a.prompt_done < prompt_size) {
        const int64_t count =
            std::min<int64_t>(options_.prefill_chunk, prompt_size - a.prompt_done);
        in.tokens = std::span<const int32_t>(req.prompt.data() + a.prompt_done, count);
        in.finish_prefill = a.prompt_done + count == prompt_size;
        in.logits = in.finish_prefill ? StepInput::Logits::kLast : StepInput::Logits::kNone;
      } else {
        single_tokens[i] = a.next_token;
        in.tokens = std::span<const int32_t>(&single_tokens[i], 1);
      }
      inputs.push_back(in);
    }
    Status status = model_.Forward(inputs);
    if (!status.ok()) {
      // A step error is charged to every sequence in the step; their states are not reusable.
      for (Active& a : active) finish(a, FinishReason::kError, status);
      active.clear();
      continue;
    }
    for (size_t i = 0; i < active.size(); ++i) {
      Active& a = active[i];
      const GenerationRequest& req = requests[a.request];
      GenerationResult& res = results[a.request];
      const StepInput& in = inputs[i];
      if (a.prompt_done < static_cast<int64_t>(req.prompt.size())) {
        a.prompt_done += static_cast<int64_t>(in.tokens.size());
        if (on_prefill) on_prefill(a.request, a.prompt_done, req.prompt.size());
        if (!in.finish_prefill) continue;
        res.prefill_seconds = std::chrono::duration<double>(Clock::now() - a.start).count();
      }
      const int32_t token = a.sampler.Sample(std::span<const float>(in.logits_out, vocab));
      res.tokens.push_back(token);
      a.next_token = token;
      bool keep_going = !on_token || on_token(a.request, token);
      if (req.stop_at_end_of_generation && model_.tokenizer().IsEndOfGeneration(token)) {
        finish(a, FinishReason::kStop, Status::Ok());
      } else if (!keep_going) {
        finish(a, FinishReason::kStop, Status::Ok());
      } else if (static_cast<int>(res.tokens.size()) >= req.max_new_tokens) {
        finish(a, FinishReason::kLength, Status::Ok());
      }
    }
    std::erase_if(active, [](const Active& a) { return a.kv == nullptr; });
  }
  return results;
}

}  // namespace shadowkv
