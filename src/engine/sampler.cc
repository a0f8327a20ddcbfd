// Sampler implementation: candidates sorted once, top-k then top-p cut, softmax at temperature.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace shadowkv {

Status SamplingParams::Validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return Error(ErrorCode::kInvalidArgument, "temperature {} must be a finite value >= 0",
                 temperature);
  }
  if (top_k < 0) return Error(ErrorCode::kInvalidArgument, "top_k {} is negative", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return Error(ErrorCode::kInvalidArgument, "top_p {} is not in (0, 1]", top_p);
  }
  return Status::Ok();
}

int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

int32_t Sampler::Sample(std::span<const float> logits) {
  if (params_.temperature == 0.0f) return Argmax(logits);
  const int vocab = static_cast<int>(logits.size());
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  int keep = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  ids.resize(keep);
  std::vector<double> probs(keep);
  const double max_logit = logits[ids[0]];
  double sum = 0.0;
  for (int i = 0; i < keep; ++i) {
    probs[i] = std::exp((logits[ids[i]] - max_logit) / params_.temperature);
    sum += probs[i];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p.
  double mass = 0.0;
  int cut = keep;
  for (int i = 0; i < keep; ++i) {
    mass += probs[i] / sum;
    if (mass >= params_.top_p) {
      cut = i + 1;
      break;
    }
  }
  std::discrete_distribution<int> pick(probs.begin(), probs.begin() + cut);
  return ids[pick(rng_)];
}

}  // namespace shadowkv
