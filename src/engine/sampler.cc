// Sampler implementation: the top-k / top-p cut over sorted candidates (only when a cut is asked
// for), then Gumbel-max over the survivors with counter-based noise.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/draw_noise.h"

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

std::vector<int32_t> SamplingCandidates(std::span<const float> logits,
                                        const SamplingParams& params) {
  const int vocab = static_cast<int>(logits.size());
  const int keep = params.top_k > 0 ? std::min(params.top_k, vocab) : vocab;
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  if (vocab == 0) return ids;
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  ids.resize(keep);
  if (params.top_p >= 1.0f || params.temperature <= 0.0f) return ids;
  std::vector<double> probs(keep);
  const double max_logit = logits[ids[0]];
  double sum = 0.0;
  for (int i = 0; i < keep; ++i) {
    probs[i] = std::exp((logits[ids[i]] - max_logit) / params.temperature);
    sum += probs[i];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p.
  double mass = 0.0;
  for (int i = 0; i < keep; ++i) {
    mass += probs[i] / sum;
    if (mass >= params.top_p) {
      ids.resize(i + 1);
      break;
    }
  }
  return ids;
}

int32_t SampleAt(std::span<const float> logits, const SamplingParams& params, uint64_t draw) {
  if (params.temperature == 0.0f || logits.empty()) return Argmax(logits);
  const int vocab = static_cast<int>(logits.size());
  const float inv_temperature = 1.0f / params.temperature;
  const uint64_t stream = DrawStream(params.seed, draw);
  // argmax of logit / T + Gumbel noise: an exact draw from softmax(logits / T) over the ids
  // (NaN keys never win; lowest id on ties, as on the GPU).
  auto gumbel_max = [&](auto&& id_at, int count) {
    int32_t best_id = id_at(0);
    float best = -INFINITY;
    for (int i = 0; i < count; ++i) {
      const int32_t id = id_at(i);
      const float key = logits[id] * inv_temperature + GumbelNoise(stream, id);
      if (key > best || (key == best && id < best_id)) {
        best = key;
        best_id = id;
      }
    }
    return best_id;
  };
  if ((params.top_k <= 0 || params.top_k >= vocab) && params.top_p >= 1.0f) {
    return gumbel_max([](int i) { return static_cast<int32_t>(i); }, vocab);  // no sort needed
  }
  const std::vector<int32_t> ids = SamplingCandidates(logits, params);
  return gumbel_max([&](int i) { return ids[i]; }, static_cast<int>(ids.size()));
}

}  // namespace shadowkv
