// Helpers of the ShadowKV GPU tests: the parity tests' settings, a head's selectable landmarks
// as the CPU policy lists them, and the nearby query of a second decode step.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "core/half.h"
#include "kv/kv_config.h"

namespace shadowkv::cuda::testing {

// The parity tests' ShadowKV settings: the method's landmark selection and its rank rule without
// a floor, 64 budget tokens (K = 8 chunks, O = 2), bf16 or FP8 values and landmarks.
inline kv::KvPolicyConfig ParityConfig(bool fp8 = false) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.budget_tokens = 64;
  config.selection = "landmarks";
  config.rank_min = 0;
  config.rank_head_ratio = 0.0;
  config.fp8_values = fp8 ? 1 : 0;
  config.fp8_landmarks = fp8 ? 1 : 0;
  return config;
}

// The landmarks of (seq, head) that are not outliers, in chunk order, with each one's chunk:
// the CPU policy's landmark list. landmarks: [seqs, heads, capacity, dim]; outlier: [seqs,
// heads, capacity].
struct SelectableLandmarks {
  std::vector<int32_t> chunk_of;
  std::vector<float> list;  // [chunk_of.size(), dim]
  int64_t count() const { return static_cast<int64_t>(chunk_of.size()); }
};

inline SelectableLandmarks LandmarksOf(const std::vector<float>& landmarks,
                                       const std::vector<uint8_t>& outlier, int seq, int head,
                                       int heads, int capacity, int num_chunks, int dim) {
  SelectableLandmarks out;
  for (int c = 0; c < num_chunks; ++c) {
    const int64_t run = (int64_t{seq} * heads + head) * capacity + c;
    if (outlier[run]) continue;
    out.chunk_of.push_back(c);
    out.list.insert(out.list.end(), landmarks.begin() + run * dim,
                    landmarks.begin() + (run + 1) * dim);
  }
  return out;
}

// A second step's queries near the first's (most chunks stay selected), rounded to bf16.
inline void PerturbQueries(std::vector<float>* queries, std::mt19937& rng) {
  std::normal_distribution<float> noise(0.0f, 0.3f);
  for (float& q : *queries) q = Bf16ToFp32(Fp32ToBf16(q + noise(rng)));
}

}  // namespace shadowkv::cuda::testing
