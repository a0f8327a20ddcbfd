// The parity runs of the ShadowKV GPU tests: a run of the tiny model's two prompts on the GPU
// against the CPU policy (CheckParity, CheckParityWhereTheCpuRuns: logits, gathered chunks, the
// chunks counted), a run on the GPU alone with copied sequences (DecodeOnGpu), and what each run
// selects (SelectingSteps, SelectedChunks). Used by shadowkv_model_test.cc and
// shadowkv_selection_modes_test.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu/model/shadowkv_plan.h"
#include "gpu_test_util.h"
#include "kv/kv_policy.h"
#include "kv/shadowkv_policy.h"
#include "model/cpu_model.h"
#include "shadowkv_test_util.h"
#include "tiny_model.h"
#include "tp_test_util.h"

namespace shadowkv::cuda::testing {

using shadowkv::testing::SomeTokens;
using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::WriteTinyModel;

// Whether `layer` of the spec's model slides (Mistral-style llama), and how many do not.
inline bool Windowed(const TinyModelSpec& spec, int layer) {
  return spec.sliding_window > 0 && (spec.windowed.empty() || spec.windowed[layer]);
}
inline int GlobalLayers(const TinyModelSpec& spec) {
  int global = 0;
  for (int layer = 0; layer < spec.layers; ++layer) global += !Windowed(spec, layer);
  return global;
}

// The decode steps of a parity run's 24 that select chunks (steps 0, N, 2N, ... at interval N).
inline int64_t SelectingSteps(const kv::KvPolicyConfig& config) {
  return (24 + config.select_interval - 1) / config.select_interval;
}

// The chunks a parity run of `rows` rows selects (K = 8 at each selecting step of each layer and
// KV head): under select_drift the (row, layer, KV head) steps that selected, as the device
// counted them, else every head at each selecting step.
inline int64_t SelectedChunks(const kv::KvPolicyConfig& config, const CudaShadowKvStats& stats,
                              int rows, int layers, int kv_heads) {
  if (config.ReselectsOnDrift()) return stats.head_selections * 8;
  return SelectingSteps(config) * rows * layers * kv_heads * 8;
}

// What a parity run must reach: the share of the GPU's gathered chunks the CPU gathered too, the
// (sequence, step) pairs out of 48 with the same chunks on both sides, and the logits' relative
// error at a pair with the same chunks after the sequence attended to other chunks once.
struct ParityBounds {
  double min_overlap = 0.97;
  int min_compared = 24;
  double after_divergence = 0.15;
  double same_chunks = 5e-2;  // logit relative error where both attend the same chunks
};

// fp8: values and landmarks stored as FP8 on both sides (core/fp8.h, the same rule).
// copies: sequences 2 and 3 are copies of 0 and 1 (3's values in pinned host memory) decoded in
// the same steps, so a step has 4 rows and its selection runs in two overlapping halves
// (RunShadowKvAttention); the copies' logits must equal the originals' bit for bit.
// `gpu_config` / `cpu_config`: the settings of each side where they differ (a per-layer rank
// that every layer resolves to one rank against that fixed rank on the CPU); `want_ranks`: the
// rank every layer of every sequence must report on the GPU (0: not checked).
// `spec`: the model (the tiny Llama unless a test names another family's); `bounds`: what the
// comparison must reach (ParityBounds).
inline void CheckParity(const kv::KvPolicyConfig& gpu_config, const kv::KvPolicyConfig& cpu_config,
                        bool copies, int want_ranks, const TinyModelSpec& spec = SmallLlamaSpec(7),
                        const ParityBounds& bounds = {}) {
  const bool fp8 = gpu_config.fp8_values != 0;
  const std::string path = WriteTinyModel(spec, "gpu_shadowkv_parity_" + spec.architecture);
  auto cpu = CpuModel::Load(path, 2, Numerics::kExact);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  auto gpu_or = CudaModel::Load(path, tp_testing::SmallOptions());
  ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
  CudaModel& gpu = **gpu_or;

  const kv::KvPolicyConfig& config = gpu_config;
  auto policy = kv::MakeKvPolicy(cpu_config, (*cpu)->kv_geometry());
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  const std::vector<std::vector<int32_t>> prompts = {SomeTokens(300, 11), SomeTokens(237, 12)};
  std::vector<std::unique_ptr<kv::SequenceKv>> sequences;
  const int vocab = static_cast<int>((*cpu)->config().vocab_size);
  std::vector<int32_t> next(2);
  for (int s = 0; s < 2; ++s) {
    sequences.push_back(policy->get()->NewSequence().value());
    std::vector<float> logits(vocab);
    StepInput in;
    in.kv = sequences[s].get();
    in.tokens = prompts[s];
    in.finish_prefill = true;
    in.logits_out = logits.data();
    ASSERT_TRUE((*cpu)->Forward(std::span<const StepInput>(&in, 1)).ok());
    next[s] = Argmax(logits);
  }

  ASSERT_TRUE(gpu.AllocateKvCache(2, 512, true).ok());
  const int rows = copies ? 4 : 2;
  ASSERT_TRUE(gpu.AllocateShadowKv(config, rows, 512).ok());
  for (int s = 0; s < rows; ++s) {
    ASSERT_TRUE(gpu.AllocateShadowKvValues(s, s % 2 == 1).ok());  // odd: pinned host memory
  }
  for (int s = 0; s < 2; ++s) {
    CudaStepInput in;
    in.slot = s;
    in.tokens = prompts[s];
    ASSERT_TRUE(gpu.Forward(std::span<const CudaStepInput>(&in, 1)).ok());
    const Status compressed = gpu.CompressToShadowKv(s, s);
    ASSERT_TRUE(compressed.ok()) << compressed.ToString();
    EXPECT_EQ(gpu.shadowkv_length(s), static_cast<int64_t>(prompts[s].size()));
  }
  gpu.FreeKvCache();
  for (int s = 2; s < rows; ++s) ASSERT_TRUE(gpu.CopyShadowKvSequence(s - 2, s).ok());
  for (int s = 0; s < rows; ++s) {
    auto ranks = gpu.ShadowKvLayerRanks(s);
    ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
    if (want_ranks > 0) {
      std::vector<int32_t> want(spec.layers, want_ranks);
      for (int layer = 0; layer < spec.layers; ++layer) {
        if (Windowed(spec, layer)) want[layer] = 0;  // kept whole, not compressed
      }
      EXPECT_EQ(*ranks, want) << "sequence " << s;
    }
    if (s >= 2) {
      auto original = gpu.ShadowKvLayerRanks(s - 2);
      ASSERT_TRUE(original.ok());
      EXPECT_EQ(*ranks, *original) << "copy " << s << "'s layer ranks";
    }
  }

  // 24 steps: both sequences cross graduations (300: at +4, +12, +20; 237: at +3, +11, +19).
  double worst = 0.0, worst_after = 0.0, worst_differing = 0.0;
  int compared = 0;
  int64_t gathered = 0, matched = 0;
  std::vector<bool> diverged(2, false);  // a step of the sequence attended to other chunks
  for (int step = 0; step < 24; ++step) {
    std::vector<std::vector<float>> want(2, std::vector<float>(vocab));
    std::vector<StepInput> inputs(2);
    std::vector<std::vector<int32_t>> tokens_in = {{next[0]}, {next[1]}};
    for (int s = 0; s < 2; ++s) {
      inputs[s].kv = sequences[s].get();
      inputs[s].tokens = tokens_in[s];
      inputs[s].logits_out = want[s].data();
    }
    ASSERT_TRUE((*cpu)->Forward(inputs).ok());
    std::vector<float> got(rows * static_cast<size_t>(vocab));
    std::vector<int32_t> tokens = {next[0], next[1], next[0], next[1]};
    tokens.resize(rows);
    std::vector<int> seqs(rows);
    for (int s = 0; s < rows; ++s) seqs[s] = s;
    const Status status = gpu.ShadowKvDecodeStep(seqs, tokens, CudaSampling{}, got.data());
    ASSERT_TRUE(status.ok()) << status.ToString();
    for (int s = 2; s < rows; ++s) {
      ASSERT_TRUE(std::equal(got.begin() + s * vocab, got.begin() + (s + 1) * vocab,
                             got.begin() + (s - 2) * vocab))
          << "copy " << s << " differs from sequence " << s - 2 << " at step " << step;
    }
    for (int s = 0; s < 2; ++s) {
      const std::vector<float> row(got.begin() + s * vocab, got.begin() + (s + 1) * vocab);
      auto* shadow = dynamic_cast<kv::ShadowKvSequence*>(sequences[s].get());
      ASSERT_NE(shadow, nullptr);
      bool same_chunks = true;
      for (int layer = 0; layer < spec.layers; ++layer) {
        const kv::ShadowKvLayerInfo info = shadow->Inspect(layer);
        if (Windowed(spec, layer)) {  // its window only, on both sides
          for (int h = 0; h < spec.kv_heads; ++h) {
            auto chunks = gpu.ShadowKvGatheredChunks(s, layer, h);
            ASSERT_TRUE(chunks.ok());
            EXPECT_TRUE(chunks->empty());
          }
          EXPECT_TRUE(info.gathered_chunks.empty());
          continue;
        }
        for (int h = 0; h < spec.kv_heads; ++h) {
          auto chunks = gpu.ShadowKvGatheredChunks(s, layer, h);
          ASSERT_TRUE(chunks.ok());
          EXPECT_EQ(chunks->size(), info.gathered_chunks[h].size());
          std::set<int32_t> cpu_set(info.gathered_chunks[h].begin(), info.gathered_chunks[h].end());
          cpu_set.erase(-1);
          for (int32_t chunk : *chunks) {
            if (chunk < 0) continue;
            ++gathered;
            const bool found = cpu_set.count(chunk) > 0;
            matched += found;
            same_chunks = same_chunks && found;
          }
        }
      }
      // Where both attend to the same chunks the outputs must agree to bf16 rounding; a chunk
      // picked differently (landmarks rounded to bf16 on the GPU break near-ties the other way)
      // changes a tiny model's output by more, so those steps only count towards the overlap.
      // After such a step the sequence's later tokens carry that difference in their keys and
      // values at every layer past the first, so the same chunks agree less closely there.
      const double error = RelativeError(row, want[s]);
      if (same_chunks) {
        ++compared;
        if (!diverged[s]) {
          worst = std::max(worst, error);
          EXPECT_LT(error, bounds.same_chunks) << "sequence " << s << ", step " << step;
        } else {
          worst_after = std::max(worst_after, error);
          EXPECT_LT(error, bounds.after_divergence)
              << "sequence " << s << ", step " << step << " (after a divergence)";
        }
      } else {
        diverged[s] = true;
        worst_differing = std::max(worst_differing, error);
      }
      next[s] = Argmax(want[s]);
    }
    EXPECT_EQ(tokens[0], Argmax(std::vector<float>(got.begin(), got.begin() + vocab)));
  }
  const CudaShadowKvStats stats = gpu.shadowkv_stats();
  std::printf(
      "[ parity   ] %s%s%s: %d of 48 (sequence, step) pairs with the same chunks as the "
      "CPU, worst logit relative error %.2e there before any divergence (%.2e after one, "
      "%.2e elsewhere); %lld of %lld gathered chunks also gathered on the CPU; GPU hit rate "
      "%.1f%%\n",
      config.display_name().c_str(), fp8 ? " (FP8 values and landmarks)" : "",
      copies ? " (with copies: 4 rows, the selection in halves)" : "", compared, worst, worst_after,
      worst_differing, static_cast<long long>(matched), static_cast<long long>(gathered),
      stats.chunks_selected ? 100.0 * stats.chunk_hits / stats.chunks_selected : 0.0);
  EXPECT_GE(compared, bounds.min_compared);
  EXPECT_EQ(stats.host_value_sequences, rows / 2);
  EXPECT_EQ(stats.chunks_selected,
            SelectedChunks(config, stats, rows, GlobalLayers(spec), spec.kv_heads));
  ASSERT_GT(gathered, 0);
  EXPECT_GE(static_cast<double>(matched) / gathered, bounds.min_overlap);
  EXPECT_EQ(gpu.shadowkv_length(0), 324);
  EXPECT_EQ(gpu.shadowkv_length(1), 261);
  const int head_dim = spec.hidden / spec.heads;
  auto geometry = MakeSkvGeometry(config, GlobalLayers(spec), spec.kv_heads, head_dim, 512);
  ASSERT_TRUE(geometry.ok());
  EXPECT_EQ(stats.host_bytes, stats.host_value_sequences * geometry->StoreBytesPerSequence());
  if (fp8) {
    // The values take 1 byte and a 4-byte scale per chunk and head instead of 2 bytes each.
    EXPECT_EQ(geometry->ValueBytesPerSequence(),
              int64_t{spec.layers} * spec.kv_heads * 64 * (8 * 64 + 4));
  }
  if (config.exact_keys != 0) {  // and the keys follow as bf16 runs, or FP8 runs and scales
    const int64_t runs = int64_t{GlobalLayers(spec)} * spec.kv_heads * 64;
    EXPECT_EQ(geometry->KeyBytesPerSequence(),
              config.fp8_keys != 0 ? runs * (8 * head_dim + 4) : runs * 8 * head_dim * 2);
  }
}

// CheckParity with the same settings on both sides where the CPU policy takes them (a mode the
// CPU side builds separately); says so where it does not yet.
inline void CheckParityWhereTheCpuRuns(const kv::KvPolicyConfig& config, int want_ranks) {
  auto cpu = CpuModel::Load(WriteTinyModel(SmallLlamaSpec(7), "gpu_shadowkv_cpu_modes"), 2,
                            Numerics::kExact);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  if (auto policy = kv::MakeKvPolicy(config, (*cpu)->kv_geometry()); !policy.ok()) {
    std::printf("[ parity   ] %s: no CPU parity, the CPU policy says %s\n",
                config.display_name().c_str(), policy.status().ToString().c_str());
    return;
  }
  CheckParity(config, config, /*copies=*/true, want_ranks);
}

// Decodes the parity prompts on the GPU alone under `config`: four rows (sequences 2 and 3
// copies of 0 and 1, so the selection runs in two halves), greedy on each original's logits,
// 24 steps with graduations. Returns the logits of every step and row, and checks the copies
// equal their originals bit for bit and that every selecting step selected K chunks per KV
// head. `gathered`: each step's chunks per (original sequence, layer, KV head), in that order;
// `stats` (optional): the run's counters at its end; `options`: the model's (SmallOptions).
inline std::vector<float> DecodeOnGpu(
    const kv::KvPolicyConfig& config, std::vector<std::vector<int32_t>>* gathered,
    CudaShadowKvStats* stats = nullptr,
    const CudaModelOptions& options = tp_testing::SmallOptions()) {
  TinyModelSpec spec = SmallLlamaSpec(7);
  const std::string path = WriteTinyModel(spec, "gpu_shadowkv_rerank");
  auto gpu_or = CudaModel::Load(path, options);
  EXPECT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
  if (!gpu_or.ok()) return {};
  CudaModel& gpu = **gpu_or;
  const std::vector<std::vector<int32_t>> prompts = {SomeTokens(300, 11), SomeTokens(237, 12)};
  EXPECT_TRUE(gpu.AllocateKvCache(2, 512, true).ok());
  const Status allocated = gpu.AllocateShadowKv(config, 4, 512);
  EXPECT_TRUE(allocated.ok()) << allocated.ToString();
  if (!allocated.ok()) return {};
  for (int s = 0; s < 4; ++s) EXPECT_TRUE(gpu.AllocateShadowKvValues(s, s % 2 == 1).ok());
  for (int s = 0; s < 2; ++s) {
    CudaStepInput in;
    in.slot = s;
    in.tokens = prompts[s];
    EXPECT_TRUE(gpu.Forward(std::span<const CudaStepInput>(&in, 1)).ok());
    const Status compressed = gpu.CompressToShadowKv(s, s);
    EXPECT_TRUE(compressed.ok()) << compressed.ToString();
  }
  gpu.FreeKvCache();
  for (int s = 2; s < 4; ++s) EXPECT_TRUE(gpu.CopyShadowKvSequence(s - 2, s).ok());
  const int vocab = static_cast<int>(gpu.config().vocab_size);
  std::vector<int32_t> next = {prompts[0].back(), prompts[1].back()};
  std::vector<float> all;
  for (int step = 0; step < 24; ++step) {
    std::vector<float> got(4 * static_cast<size_t>(vocab));
    std::vector<int32_t> tokens = {next[0], next[1], next[0], next[1]};
    const std::vector<int> seqs = {0, 1, 2, 3};
    const Status status = gpu.ShadowKvDecodeStep(seqs, tokens, CudaSampling{}, got.data());
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (!status.ok()) return {};
    for (int s = 0; s < 2; ++s) {
      EXPECT_TRUE(std::equal(got.begin() + (s + 2) * vocab, got.begin() + (s + 3) * vocab,
                             got.begin() + s * vocab))
          << config.display_name() << ": copy " << s + 2 << " differs at step " << step;
      const std::vector<float> row(got.begin() + s * vocab, got.begin() + (s + 1) * vocab);
      EXPECT_TRUE(std::all_of(row.begin(), row.end(), [](float x) { return std::isfinite(x); }))
          << config.display_name() << ": sequence " << s << ", step " << step;
      next[s] = Argmax(row);
      for (int layer = 0; layer < spec.layers; ++layer) {
        for (int h = 0; h < spec.kv_heads; ++h) {
          auto chunks = gpu.ShadowKvGatheredChunks(s, layer, h);
          EXPECT_TRUE(chunks.ok());
          if (chunks.ok()) gathered->push_back(*chunks);
        }
      }
    }
    all.insert(all.end(), got.begin(), got.begin() + 2 * vocab);
  }
  const CudaShadowKvStats counted = gpu.shadowkv_stats();
  EXPECT_EQ(counted.chunks_selected, SelectedChunks(config, counted, 4, spec.layers, spec.kv_heads))
      << config.display_name();
  if (stats) *stats = counted;
  return all;
}

}  // namespace shadowkv::cuda::testing
