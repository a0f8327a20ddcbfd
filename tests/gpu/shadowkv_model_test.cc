// GPU ShadowKV against the CPU ShadowKV policy on the same tiny model and prompts (llama, the
// phi3 and glm4 forms, and sliding-window llama against the CPU's split policy): logits of every
// decode step within bf16 tolerance, the same chunks in the gather buffers (up to ties and
// rounding), two sequences of different lengths in one batch (one with values in pinned host
// memory), graduation of generated chunks; per-layer ranks from the key spectrum (the layout at
// the cap, decode at a rank below it); exact keys in the store (against the full cache and the
// CPU); selection reuse by interval and by query drift. The basis solved on the GPU and the
// snapshots are in shadowkv_basis_snapshot_test.cc.
// The host-side planning is tested in shadowkv_plan_test.cc.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <string>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu/model/shadowkv_plan.h"
#include "gpu_test_util.h"
#include "shadowkv_test_util.h"
#include "tp_test_util.h"
#include "kv/kv_policy.h"
#include "kv/shadowkv_policy.h"
#include "model/cpu_model.h"
#include "tiny_model.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;
using shadowkv::testing::SomeTokens;
using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::WriteTinyModel;
using testing::SmallLlamaSpec;

// Whether `layer` of the spec's model slides (Mistral-style llama), and how many do not.
bool Windowed(const TinyModelSpec& spec, int layer) {
  return spec.sliding_window > 0 && (spec.windowed.empty() || spec.windowed[layer]);
}
int GlobalLayers(const TinyModelSpec& spec) {
  int global = 0;
  for (int layer = 0; layer < spec.layers; ++layer) global += !Windowed(spec, layer);
  return global;
}

// The decode steps of a parity run's 24 that select chunks (steps 0, N, 2N, ... at interval N).
int64_t SelectingSteps(const kv::KvPolicyConfig& config) {
  return (24 + config.select_interval - 1) / config.select_interval;
}

// The chunks a parity run of `rows` rows selects (K = 8 at each selecting step of each layer and
// KV head): under select_drift the (row, layer, KV head) steps that selected, as the device
// counted them, else every head at each selecting step.
int64_t SelectedChunks(const kv::KvPolicyConfig& config, const CudaShadowKvStats& stats, int rows,
                       int layers, int kv_heads) {
  if (config.select_drift > 0.0 && config.select_interval > 1) return stats.head_selections * 8;
  return SelectingSteps(config) * rows * layers * kv_heads * 8;
}

// What a parity run must reach: the share of the GPU's gathered chunks the CPU gathered too, the
// (sequence, step) pairs out of 48 with the same chunks on both sides, and the logits' relative
// error at a pair with the same chunks after the sequence attended to other chunks once.
struct ParityBounds {
  double min_overlap = 0.97;
  int min_compared = 24;
  double after_divergence = 0.15;
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
void CheckParity(const kv::KvPolicyConfig& gpu_config, const kv::KvPolicyConfig& cpu_config,
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
          EXPECT_LT(error, 5e-2) << "sequence " << s << ", step " << step;
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
      copies ? " (with copies: 4 rows, the selection in halves)" : "", compared, worst,
      worst_after, worst_differing, static_cast<long long>(matched),
      static_cast<long long>(gathered),
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

void CheckParity(bool fp8, bool copies = false) {
  const kv::KvPolicyConfig config = ParityConfig(fp8);
  CheckParity(config, config, copies, /*want_ranks=*/24);  // ceil8(128 / 6.4)
}

// phi3 (fused tensors, LongRoPE's factors in the rebuild's rotation and its attention factor in
// the softmax scale) and glm4 (biased keys, half of each head rotated in pairs: the first
// rebuild kernel, post norms), head dim 64, against the CPU policy on the same files.
TEST(CudaShadowKvParityTest, Phi3AndGlm4MatchTheCpuPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  for (const char* architecture : {"phi3", "glm4"}) {
    SCOPED_TRACE(architecture);
    const kv::KvPolicyConfig config = ParityConfig(false);
    CheckParity(
        config, config, false, /*want_ranks=*/24,
        shadowkv::testing::SmallSpec(architecture, 256, 4, 2, gguf::GgmlType::kF32, true, 7));
  }
}

// Phi-3-mini's heads, 96 wide (the fast kernels' 96-wide instances, LongRoPE in the rebuild's
// rotation), rank ceil8(192 / 6.4) = 32, the landmark selection with copies and the re-rank.
TEST(CudaShadowKvParityTest, Phi3HeadDim96MatchesTheCpuPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  const TinyModelSpec spec =
      shadowkv::testing::SmallSpec("phi3", 384, 4, 2, gguf::GgmlType::kF32, true, 9);
  const kv::KvPolicyConfig config = ParityConfig(false);
  CheckParity(config, config, /*copies=*/true, /*want_ranks=*/32, spec);
  kv::KvPolicyConfig rerank = ParityConfig(false);
  rerank.selection = "rerank";
  rerank.label = "shadowkv:select=rerank";
  CheckParity(rerank, rerank, /*copies=*/false, /*want_ranks=*/32, spec);
}

// GLM-4-9B's 16 query heads per KV head: the tensor-core scoring in two column tiles of 8 heads
// and the select over all 16, against the CPU policy, for the landmark selection and the
// re-rank, at head dim 64 (two KV heads) and 128 (one).
TEST(CudaShadowKvParityTest, SixteenQueryHeadsPerKvHeadMatchTheCpuPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  kv::KvPolicyConfig rerank = ParityConfig(false);
  rerank.selection = "rerank";
  rerank.label = "shadowkv:select=rerank";
  for (const TinyModelSpec& spec :
       {shadowkv::testing::SmallSpec("glm4", 2048, 32, 2, gguf::GgmlType::kF32, false, 14),
        shadowkv::testing::SmallSpec("glm4", 2048, 16, 1, gguf::GgmlType::kF32, false, 15)}) {
    SCOPED_TRACE(::testing::Message() << spec.kv_heads << " KV heads");
    // Rank ceil8(128 / 6.4). These models' near-ties part the selections more often than the
    // tiny Llama's (1 to 3% of the gathered chunks differ, against under 1%).
    const kv::KvPolicyConfig landmarks = ParityConfig(false);
    CheckParity(landmarks, landmarks, /*copies=*/true, /*want_ranks=*/24, spec, {0.95});
    CheckParity(rerank, rerank, /*copies=*/true, /*want_ranks=*/24, spec, {0.95});
  }
}

// Sliding-window models (Mistral-style llama with a per-layer pattern, window 64), exactly: with
// every key component kept (rank = the width), every chunk selected and no outliers, ShadowKV's
// attention is full attention up to bf16 rounding, so its decode must give the full cache's
// logits, the windowed layers reading their rings where the full cache masks its window. The
// prompt's last 64 tokens wrap around the ring (300 % 64 = 44); three steps (the fourth
// graduates a chunk past the budget). Global layers evenly spaced (the batched GEMMs in one
// strided run: layers 1 and 3 of 4) and not (one run per layer: 1, 2 and 4 of 5). (At head dim
// 256 the full rank does not fit the rebuild's shared memory; the split-policy parity below
// covers those kernels.)
TEST(CudaShadowKvParityTest, SlidingWindowRingsDecodeAsTheFullCache) {
  SKV_SKIP_WITHOUT_GPU();
  struct Case {
    std::vector<bool> windowed;
    int hidden, heads, kv_heads;
  };
  for (const Case& c : {Case{{true, false, true, false}, 256, 4, 2},
                        Case{{true, false, false, true, false}, 256, 4, 2}}) {
    TinyModelSpec spec = shadowkv::testing::SmallSpec("llama", c.hidden, c.heads, c.kv_heads,
                                                      gguf::GgmlType::kF32, true, 7);
    spec.layers = static_cast<int>(c.windowed.size());
    spec.sliding_window = 64;
    spec.windowed = c.windowed;
    const int head_dim = c.hidden / c.heads;
    SCOPED_TRACE(::testing::Message() << spec.layers << " layers, " << GlobalLayers(spec)
                                      << " global, head_dim " << head_dim);
    auto gpu_or = CudaModel::Load(WriteTinyModel(spec, "gpu_shadowkv_ring"), tp_testing::SmallOptions());
    ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
    CudaModel& gpu = **gpu_or;
    const int vocab = static_cast<int>(gpu.config().vocab_size);
    const std::vector<int32_t> prompt = SomeTokens(300, 31);
    const kv::KvPolicyConfig config = EveryChunkAtFullRank(c.kv_heads * head_dim);
    std::vector<float> full(vocab);
    const Status prepared = PrefillTwoSlotsCompressFirst(gpu, prompt, config, &full);
    ASSERT_TRUE(prepared.ok()) << prepared.ToString();
    auto errors = DecodeBesideTheFullCache(gpu, full, 3);
    ASSERT_TRUE(errors.ok()) << errors.status().ToString();
    for (size_t step = 0; step < errors->size(); ++step) {
      EXPECT_LT((*errors)[step], 2e-2) << "step " << step;
    }
    const double worst = *std::max_element(errors->begin(), errors->end());
    std::printf("[ ring     ] %d layers (%d global), head_dim %d: ShadowKV at full rank and "
                "budget against the full cache, worst logit relative error %.2e over 3 steps\n",
                spec.layers, GlobalLayers(spec), head_dim, worst);
  }
}

// The same models, and one with heads 256 wide (Gemma 3 below 27B: four query heads on one KV
// head, the fast kernels' 256-wide instances, rank ceil8(256 / 6.4) = 40), against the CPU's
// split policy (kv/sliding_split_policy.cc) at the parity settings, the landmark selection with
// copies (the rings copied too, the selection in halves) and the re-rank. Their global layers sit deeper than the tiny
// Llama's (behind windowed layers that already differ by bf16 rounding), so near-ties part the
// selections more often, and a step that attended to other chunks leaves keys and values in the
// windows that every later step reads in full: the bounds are looser than the 2-layer model's.
// The same depth without windows runs first, as a control (its figures are printed, held to the
// same bounds).
TEST(CudaShadowKvParityTest, SlidingWindowModelsMatchTheCpuSplitPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  const ParityBounds bounds{0.92, 6, 0.5};
  struct Case {
    std::vector<bool> windowed;
    int hidden, heads, kv_heads, want_ranks;
  };
  for (const Case& c : {Case{{true, false, true, false}, 256, 4, 2, 24},
                        Case{{true, false, false, true, false}, 256, 4, 2, 24},
                        Case{{false, true, false}, 1024, 4, 1, 40}}) {
    TinyModelSpec spec = shadowkv::testing::SmallSpec("llama", c.hidden, c.heads, c.kv_heads,
                                                      gguf::GgmlType::kF32, true, 7);
    spec.layers = static_cast<int>(c.windowed.size());
    const kv::KvPolicyConfig config = ParityConfig(false);
    kv::KvPolicyConfig rerank = ParityConfig(false);
    rerank.selection = "rerank";
    rerank.label = "shadowkv:select=rerank";
    {
      SCOPED_TRACE(::testing::Message() << spec.layers << " layers, no windows (control)");
      CheckParity(config, config, /*copies=*/false, c.want_ranks, spec, bounds);
    }
    spec.sliding_window = 64;
    spec.windowed = c.windowed;
    SCOPED_TRACE(::testing::Message() << spec.layers << " layers, " << GlobalLayers(spec)
                                      << " global");
    CheckParity(config, config, /*copies=*/true, c.want_ranks, spec, bounds);
    CheckParity(rerank, rerank, /*copies=*/false, c.want_ranks, spec, bounds);
  }
}

TEST(CudaShadowKvParityTest, MatchesTheCpuPolicyOverDecodeAndGraduation) {
  SKV_SKIP_WITHOUT_GPU();
  CheckParity(/*fp8=*/false);
}

TEST(CudaShadowKvParityTest, Fp8ValuesAndLandmarksMatchTheCpuPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  CheckParity(/*fp8=*/true);
}

TEST(CudaShadowKvParityTest, FourRowsSelectInOverlappingHalvesAsTheCpuPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  CheckParity(/*fp8=*/false, /*copies=*/true);
}

// A per-layer rank that every layer resolves to its floor of 32 (a share of 1e-6 is held by the
// first 8 directions) while A and B stay laid out for the cap, the width 128: the rows past
// each layer's rank must be zeros and the kernels stop at it, so the GPU decodes as the CPU
// policy with the fixed rank 32, through graduations, FP8 stores and copied sequences.
kv::KvPolicyConfig FloorRankConfig(bool fp8) {
  kv::KvPolicyConfig config = ParityConfig(fp8);
  config.rank_energy = 1e-6;
  config.rank_min = 32;
  config.label = "shadowkv:rank_energy=1e-6:rank_min=32";
  return config;
}

TEST(CudaShadowKvParityTest, PerLayerRankBelowItsCapMatchesTheCpuAtThatRank) {
  SKV_SKIP_WITHOUT_GPU();
  kv::KvPolicyConfig cpu = ParityConfig(false);
  cpu.rank = 32;
  CheckParity(FloorRankConfig(false), cpu, /*copies=*/true, /*want_ranks=*/32);
}

TEST(CudaShadowKvParityTest, PerLayerRankWithFp8StoresMatchesTheCpuAtThatRank) {
  SKV_SKIP_WITHOUT_GPU();
  kv::KvPolicyConfig cpu = ParityConfig(true);
  cpu.rank = 32;
  CheckParity(FloorRankConfig(true), cpu, /*copies=*/false, /*want_ranks=*/32);
}

// Exact keys in the store (exact_keys=1): a miss copies the chunk's post-RoPE keys instead of
// rebuilding them, so at rank 8 with every chunk in the budget the step equals the full cache's
// up to the attention's summation order, where the rank-8 rebuild is far from it; and through
// decode, graduations (the graduated chunk's keys written to the store), host-memory stores, FP8
// values with FP8 keys (the codec's runs on both sides) and copied sequences the GPU decodes as
// the CPU policy with the same option, for the landmark selection and for the re-rank scored at
// rank 8 of 24.
TEST(CudaShadowKvParityTest, ExactKeysInTheStoreDecodeAsTheFullCacheAndTheCpuPolicy) {
  SKV_SKIP_WITHOUT_GPU();
  const TinyModelSpec spec = SmallLlamaSpec(7);
  const std::vector<int32_t> prompt = SomeTokens(300, 31);
  double rebuilt_error = 0.0, exact_error = 0.0;
  for (const int exact : {0, 1}) {
    auto gpu_or = CudaModel::Load(WriteTinyModel(spec, "gpu_shadowkv_exact_keys"),
                                  tp_testing::SmallOptions());
    ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
    CudaModel& gpu = **gpu_or;
    const int vocab = static_cast<int>(gpu.config().vocab_size);
    kv::KvPolicyConfig config = EveryChunkAtFullRank(spec.kv_heads * spec.hidden / spec.heads);
    config.rank = 8;
    config.rank_min = 0;
    config.rank_head_ratio = 0.0;
    config.exact_keys = exact;
    std::vector<float> full(vocab);
    const Status prepared = PrefillTwoSlotsCompressFirst(gpu, prompt, config, &full);
    ASSERT_TRUE(prepared.ok()) << prepared.ToString();
    auto errors = DecodeBesideTheFullCache(gpu, full, 3);
    ASSERT_TRUE(errors.ok()) << errors.status().ToString();
    (exact ? exact_error : rebuilt_error) = *std::max_element(errors->begin(), errors->end());
  }
  std::printf("[ exact    ] rank 8, every chunk attended, against the full cache over 3 steps: "
              "worst logit relative error %.2e with exact keys, %.2e rebuilt\n",
              exact_error, rebuilt_error);
  EXPECT_LT(exact_error, 1e-2);
  EXPECT_GT(rebuilt_error, 5 * exact_error) << "rank 8 rebuilt the keys about as well";

  for (const bool fp8 : {false, true}) {
    kv::KvPolicyConfig config = ParityConfig(fp8);
    config.exact_keys = 1;
    config.fp8_keys = fp8 ? 1 : 0;
    config.label = fp8 ? "shadowkv:exact_keys=1:fp8_keys=1:fp8_values=1:fp8_landmarks=1"
                       : "shadowkv:exact_keys=1";
    CheckParity(config, config, /*copies=*/true, /*want_ranks=*/24);
  }
  // The re-rank scores its candidates from the stored keys (bf16, and FP8 decoded). FP8 codes
  // are made from the CPU's fp32 keys and the GPU's bf16 ones, so an element near a rounding
  // boundary takes the next code on one side; the re-rank reads every candidate's codes (the
  // landmark selection reads only the attended chunks'), near-ties part more often, and fewer
  // pairs keep the same chunks (19 of 48 at 5f483cc against 36 with bf16 keys).
  for (const bool fp8 : {false, true}) {
    kv::KvPolicyConfig rerank = ParityConfig(false);
    rerank.exact_keys = 1;
    rerank.fp8_keys = fp8 ? 1 : 0;
    rerank.selection = "rerank";
    rerank.label = fp8 ? "shadowkv:exact_keys=1:fp8_keys=1:select=rerank"
                       : "shadowkv:exact_keys=1:select=rerank";
    ParityBounds bounds;
    if (fp8) bounds.min_compared = 12;
    CheckParity(rerank, rerank, /*copies=*/true, /*want_ranks=*/24, SmallLlamaSpec(7), bounds);
  }
}

// CheckParity with the same settings on both sides where the CPU policy takes them (a mode the
// CPU side builds separately); says so where it does not yet.
void CheckParityWhereTheCpuRuns(const kv::KvPolicyConfig& config, int want_ranks) {
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
// `stats` (optional): the run's counters at its end.
std::vector<float> DecodeOnGpu(const kv::KvPolicyConfig& config,
                               std::vector<std::vector<int32_t>>* gathered,
                               CudaShadowKvStats* stats = nullptr) {
  TinyModelSpec spec = SmallLlamaSpec(7);
  const std::string path = WriteTinyModel(spec, "gpu_shadowkv_rerank");
  auto gpu_or = CudaModel::Load(path, tp_testing::SmallOptions());
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

// Re-ranking through the whole step (graph replay, the selection in halves, host values,
// graduations). With rerank_factor 1 the candidates are the landmarks' K and all are kept, so
// the step must equal the landmark selection bit for bit; with 4 it decodes on its own choice.
// Where the CPU policy re-ranks too, the parity with it as for the landmarks.
TEST(CudaShadowKvParityTest, RerankRunsThroughTheDecodeStep) {
  SKV_SKIP_WITHOUT_GPU();
  const kv::KvPolicyConfig landmarks = ParityConfig(false);
  kv::KvPolicyConfig rerank = landmarks;
  rerank.selection = "rerank";
  rerank.rerank_factor = 1;
  rerank.label = "shadowkv:select=rerank:rerank_factor=1";
  std::vector<std::vector<int32_t>> landmark_chunks, rerank_chunks, wide_chunks;
  const std::vector<float> want = DecodeOnGpu(landmarks, &landmark_chunks);
  const std::vector<float> got = DecodeOnGpu(rerank, &rerank_chunks);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(got, want) << "rerank_factor 1 keeps the landmarks' choice";
  EXPECT_EQ(rerank_chunks, landmark_chunks);
  rerank.rerank_factor = 4;
  rerank.label = "shadowkv:select=rerank";
  const std::vector<float> wide = DecodeOnGpu(rerank, &wide_chunks);
  ASSERT_EQ(wide.size(), want.size());
  int64_t same = 0, total = 0;
  for (size_t i = 0; i < wide_chunks.size() && i < landmark_chunks.size(); ++i) {
    std::set<int32_t> a(wide_chunks[i].begin(), wide_chunks[i].end());
    for (int32_t c : landmark_chunks[i]) same += a.count(c);
    total += static_cast<int64_t>(landmark_chunks[i].size());
  }
  std::printf("[ rerank   ] rerank_factor 4: %lld of %lld gathered chunks also the landmarks'\n",
              static_cast<long long>(same), static_cast<long long>(total));
  EXPECT_LT(same, total) << "re-ranking 4K candidates never changed a choice";

  CheckParityWhereTheCpuRuns(rerank, /*want_ranks=*/24);
  // Candidates scored with the first 8 of the 24 components, kept chunks attended at 24.
  rerank.rerank_rank = 8;
  rerank.label = "shadowkv:select=rerank:rerank_rank=8";
  CheckParityWhereTheCpuRuns(rerank, /*want_ranks=*/24);
}

// Per-query-head selection through the whole step: copies equal to their originals, K chunks
// per head at every step, a choice of its own; where the CPU policy selects per head too, the
// parity with it as for the landmarks.
TEST(CudaShadowKvParityTest, PerQueryHeadSelectionRunsThroughTheDecodeStep) {
  SKV_SKIP_WITHOUT_GPU();
  kv::KvPolicyConfig heads = ParityConfig(false);
  heads.selection = "heads";
  heads.label = "shadowkv:select=heads";
  std::vector<std::vector<int32_t>> landmark_chunks, head_chunks;
  const std::vector<float> landmarks = DecodeOnGpu(ParityConfig(false), &landmark_chunks);
  const std::vector<float> got = DecodeOnGpu(heads, &head_chunks);
  ASSERT_EQ(got.size(), landmarks.size());
  ASSERT_FALSE(got.empty());
  EXPECT_NE(head_chunks, landmark_chunks) << "per-head selection never changed a choice";

  CheckParityWhereTheCpuRuns(heads, /*want_ranks=*/24);
}

// select_interval 3 through the whole step (graph replay, the selection in halves, host
// values), for each selection mode: at the steps between selections every gather slot keeps its
// chunk (no selection, fetch or rebuild for the row), and the CPU policy at the same interval
// agrees as at interval 1.
TEST(CudaShadowKvParityTest, SelectIntervalReusesTheGatheredChunks) {
  SKV_SKIP_WITHOUT_GPU();
  const TinyModelSpec spec = SmallLlamaSpec(7);
  for (const char* mode : {"landmarks", "rerank", "heads"}) {
    kv::KvPolicyConfig config = ParityConfig(false);
    config.selection = mode;
    config.select_interval = 3;
    config.label = std::string("shadowkv:select=") + mode + ":interval=3";
    SCOPED_TRACE(config.label);
    std::vector<std::vector<int32_t>> gathered;
    ASSERT_FALSE(DecodeOnGpu(config, &gathered).empty());
    const size_t per_step = 2u * spec.layers * spec.kv_heads;
    ASSERT_EQ(gathered.size(), 24 * per_step);
    int changed = 0;
    for (int step = 1; step < 24; ++step) {
      for (size_t i = 0; i < per_step; ++i) {
        const auto& now = gathered[step * per_step + i];
        const auto& before = gathered[(step - 1) * per_step + i];
        if (step % 3 != 0) {
          ASSERT_EQ(now, before) << "step " << step << ", entry " << i;
        } else {
          changed += now != before;
        }
      }
    }
    EXPECT_GT(changed, 0) << "no selecting step changed a slot";
    CheckParityWhereTheCpuRuns(config, /*want_ranks=*/24);
  }
}

// select_drift through the whole step (graph replay, the selection in halves, host values), for
// the landmark and re-rank selections. At drift 1 no step's queries are parallel to the last
// selection's, so every KV head selects at every step and the decode equals interval 1's bit
// for bit. At lower thresholds a head selects at least every select_interval (6) steps and
// sooner where its queries turn: fewer selections the lower the threshold, some of them between
// the interval's steps and some heads keeping their chunks; each (row, layer, KV head) step is
// counted. Where selections are mixed, the CPU policy at the same settings agrees as at interval
// 1 (it decides from fp32 queries, the GPU from bf16 ones).
TEST(CudaShadowKvParityTest, SelectDriftSelectsWhereTheQueriesTurn) {
  SKV_SKIP_WITHOUT_GPU();
  const TinyModelSpec spec = SmallLlamaSpec(7);
  const int64_t head_steps = int64_t{24} * 4 * spec.layers * spec.kv_heads;
  const int64_t periodic = int64_t{4} * 4 * spec.layers * spec.kv_heads;  // steps 0, 6, 12, 18
  for (const char* mode : {"landmarks", "rerank"}) {
    kv::KvPolicyConfig every = ParityConfig(false);
    every.selection = mode;
    SCOPED_TRACE(mode);
    std::vector<std::vector<int32_t>> every_chunks, always_chunks;
    const std::vector<float> want = DecodeOnGpu(every, &every_chunks);
    kv::KvPolicyConfig always = every;
    always.select_interval = 6;
    always.select_drift = 1.0;
    CudaShadowKvStats stats;
    const std::vector<float> got = DecodeOnGpu(always, &always_chunks, &stats);
    ASSERT_FALSE(want.empty());
    EXPECT_TRUE(got == want) << "drift 1 did not decode as every-step selection";
    EXPECT_EQ(always_chunks, every_chunks);
    EXPECT_EQ(stats.head_steps, head_steps);
    EXPECT_EQ(stats.head_selections, head_steps);

    std::vector<int64_t> selections;
    std::optional<kv::KvPolicyConfig> mixed;
    for (const char* drift : {"0.9", "0.6", "0.3", "0.1"}) {
      kv::KvPolicyConfig config = always;
      config.select_drift = std::stod(drift);
      config.label = std::string("shadowkv:select=") + mode + ":interval=6:drift=" + drift;
      std::vector<std::vector<int32_t>> chunks;
      ASSERT_FALSE(DecodeOnGpu(config, &chunks, &stats).empty());
      std::printf("[ drift    ] %s: %lld of %lld head steps selected\n", config.label.c_str(),
                  static_cast<long long>(stats.head_selections),
                  static_cast<long long>(stats.head_steps));
      EXPECT_EQ(stats.head_steps, head_steps);
      EXPECT_GE(stats.head_selections, periodic);
      selections.push_back(stats.head_selections);
      if (!mixed && stats.head_selections > periodic && stats.head_selections < head_steps) {
        mixed = config;
      }
    }
    // Decisions depend on the path (a selection moves the reference), so only the ends compare.
    EXPECT_LT(selections.back(), selections.front()) << "drift 0.1 selected as often as 0.9";
    ASSERT_TRUE(mixed.has_value()) << "no threshold mixed kept and turned heads";
    CheckParityWhereTheCpuRuns(*mixed, /*want_ranks=*/24);
  }
}

// Each layer's rank from its own key spectrum: the GPU's choice (its fp32 Gram, solved on the
// host) against SkvRankForEnergy applied to the CPU policy's spectrum of the same prompt (fp64,
// every eigenvalue: the CPU keeps the full rank here). A choice may differ only where the share
// held at the multiple of 8 that decides lies within 2e-3 of the target: the GPU's forward pass
// rounds the keys to bf16, which moves the spectrum by about that much. Then, where the CPU policy
// runs per-layer ranks too, the decode parity.
TEST(CudaShadowKvRankTest, EachLayerTakesTheRankItsKeySpectrumAsks) {
  SKV_SKIP_WITHOUT_GPU();
  TinyModelSpec spec = SmallLlamaSpec(7);
  const std::string path = WriteTinyModel(spec, "gpu_shadowkv_rank");
  auto cpu = CpuModel::Load(path, 2, Numerics::kExact);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  CudaModelOptions options;
  options.max_batch = 2;
  options.max_step_tokens = 512;
  auto gpu_or = CudaModel::Load(path, options);
  ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
  CudaModel& gpu = **gpu_or;
  const int width = spec.kv_heads * 64;
  const std::vector<int32_t> prompt = SomeTokens(300, 31);

  // The CPU's full spectrum of every layer.
  kv::KvPolicyConfig full_rank = ParityConfig(false);
  full_rank.rank = width;
  auto policy = kv::MakeKvPolicy(full_rank, (*cpu)->kv_geometry());
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  auto sequence = policy->get()->NewSequence();
  ASSERT_TRUE(sequence.ok());
  StepInput in;
  in.kv = sequence->get();
  in.tokens = prompt;
  in.finish_prefill = true;
  in.logits = StepInput::Logits::kNone;  // only the spectra are wanted
  ASSERT_TRUE((*cpu)->Forward(std::span<const StepInput>(&in, 1)).ok());
  auto* shadow = dynamic_cast<kv::ShadowKvSequence*>(sequence->get());
  ASSERT_NE(shadow, nullptr);
  std::vector<kv::ShadowKvLayerInfo> spectra;
  for (int layer = 0; layer < spec.layers; ++layer) spectra.push_back(shadow->Inspect(layer));

  ASSERT_TRUE(gpu.AllocateKvCache(1, 512, true).ok());
  CudaStepInput gpu_in;
  gpu_in.slot = 0;
  gpu_in.tokens = prompt;
  ASSERT_TRUE(gpu.Forward(std::span<const CudaStepInput>(&gpu_in, 1)).ok());
  std::set<int32_t> seen;
  for (const double energy : {0.5, 0.9, 0.99}) {
    kv::KvPolicyConfig config = ParityConfig(false);
    config.rank_energy = energy;
    config.rank_min = 16;
    config.rank_head_ratio = 0.0;  // the floor the host rule below is given
    config.rank_max = 96;
    ASSERT_TRUE(gpu.AllocateShadowKv(config, 1, 512).ok());
    EXPECT_EQ(gpu.shadowkv_stats().rank, 96);  // the layout's: the cap
    ASSERT_TRUE(gpu.AllocateShadowKvValues(0, false).ok());
    const Status compressed = gpu.CompressToShadowKv(0, 0);
    ASSERT_TRUE(compressed.ok()) << compressed.ToString();
    auto ranks = gpu.ShadowKvLayerRanks(0);
    ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
    for (int layer = 0; layer < spec.layers; ++layer) {
      const kv::ShadowKvLayerInfo& info = spectra[layer];
      const int want = SkvRankForEnergy(info.eigenvalues, info.total_energy, energy, 16, 96);
      const int got = (*ranks)[layer];
      seen.insert(got);
      auto share_at = [&](int rank) {
        double held = 0.0;
        for (int i = 0; i < rank && i < static_cast<int>(info.eigenvalues.size()); ++i) {
          held += info.eigenvalues[i];
        }
        return held / info.total_energy;
      };
      if (got != want) {
        const int boundary = std::min(got, want);
        EXPECT_NEAR(share_at(boundary), energy, 2e-3)
            << "layer " << layer << " at energy " << energy << ": GPU rank " << got
            << ", host rule on the CPU spectrum " << want << " (share held at " << boundary << ": "
            << share_at(boundary) << ", at " << boundary + 8 << ": " << share_at(boundary + 8)
            << ")";
      }
      EXPECT_GE(got, 16);
      EXPECT_LE(got, 96);
      EXPECT_EQ(got % 8, 0);
      std::printf(
          "[ rank     ] energy %.2f layer %d: GPU rank %d, host rule %d (share held %.4f)\n",
          energy, layer, got, want, share_at(got));
    }
    // A few decode steps at these ranks, one graduation among them: finite logits.
    const int vocab = static_cast<int>(gpu.config().vocab_size);
    std::vector<int32_t> token = {prompt.back()};
    const std::vector<int> seqs = {0};
    for (int step = 0; step < 6; ++step) {
      std::vector<float> logits(vocab);
      const Status status = gpu.ShadowKvDecodeStep(seqs, token, CudaSampling{}, logits.data());
      ASSERT_TRUE(status.ok()) << status.ToString();
      ASSERT_TRUE(
          std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }))
          << "energy " << energy << ", step " << step;
    }
  }
  EXPECT_GE(seen.size(), 2u) << "the energies should ask for different ranks";

  kv::KvPolicyConfig config = ParityConfig(false);
  config.rank_energy = 0.9;
  config.label = "shadowkv:rank_energy=0.9";
  gpu.FreeKvCache();
  gpu.FreeShadowKv();
  gpu_or->reset();
  CheckParityWhereTheCpuRuns(config, /*want_ranks=*/0);
}

}  // namespace
}  // namespace shadowkv::cuda
