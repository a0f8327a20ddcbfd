// Sampler: picks the next token from logits (greedy, or temperature + top-k + top-p with a seed).
// Draws are counter-based: the choice depends on (logits, settings, draw) only.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace shadowkv {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties)
  int top_k = 0;             // 0 = no limit
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  uint64_t seed = 0;

  Status Validate() const;
};

// The ids a draw at temperature > 0 chooses from, largest logit first (lowest id on ties): the
// top_k largest logits (all when 0), then the smallest prefix of them holding top_p of their
// softmax mass at `temperature`.
std::vector<int32_t> SamplingCandidates(std::span<const float> logits,
                                        const SamplingParams& params);

// Draw number `draw` of a sequence (0 for its first new token): an exact draw from the
// renormalised softmax over SamplingCandidates by the Gumbel-max trick with noise from (seed, draw,
// token id) (core/draw_noise.h, the GPU sampler's noise). logits [vocab]; not modified.
int32_t SampleAt(std::span<const float> logits, const SamplingParams& params, uint64_t draw);

// SampleAt with a draw counter of its own: the n-th Sample is draw n - 1.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params) {}
  int32_t Sample(std::span<const float> logits) { return SampleAt(logits, params_, draw_++); }
  uint64_t draws() const { return draw_; }

 private:
  SamplingParams params_;
  uint64_t draw_ = 0;
};

int32_t Argmax(std::span<const float> logits);

}  // namespace shadowkv
