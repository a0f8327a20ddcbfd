// Batched greedy decoding over several sequences.
#include "eval/greedy.h"

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

}  // namespace shadowkv::eval
