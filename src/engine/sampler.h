// Sampler: picks the next token from logits (greedy, or temperature + top-k + top-p with a seed).
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include "core/status.h"

namespace shadowkv {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties)
  int top_k = 0;             // 0 = no limit
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  uint64_t seed = 0;

  Status Validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}
  // logits [vocab]; not modified.
  int32_t Sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

int32_t Argmax(std::span<const float> logits);

}  // namespace shadowkv
