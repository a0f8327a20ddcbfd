// Greedy decoding of several sequences at once (one batched forward step for all of them),
// as the eval runs one sample under every KV policy side by side.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "kv/kv_policy.h"
#include "model/cpu_model.h"

namespace shadowkv::eval {

// One sequence being decoded. The caller owns `kv` and keeps it alive across calls.
struct GreedyStream {
  kv::SequenceKv* kv = nullptr;
  std::vector<int32_t> feed;       // tokens the next step runs (a prompt chunk or the last token)
  int remaining = 0;               // tokens this stream may still generate
  std::vector<int32_t> generated;  // every token generated so far (appended to)
  bool ended = false;              // stopped at an end-of-generation token
  bool truncated = false;          // stopped because the model's context is full
  bool done() const { return feed.empty(); }
};

// Records `token` as generated (e.g. the argmax of replayed prefill logits) and arranges for it
// to be fed next unless it ends the stream.
void PushToken(GreedyStream& stream, int32_t token, const Tokenizer& tokenizer);

// Runs every stream until it stops (end-of-generation token, `remaining` exhausted, or a full
// context); streams already done are left alone.
Status RunGreedy(CpuModel& model, std::span<GreedyStream*> streams);

}  // namespace shadowkv::eval
