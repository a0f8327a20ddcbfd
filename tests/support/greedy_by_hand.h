// Test reference for the engine loop: greedy decoding driven straight on a CpuModel, one
// sequence, no scheduler.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/sampler.h"
#include "kv/kv_policy.h"
#include "model/cpu_model.h"

namespace shadowkv::testing {

// Feeds `tokens` to `kv` in chunks of `chunk` (the last chunk's logits into `logits`, [vocab]);
// `finish` marks the last chunk as the end of the prompt.
inline void FeedByHand(CpuModel& model, kv::SequenceKv& kv, std::span<const int32_t> tokens,
                       size_t chunk, bool finish, std::vector<float>& logits) {
  logits.resize(model.config().vocab_size);
  for (size_t done = 0; done < tokens.size();) {
    const size_t count = std::min(chunk, tokens.size() - done);
    StepInput in;
    in.kv = &kv;
    in.tokens = tokens.subspan(done, count);
    done += count;
    in.finish_prefill = finish && done == tokens.size();
    in.logits_out = logits.data();
    EXPECT_TRUE(model.Forward(std::span<const StepInput>(&in, 1)).ok());
  }
}

// FeedByHand, then `max_new` greedy tokens (each but the last fed back).
inline std::vector<int32_t> GreedyByHand(CpuModel& model, kv::SequenceKv& kv,
                                         std::span<const int32_t> tokens, size_t chunk, bool finish,
                                         int max_new) {
  std::vector<float> logits;
  FeedByHand(model, kv, tokens, chunk, finish, logits);
  std::vector<int32_t> out;
  for (int i = 0; i < max_new; ++i) {
    out.push_back(Argmax(logits));
    if (i + 1 < max_new) {
      FeedByHand(model, kv, std::span<const int32_t>(&out.back(), 1), 1, false, logits);
    }
  }
  return out;
}

}  // namespace shadowkv::testing
