// Batched greedy decoding over several sequences.
#include "eval/greedy.h"

#include <algorithm>
#include <cmath>

#include "engine/sampler.h"

namespace shadowkv::eval {

void PushToken(GreedyStream& stream, int32_t token, const Tokenizer& tokenizer) {
  stream.generated.push_back(token);
  stream.remaining--;
  stream.feed.clear();
  if (tokenizer.IsEndOfGeneration(token)) {
    stream.ended = true;
  } else if (stream.remaining > 0) {
    stream.feed.push_back(token);
  }
}

Status RunGreedy(CpuModel& model, std::span<GreedyStream*> streams) {
  const int64_t vocab = model.config().vocab_size;
  const int64_t context = model.config().context_length;
  std::vector<float> logits;
  std::vector<GreedyStream*> active;
  std::vector<StepInput> inputs;
  while (true) {
    active.clear();
    for (GreedyStream* s : streams) {
      if (s->done()) continue;
      if (s->kv->num_tokens() + static_cast<int64_t>(s->feed.size()) > context) {
        s->truncated = true;
        s->feed.clear();
        continue;
      }
      active.push_back(s);
    }
    if (active.empty()) return Status::Ok();
    logits.resize(active.size() * vocab);
    inputs.assign(active.size(), StepInput{});
    for (size_t i = 0; i < active.size(); ++i) {
      inputs[i].kv = active[i]->kv;
      inputs[i].tokens = active[i]->feed;
      inputs[i].logits = StepInput::Logits::kLast;
      inputs[i].logits_out = logits.data() + i * vocab;
    }
    SKV_RETURN_IF_ERROR(model.Forward(inputs));
    for (size_t i = 0; i < active.size(); ++i) {
      PushToken(*active[i], Argmax(std::span<const float>(logits.data() + i * vocab, vocab)),
                model.tokenizer());
    }
  }
}

namespace {

// log-softmax of `logits` into `out`, in double.
void LogSoftmax(std::span<const float> logits, std::vector<double>* out) {
  out->resize(logits.size());
  const double top = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - top);
  const double log_sum = top + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) (*out)[i] = static_cast<double>(logits[i]) - log_sum;
}

}  // namespace

void AddFidelityStep(std::span<const float> reference, std::span<const float> logits,
                     Fidelity* fidelity) {
  thread_local std::vector<double> p, q;
  LogSoftmax(reference, &p);
  LogSoftmax(logits, &q);
  double kl = 0.0;
  for (size_t v = 0; v < p.size(); ++v) kl += std::exp(p[v]) * (p[v] - q[v]);
  fidelity->steps++;
  fidelity->same_top += Argmax(logits) == Argmax(reference);
  fidelity->kl_sum += std::max(kl, 0.0);
}

Status RunTeacherForced(CpuModel& model, std::span<kv::SequenceKv* const> sequences,
                        std::span<const int32_t> tokens, std::vector<Fidelity>* fidelity) {
  const int64_t vocab = model.config().vocab_size;
  fidelity->assign(sequences.size(), Fidelity{});
  if (sequences.empty()) return Status::Ok();
  std::vector<float> logits(sequences.size() * vocab);
  std::vector<StepInput> inputs(sequences.size());
  for (size_t j = 0; j + 1 < tokens.size(); ++j) {
    for (size_t i = 0; i < sequences.size(); ++i) {
      inputs[i] = StepInput{};
      inputs[i].kv = sequences[i];
      inputs[i].tokens = tokens.subspan(j, 1);
      inputs[i].logits = StepInput::Logits::kLast;
      inputs[i].logits_out = logits.data() + i * vocab;
    }
    SKV_RETURN_IF_ERROR(model.Forward(inputs));
    const std::span<const float> first(logits.data(), vocab);
    for (size_t i = 0; i < sequences.size(); ++i) {
      AddFidelityStep(first, std::span<const float>(logits.data() + i * vocab, vocab),
                      &(*fidelity)[i]);
    }
  }
  return Status::Ok();
}

}  // namespace shadowkv::eval
