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

// How closely one sequence's next-token distributions follow a reference's along the same
// tokens (teacher forcing), summed over steps.
struct Fidelity {
  int steps = 0;
  int same_top = 0;     // steps whose most likely token is the reference's
  double kl_sum = 0.0;  // sum over steps of KL(reference || this), in nats
};

// Adds one step to `fidelity`: how far the next-token distribution of `logits` is from that of
// `reference` (logits over the same vocabulary).
void AddFidelityStep(std::span<const float> reference, std::span<const float> logits,
                     Fidelity* fidelity);

// Feeds `tokens` (all but the last; the first is what each sequence's prompt predicted) one at
// a time to every sequence in one batched step, and compares each sequence's distribution with
// sequences[0]'s: `fidelity` receives one entry per sequence (the reference's own compares it
// with itself). The sequences hold the same prompt, each under its own policy.
Status RunTeacherForced(CpuModel& model, std::span<kv::SequenceKv* const> sequences,
                        std::span<const int32_t> tokens, std::vector<Fidelity>* fidelity);

}  // namespace shadowkv::eval
