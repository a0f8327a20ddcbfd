// A device-sampled id checked against the host Sampler over the logits it came from (the GPU
// sampling and model tests).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"

namespace shadowkv::cuda::testing {

inline shadowkv::SamplingParams CpuParams(const CudaSampling& c) {
  return shadowkv::SamplingParams{c.temperature, c.top_k, c.top_p, c.seed};
}

// Checks a device-sampled id against the host Sampler over the logits it came from: greedy and
// top_k = 1 rows give the argmax exactly; other rows one of SamplingCandidates, and SampleAt's id
// (the same noise) where fp32 rounding does not part them: `agreed` / `checked` count those.
class DrawChecker {
 public:
  ~DrawChecker() {
    // All but a rare rounding difference agree.
    EXPECT_GE(agreed_ + 1, checked_) << agreed_ << " of " << checked_ << " draws as on the host";
  }
  void Check(int32_t id, const std::vector<float>& logits, const CudaSampling& c,
             const std::string& at) {
    if (c.temperature == 0.0f || c.top_k == 1) {
      EXPECT_EQ(id, Argmax(logits)) << at;
      return;
    }
    const std::vector<int32_t> candidates = SamplingCandidates(logits, CpuParams(c));
    EXPECT_TRUE(std::find(candidates.begin(), candidates.end(), id) != candidates.end())
        << at << ": " << id << " is none of the " << candidates.size() << " candidates";
    ++checked_;
    agreed_ += SampleAt(logits, CpuParams(c), c.draw) == id;
  }

 private:
  int checked_ = 0, agreed_ = 0;
};

}  // namespace shadowkv::cuda::testing
