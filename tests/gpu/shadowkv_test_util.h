// Helpers of the ShadowKV GPU tests: the parity tests' settings, a model's two slots with the
// first compressed (and decoded beside each other), a head's selectable landmarks as the CPU
// policy lists them, and the nearby query of a second decode step.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "core/half.h"
#include "core/status.h"
#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu_test_util.h"
#include "kv/kv_config.h"
#include "tiny_model.h"

namespace shadowkv::cuda::testing {

// The tiny Llama the parity tests use: 2 layers, 4 query heads on 2 KV heads, fp32 weights.
inline shadowkv::testing::TinyModelSpec SmallLlamaSpec(uint32_t seed) {
  return shadowkv::testing::SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32, true, seed);
}

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

// ShadowKV at every component (`width`) and, for a 300-token prompt, every chunk before its
// exact window in the budget (33 chunks), landmark selection, no outliers.
inline kv::KvPolicyConfig EveryChunkAtFullRank(int width) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.selection = "landmarks";
  config.rank = width;
  config.budget_tokens = 264;
  config.outlier_chunks = 0;
  return config;
}

// Two full-cache slots of 512 tokens (pre-RoPE keys kept) and one ShadowKV sequence of
// `config`; `prompt` prefilled into both slots (its last logits into `logits`), slot 0
// compressed into sequence 0.
inline Status PrefillTwoSlotsCompressFirst(CudaModel& gpu, const std::vector<int32_t>& prompt,
                                           const kv::KvPolicyConfig& config,
                                           std::vector<float>* logits) {
  SKV_RETURN_IF_ERROR(gpu.AllocateKvCache(2, 512, true));
  SKV_RETURN_IF_ERROR(gpu.AllocateShadowKv(config, 1, 512));
  SKV_RETURN_IF_ERROR(gpu.AllocateShadowKvValues(0, false));
  for (int slot = 0; slot < 2; ++slot) {
    CudaStepInput in;
    in.slot = slot;
    in.tokens = prompt;
    in.logits_out = logits->data();
    SKV_RETURN_IF_ERROR(gpu.Forward(std::span<const CudaStepInput>(&in, 1)));
  }
  return gpu.CompressToShadowKv(0, 0);
}

// After PrefillTwoSlotsCompressFirst (`logits`: the prompt's last): `steps` decode steps of the
// full cache's slot 1 and ShadowKV sequence 0, both fed the full cache's greedy token; each
// step's logit relative error of ShadowKV against the full cache.
inline Result<std::vector<double>> DecodeBesideTheFullCache(CudaModel& gpu,
                                                            std::vector<float> logits, int steps) {
  std::vector<float> shadow(logits.size());
  std::vector<double> errors;
  int32_t next = Argmax(logits);
  for (int step = 0; step < steps; ++step) {
    std::vector<int32_t> full_token = {next}, shadow_token = {next};
    SKV_RETURN_IF_ERROR(
        gpu.DecodeStep(std::vector<int>{1}, full_token, CudaSampling{}, logits.data()));
    SKV_RETURN_IF_ERROR(
        gpu.ShadowKvDecodeStep(std::vector<int>{0}, shadow_token, CudaSampling{}, shadow.data()));
    errors.push_back(RelativeError(shadow, logits));
    next = Argmax(logits);
  }
  return errors;
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
