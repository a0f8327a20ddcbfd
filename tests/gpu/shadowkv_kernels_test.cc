// ShadowKV kernels (both variants) against the CPU policy's own functions on identical bf16
// inputs: landmark scoring + top-k (ScoreLandmarks, SelectTopK) and the gather-slot reuse
// (GatherSlots) over two steps, for two sequences with different chunk counts and outliers in
// one launch; the key rebuild against RebuildColumns + Rope::Apply at positions past 1e5, also
// at per-layer ranks below the layout's; the compression's outlier pick against PickOutlierChunks.
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <set>

#include "core/fp8.h"
#include "core/rope.h"
#include "gpu_test_util.h"
#include "kv/chunk_selection.h"
#include "kv/low_rank.h"
#include "shadowkv_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

class CudaShadowKvKernelsTest : public ::testing::TestWithParam<int> {};

// Capacity 2000 chunks (a multiple of 16) takes the fast tensor-core scoring and the 512-thread
// select; 9000 the other fast scoring kernel and the 1024-thread select. FP8 landmarks (tensor
// cores only): the device holds each landmark's codes and scale (core/fp8.h) and the CPU scores
// the values they stand for. `tied`: every landmark but each 256th is zero, so thousands of
// equal scores sit at the K-th place (ties go to the lower chunk); at 9000 chunks more of them
// share the coarse select's first digit than it gathers, so it takes its all-keys path.
// `select`: the fast select's variant (SkvDecodeParams::coarse_select, select_registers).
struct SelectVariant {
  int coarse = 1;
  int registers = 0;
};

// The per-query-head selection's reference (selection "heads"): each query head's own landmark
// softmax (ScoreLandmarks over a group of one), its chunks in descending score order (ties: the
// lower index), taken round-robin over the heads, skipping those taken, until k; the items in
// increasing order.
std::vector<int32_t> SelectByHeads(const float* queries, int group, int head_dim,
                                   const std::vector<float>& list, int64_t count, int64_t k) {
  std::vector<std::vector<int32_t>> order(group);
  for (int g = 0; g < group; ++g) {
    std::vector<float> scores(count);
    kv::ScoreScratch scratch;
    kv::ScoreLandmarks(queries + g * head_dim, 1, group * head_dim, 1, list.data(), count, head_dim,
                       &scratch, scores.data());
    order[g].resize(count);
    std::iota(order[g].begin(), order[g].end(), 0);
    std::stable_sort(order[g].begin(), order[g].end(),
                     [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  }
  std::vector<uint8_t> taken(count, 0);
  std::vector<size_t> next(group, 0);
  int64_t chosen = 0;
  while (chosen < std::min(k, count)) {
    for (int g = 0; g < group && chosen < std::min(k, count); ++g) {
      while (taken[order[g][next[g]]]) ++next[g];
      taken[order[g][next[g]++]] = 1;
      ++chosen;
    }
  }
  std::vector<int32_t> selected;
  for (int64_t i = 0; i < count; ++i) {
    if (taken[i]) selected.push_back(static_cast<int32_t>(i));
  }
  return selected;
}

// `heads`: the per-query-head selection (SkvDecodeParams::select_heads) against SelectByHeads.
void CheckSelection(int kernel_variant, const int kCapacity, bool successors, bool fp8 = false,
                    bool tied = false, SelectVariant select = {}, bool heads = false) {
  constexpr int kHeads = 2, kGroup = 4, kDim = 128, kBudget = 64, kSeqs = 2;
  const int num_chunks[kSeqs] = {tied ? kCapacity - 100 : 1900, tied ? kCapacity / 2 : 1234};
  std::mt19937 rng(5);
  std::vector<float> landmarks = RandomBf16Values(int64_t{kSeqs} * kHeads * kCapacity * kDim, rng);
  if (tied) {
    for (int64_t c = 0; c < int64_t{kSeqs} * kHeads * kCapacity; ++c) {
      if (c % 256 != 0) std::fill_n(landmarks.begin() + c * kDim, kDim, 0.0f);
    }
  }
  std::vector<uint8_t> landmark_codes;
  std::vector<float> landmark_scales;
  if (fp8) {
    const int64_t count = int64_t{kSeqs} * kHeads * kCapacity;
    landmark_codes.resize(count * kDim);
    landmark_scales.resize(count);
    for (int64_t i = 0; i < count; ++i) {
      landmark_scales[i] =
          QuantizeFp8Run(landmarks.data() + i * kDim, kDim, landmark_codes.data() + i * kDim);
      DequantizeFp8Run(landmark_codes.data() + i * kDim, kDim, landmark_scales[i],
                       landmarks.data() + i * kDim);
    }
  }
  std::vector<uint8_t> outlier(kSeqs * kHeads * kCapacity, 0);
  for (int s = 0; s < kSeqs; ++s) {
    for (int h = 0; h < kHeads; ++h) {
      for (int i = 0; i < 12; ++i)
        outlier[(s * kHeads + h) * kCapacity + (i * 97 + h * 13) % num_chunks[s]] = 1;
    }
  }
  auto d_landmarks = ToDevice(ToBf16(landmarks));
  auto d_codes = ToDevice(landmark_codes);
  auto d_scales = ToDevice(landmark_scales);
  auto d_outlier = ToDevice(outlier);
  auto d_slots = ToDevice(std::vector<int32_t>(kSeqs * kHeads * kBudget, -1));
  std::vector<SkvSequenceInfo> info(kSeqs, SkvSequenceInfo{12, kBudget, 0, 0});
  auto d_info = ToDevice(info);
  auto d_counters = ToDevice(std::vector<unsigned long long>(kSkvCounters * kSeqs, 0));
  auto d_logits = Poisoned<float>(int64_t{kSeqs} * kHeads * kGroup * kCapacity);
  auto d_partials =
      Poisoned<float>(int64_t{kSeqs} * kHeads * kGroup * SkvScoreBlocks(kCapacity) * 2);
  auto d_miss = Poisoned<int32_t>(kSeqs * kHeads * kBudget);
  std::vector<SkvRowMeta> meta(kSeqs);
  for (int s = 0; s < kSeqs; ++s) {
    meta[s].seq = kSeqs - 1 - s;  // rows in the other order than sequences
    meta[s].num_chunks = num_chunks[kSeqs - 1 - s];
  }
  auto d_meta = ToDevice(meta);

  SkvLayout l;
  l.num_layers = 1;
  l.num_kv_heads = kHeads;
  l.head_dim = kDim;
  l.group = kGroup;
  l.chunk_size = 8;
  l.rank = 16;
  l.capacity_chunks = kCapacity;
  l.max_budget = kBudget;
  l.recent_capacity = 40;
  if (fp8) {
    l.fp8_landmarks = 1;
    l.landmark_codes = d_codes.get();
    l.landmark_scales = d_scales.get();
  } else {
    l.landmarks = reinterpret_cast<__nv_bfloat16*>(d_landmarks.get());
  }
  l.outlier = d_outlier.get();
  l.slot_chunk = d_slots.get();
  l.info = d_info.get();
  l.counters = d_counters.get();
  SKV_ASSERT_CUDA(SkvConfigureKernels(l));

  // The CPU side of each (sequence, head): landmark list without outliers, its slots.
  std::vector<kv::GatherSlots> cpu_slots(kSeqs * kHeads);
  std::vector<float> queries = RandomBf16Values(int64_t{kSeqs} * kHeads * kGroup * kDim, rng);
  int64_t expected_hits = 0;
  std::vector<int64_t> expected_hits_of(kSeqs, 0);
  for (int step = 0; step < 2; ++step) {
    if (step == 1) PerturbQueries(&queries, rng);
    auto d_queries = ToDevice(ToBf16(queries));
    SkvDecodeParams p;
    p.layout = l;
    p.meta = d_meta.get();
    p.rows = kSeqs;
    p.queries = reinterpret_cast<const __nv_bfloat16*>(d_queries.get());
    p.logits = d_logits.get();
    p.softmax_partials = d_partials.get();
    p.miss_chunk = d_miss.get();
    p.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    p.kernel_variant = kernel_variant;
    p.select_successors = successors ? 1 : 0;
    p.coarse_select = select.coarse;
    p.select_registers = select.registers;
    p.select_heads = heads ? 1 : 0;
    if (heads) SKV_ASSERT_CUDA(SkvConfigureSelectHeads(l));
    SKV_ASSERT_CUDA(LaunchSkvScore(p, nullptr));
    SKV_ASSERT_CUDA(LaunchSkvSelect(p, nullptr));
    SKV_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<int32_t> slots(kSeqs * kHeads * kBudget), miss(kSeqs * kHeads * kBudget);
    SKV_ASSERT_CUDA(
        cudaMemcpy(slots.data(), d_slots.get(), slots.size() * 4, cudaMemcpyDeviceToHost));
    SKV_ASSERT_CUDA(cudaMemcpy(miss.data(), d_miss.get(), miss.size() * 4, cudaMemcpyDeviceToHost));

    for (int row = 0; row < kSeqs; ++row) {
      const int s = meta[row].seq, n = num_chunks[s];
      for (int h = 0; h < kHeads; ++h) {
        const SelectableLandmarks selectable =
            LandmarksOf(landmarks, outlier, s, h, kHeads, kCapacity, n, kDim);
        const std::vector<int32_t>& chunk_of = selectable.chunk_of;
        const std::vector<float>& list = selectable.list;
        const int64_t count = selectable.count();
        std::vector<float> scores(count);
        kv::ScoreScratch scratch;
        kv::ScoreLandmarks(queries.data() + (int64_t{row} * kHeads + h) * kGroup * kDim, 1,
                           kHeads * kGroup * kDim, kGroup, list.data(), count, kDim, &scratch,
                           scores.data());
        std::vector<float> top_values;
        std::vector<int32_t> selected;
        if (heads) {
          selected = SelectByHeads(queries.data() + (int64_t{row} * kHeads + h) * kGroup * kDim,
                                   kGroup, kDim, list, count, kBudget);
        } else if (successors) {
          std::vector<float> shifted;
          kv::SelectTopKWithSuccessors(scores, chunk_of, kBudget, &shifted, &top_values, &selected);
        } else {
          kv::SelectTopK(scores, kBudget, &top_values, &selected);
        }
        kv::GatherSlots& gather = cpu_slots[s * kHeads + h];
        if (step == 0) gather.Resize(kBudget, count);
        std::vector<kv::GatherSlots::Fill> fills;
        const int64_t hits = gather.Assign(selected, &fills);
        expected_hits += hits;
        expected_hits_of[s] += hits;
        const int32_t* got = slots.data() + (s * kHeads + h) * kBudget;
        const int32_t* got_miss = miss.data() + (row * kHeads + h) * kBudget;
        std::vector<int32_t> want_miss(kBudget, -1);
        for (const auto& fill : fills) want_miss[fill.slot] = chunk_of[fill.item];
        for (int slot = 0; slot < kBudget; ++slot) {
          const int32_t item = gather.item_in_slot(slot);
          EXPECT_EQ(got[slot], item < 0 ? -1 : chunk_of[item])
              << "step " << step << " seq " << s << " head " << h << " slot " << slot;
          EXPECT_EQ(got_miss[slot], want_miss[slot]) << "step " << step << " slot " << slot;
        }
      }
    }
  }
  // Per sequence: two steps of every head's budget, and the hits the CPU's slots found.
  std::vector<unsigned long long> counters(kSkvCounters * kSeqs);
  SKV_ASSERT_CUDA(cudaMemcpy(counters.data(), d_counters.get(),
                             sizeof(unsigned long long) * counters.size(), cudaMemcpyDeviceToHost));
  for (int s = 0; s < kSeqs; ++s) {
    EXPECT_EQ(counters[kSkvCounters * s], 2ull * kHeads * kBudget) << "sequence " << s;
    EXPECT_EQ(static_cast<int64_t>(counters[kSkvCounters * s + 1]), expected_hits_of[s])
        << "sequence " << s;
  }
  EXPECT_GT(expected_hits, 0);  // the second step reuses chunks
}

// The fast select's variants: coarse (64 registers, the default, and 32) and four 8-bit digits;
// the first kernels have one.
std::vector<SelectVariant> SelectVariants(int kernel_variant) {
  if (kernel_variant != kSkvKernelsFast) return {SelectVariant{}};
  return {SelectVariant{1, 0}, SelectVariant{1, 32}, SelectVariant{0, 0}};
}

// CheckSelection at 2000 and 9000 chunks with every select variant of the kernels.
void CheckSelectionEverywhere(int kernel_variant, bool successors, bool tied) {
  for (const SelectVariant select : SelectVariants(kernel_variant)) {
    for (const int capacity : {2000, 9000}) {
      SCOPED_TRACE(::testing::Message() << "capacity " << capacity << " chunks, coarse "
                                        << select.coarse << ", registers " << select.registers);
      CheckSelection(kernel_variant, capacity, successors, /*fp8=*/false, tied, select);
    }
  }
}

TEST_P(CudaShadowKvKernelsTest, SelectionMatchesCpuScoringTopKAndSlots) {
  SKV_SKIP_WITHOUT_GPU();
  CheckSelectionEverywhere(GetParam(), /*successors=*/false, /*tied=*/false);
}

TEST_P(CudaShadowKvKernelsTest, TiedScoresGoToTheLowerChunkAsOnTheCpu) {
  SKV_SKIP_WITHOUT_GPU();
  CheckSelectionEverywhere(GetParam(), /*successors=*/false, /*tied=*/true);
}

TEST_P(CudaShadowKvKernelsTest, Fp8LandmarkSelectionMatchesCpu) {
  SKV_SKIP_WITHOUT_GPU();
  if (GetParam() != kSkvKernelsFast) GTEST_SKIP() << "FP8 landmarks: fast kernels only";
  CheckSelection(GetParam(), 2000, /*successors=*/false, /*fp8=*/true);
}

// Per-query-head selection, either kernel variant (the select is one kernel for both; the
// scoring differs), with and without thousands of tied scores at the K-th place.
TEST_P(CudaShadowKvKernelsTest, PerQueryHeadSelectionMatchesTheRoundRobinReference) {
  SKV_SKIP_WITHOUT_GPU();
  for (const bool tied : {false, true}) {
    for (const int capacity : {2000, 9000}) {
      SCOPED_TRACE(::testing::Message() << "capacity " << capacity << " chunks, tied " << tied);
      CheckSelection(GetParam(), capacity, /*successors=*/false, /*fp8=*/false, tied, {},
                     /*heads=*/true);
    }
  }
}

TEST_P(CudaShadowKvKernelsTest, SuccessorSelectionMatchesCpu) {
  SKV_SKIP_WITHOUT_GPU();
  if (GetParam() != kSkvKernelsFast) GTEST_SKIP() << "successor selection: fast kernels only";
  CheckSelectionEverywhere(GetParam(), /*successors=*/true, /*tied=*/false);
}

// Keys of the missed chunks = rows of A times B_h, rotated at the chunk's own positions; slots
// without a miss keep whatever they held. Rank 40 (not a multiple of 16) pads the mma's k.
// `slots`: gather slots per block of the fast kernels (SkvDecodeParams::rebuild_slots; 96 slots
// leave the last block of 64 part-empty). `own_ranks`: each sequence's rank below the layout's
// `rank` (SkvLayout::layer_rank; 0 = none): A's and B's entries past it hold random values
// here, so a kernel that read past its sequence's rank would rebuild other keys.
void CheckRebuild(int variant, RopeConfig::Style style, int head_dim, int rank, int slots = 0,
                  std::array<int, 2> own_ranks = {0, 0}) {
  constexpr int kHeads = 2, kChunk = 8, kCapacity = 15800, kBudget = 96, kSeqs = 2;
  const int width = kHeads * head_dim;
  std::mt19937 rng(11 + head_dim + rank);
  const std::vector<float> coefficients =
      RandomBf16Values(int64_t{kSeqs} * kCapacity * kChunk * rank, rng, 0.5f);
  const std::vector<float> basis = RandomBf16Values(int64_t{kSeqs} * rank * width, rng, 0.2f);
  RopeConfig config;
  config.rotary_dim = head_dim;
  config.theta_base = 500000.0f;
  config.style = style;
  const Rope rope(config);
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / head_dim));
  }
  // Row r (sequence 1 - r) misses about half of its slots, chunks anywhere up to 126K tokens.
  std::vector<int32_t> miss(kSeqs * kHeads * kBudget, -1);
  std::uniform_int_distribution<int> chunk_dist(0, kCapacity - 1);
  for (int32_t& m : miss) m = rng() % 2 ? chunk_dist(rng) : -1;
  miss[0] = kCapacity - 1;
  const int gather_base = 3 * kChunk, attn_capacity = gather_base + kBudget * kChunk + 40;
  std::vector<SkvSequenceInfo> info(kSeqs, SkvSequenceInfo{3, kBudget, gather_base, 0});
  std::vector<SkvRowMeta> meta(kSeqs);
  for (int r = 0; r < kSeqs; ++r) meta[r].seq = kSeqs - 1 - r;

  auto d_coefficients = ToDevice(ToBf16(coefficients));
  auto d_basis = ToDevice(ToBf16(basis));
  auto d_freq = ToDevice(inv_freq);
  auto d_miss = ToDevice(miss);
  auto d_info = ToDevice(info);
  auto d_meta = ToDevice(meta);
  auto d_keys = Poisoned<uint16_t>(int64_t{kSeqs} * kHeads * attn_capacity * head_dim);
  const bool per_layer = own_ranks[0] > 0;
  std::vector<int32_t> layer_rank(kSeqs);
  for (int s = 0; s < kSeqs; ++s) layer_rank[s] = per_layer ? own_ranks[s] : rank;
  auto d_layer_rank = ToDevice(layer_rank);
  SkvLayout l;
  l.num_layers = 1;
  l.num_kv_heads = kHeads;
  l.head_dim = head_dim;
  l.group = 4;
  l.chunk_size = kChunk;
  l.rank = rank;
  l.capacity_chunks = kCapacity;
  l.max_budget = kBudget;
  l.recent_capacity = 40;
  l.attn.keys = reinterpret_cast<__nv_bfloat16*>(d_keys.get());
  l.attn.num_slots = kSeqs;
  l.attn.num_layers = 1;
  l.attn.num_kv_heads = kHeads;
  l.attn.head_dim = head_dim;
  l.attn.capacity = attn_capacity;
  l.coefficients = reinterpret_cast<__nv_bfloat16*>(d_coefficients.get());
  l.basis = reinterpret_cast<__nv_bfloat16*>(d_basis.get());
  if (per_layer) l.layer_rank = d_layer_rank.get();
  l.info = d_info.get();
  SKV_ASSERT_CUDA(SkvConfigureKernels(l));
  SkvDecodeParams p;
  p.layout = l;
  p.meta = d_meta.get();
  p.rows = kSeqs;
  p.miss_chunk = d_miss.get();
  p.inv_freq = d_freq.get();
  p.rotary_dim = head_dim;
  p.halves = style == RopeConfig::Style::kHalves;
  p.kernel_variant = variant;
  p.rebuild_slots = slots;
  SKV_ASSERT_CUDA(LaunchSkvRebuildKeys(p, nullptr));
  const std::vector<float> keys = ToHostBf16(d_keys);

  int64_t checked = 0;
  for (int r = 0; r < kSeqs; ++r) {
    const int s = meta[r].seq, own = layer_rank[s];
    kv::LowRankBasis cpu_basis;  // the sequence's first `own` rows of B
    cpu_basis.width = width;
    cpu_basis.rank = own;
    cpu_basis.basis.assign(basis.begin() + int64_t{s} * rank * width,
                           basis.begin() + (int64_t{s} * rank + own) * width);
    for (int h = 0; h < kHeads; ++h) {
      for (int slot = 0; slot < kBudget; ++slot) {
        const int chunk = miss[(r * kHeads + h) * kBudget + slot];
        const float* got_chunk = keys.data() + ((int64_t{s} * kHeads + h) * attn_capacity +
                                                gather_base + int64_t{slot} * kChunk) *
                                                   head_dim;
        if (chunk < 0) {  // untouched: still the poison
          EXPECT_TRUE(std::isnan(got_chunk[0])) << "slot " << slot << " was written";
          continue;
        }
        std::vector<float> want(int64_t{kChunk} * head_dim);
        std::vector<float> own_rows(int64_t{kChunk} * own);  // the first `own` of each A row
        for (int t = 0; t < kChunk; ++t) {
          std::copy_n(coefficients.data() + ((int64_t{s} * kCapacity + chunk) * kChunk + t) * rank,
                      own, own_rows.data() + int64_t{t} * own);
        }
        kv::RebuildColumns(cpu_basis, own_rows.data(), kChunk, h * head_dim, head_dim, want.data(),
                           head_dim);
        for (int t = 0; t < kChunk; ++t) {
          rope.Apply(want.data() + t * head_dim, 1, head_dim, int64_t{chunk} * kChunk + t);
        }
        const std::vector<float> got(got_chunk, got_chunk + kChunk * head_dim);
        ASSERT_LT(RelativeError(got, want), 6e-3)
            << "seq " << s << " head " << h << " slot " << slot << " chunk " << chunk
            << " (layout rank " << rank << ", the sequence's rank " << own << ")";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, kSeqs * kHeads * kBudget / 3);
}

// Gather slots per block of the fast rebuild kernels (0: the default); the first kernels have one.
std::vector<int> RebuildSlotVariants(int kernel_variant) {
  return kernel_variant == kSkvKernelsFast ? std::vector<int>{0, 64, 128} : std::vector<int>{0};
}

TEST_P(CudaShadowKvKernelsTest, RebuildMatchesCpuLowRankAndRopeHalves) {
  SKV_SKIP_WITHOUT_GPU();
  for (const int slots : RebuildSlotVariants(GetParam())) {
    SCOPED_TRACE(::testing::Message() << slots << " slots per block");
    CheckRebuild(GetParam(), RopeConfig::Style::kHalves, 128, 160, slots);
    CheckRebuild(GetParam(), RopeConfig::Style::kHalves, 128, 80, slots);
    CheckRebuild(GetParam(), RopeConfig::Style::kHalves, 64, 40, slots);
  }
}

TEST_P(CudaShadowKvKernelsTest, RebuildMatchesCpuLowRankAndRopePairs) {
  SKV_SKIP_WITHOUT_GPU();
  for (const int slots : RebuildSlotVariants(GetParam())) {
    SCOPED_TRACE(::testing::Message() << slots << " slots per block");
    CheckRebuild(GetParam(), RopeConfig::Style::kPairs, 128, 160, slots);
    CheckRebuild(GetParam(), RopeConfig::Style::kPairs, 128, 80, slots);
    CheckRebuild(GetParam(), RopeConfig::Style::kPairs, 64, 40, slots);
  }
}

// A per-layer rank below the layout's: the register-basis kernel (cap 160 or 80, head_dim 128,
// halves or pairs), the shared-basis fast kernel and the first kernel (cap 128; cap 40 at
// head_dim 64) each stop at the sequence's own rank, one sequence at the cap itself.
TEST_P(CudaShadowKvKernelsTest, RebuildStopsAtEachSequencesOwnRank) {
  SKV_SKIP_WITHOUT_GPU();
  for (const auto style : {RopeConfig::Style::kHalves, RopeConfig::Style::kPairs}) {
    SCOPED_TRACE(::testing::Message() << "halves " << (style == RopeConfig::Style::kHalves));
    CheckRebuild(GetParam(), style, 128, 160, 0, {40, 160});
    CheckRebuild(GetParam(), style, 128, 80, 0, {8, 72});
    CheckRebuild(GetParam(), style, 128, 128, 0, {96, 24});
    CheckRebuild(GetParam(), style, 64, 40, 0, {16, 40});
  }
}

// Graduation at per-layer ranks below the layout's, every layer in one launch: the graduating
// chunk's A rows are its pre-RoPE keys times Bᵀ over the (sequence, layer)'s own rank and exact
// zeros past it (B's rows there hold random values, and A's row a poison, so computing or
// skipping them would show), no other chunk's rows are touched, and each layer's exact rows move
// down one chunk.
// The compression's outlier pick on the GPU against kv::PickOutlierChunks: lowest min-cosine
// first, ties to the lower chunk, the picks in increasing index; values drawn from a few levels
// so that ties are common, and counts from one to every chunk.
TEST(CudaShadowKvOutlierTest, PickMatchesTheCpuRuleWithTies) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  for (const auto& [pairs, chunks, count] :
       std::vector<std::array<int, 3>>{{48, 2500, 12}, {4, 300, 1}, {6, 97, 97}, {2, 15000, 45}}) {
    std::uniform_int_distribution<int> level(0, 40);
    std::vector<float> values(static_cast<size_t>(pairs) * chunks);
    for (float& v : values) v = level(rng) / 40.0f - 0.25f;
    auto device_values = ToDevice(values);
    auto picked = Poisoned<int32_t>(static_cast<int64_t>(pairs) * count);
    SkvPickOutliersParams p;
    p.min_cosine = device_values.get();
    p.pairs = pairs;
    p.num_chunks = chunks;
    p.count = count;
    p.outliers = picked.get();
    SKV_ASSERT_CUDA(LaunchSkvPickOutliers(p, nullptr));
    const std::vector<int32_t> got = ToHost(picked);
    for (int pair = 0; pair < pairs; ++pair) {
      const std::vector<int32_t> want = kv::PickOutlierChunks(
          std::span<const float>(values.data() + static_cast<size_t>(pair) * chunks, chunks),
          count);
      const std::vector<int32_t> row(got.begin() + static_cast<size_t>(pair) * count,
                                     got.begin() + static_cast<size_t>(pair + 1) * count);
      ASSERT_EQ(row, want) << pairs << " x " << chunks << " chunks, " << count << " picked, pair "
                           << pair;
    }
  }
  SkvPickOutliersParams too_many;
  too_many.min_cosine = reinterpret_cast<const float*>(16);
  too_many.outliers = reinterpret_cast<int32_t*>(16);
  too_many.pairs = 1;
  too_many.num_chunks = 4;
  too_many.count = 5;
  EXPECT_EQ(LaunchSkvPickOutliers(too_many, nullptr), cudaErrorInvalidValue);
}

TEST(CudaShadowKvGraduationTest, ProjectsAtEachSequencesOwnRankAndZerosTheRest) {
  SKV_SKIP_WITHOUT_GPU();
  constexpr int kHeads = 2, kDim = 64, kChunk = 8, kWindow = 32, kCapacity = 16, kRank = 32;
  constexpr int kSeqs = 2, kLayers = 2, kGraduating = 5, kRecentBase = 24;
  constexpr int kAttnCapacity = kRecentBase + 40, kHeld = kWindow + kChunk - 1;
  const int own_rank[kSeqs][kLayers] = {{16, 32}, {32, 8}};  // [seq][layer]
  constexpr int kWidth = kHeads * kDim, kRecent = kWindow + kChunk;
  constexpr int64_t kSeqLayers = int64_t{kSeqs} * kLayers;
  std::mt19937 rng(23);
  const std::vector<float> pre = RandomBf16Values(kSeqLayers * kRecent * kWidth, rng);
  const std::vector<float> basis = RandomBf16Values(kSeqLayers * kRank * kWidth, rng, 0.2f);
  const std::vector<float> attn_keys =
      RandomBf16Values(kSeqLayers * kHeads * kAttnCapacity * kDim, rng);
  auto d_pre = ToDevice(ToBf16(pre));
  auto d_basis = ToDevice(ToBf16(basis));
  auto d_attn_keys = ToDevice(ToBf16(attn_keys));
  auto d_attn_values = ToDevice(ToBf16(attn_keys));
  auto d_coefficients = Poisoned<uint16_t>(kSeqLayers * kCapacity * kChunk * kRank);
  auto d_landmarks = Poisoned<uint16_t>(kSeqLayers * kHeads * kCapacity * kDim);
  auto d_outlier = ToDevice(std::vector<uint8_t>(kSeqLayers * kHeads * kCapacity, 1));
  std::vector<DeviceBuffer<uint16_t>> stores;
  std::vector<__nv_bfloat16*> store_pointers;
  for (int s = 0; s < kSeqs; ++s) {
    stores.push_back(Poisoned<uint16_t>(int64_t{kLayers} * kHeads * kCapacity * kChunk * kDim));
    store_pointers.push_back(reinterpret_cast<__nv_bfloat16*>(stores.back().get()));
  }
  auto d_stores = ToDevice(store_pointers);
  auto d_layer_rank = ToDevice(std::vector<int32_t>(&own_rank[0][0], &own_rank[0][0] + kSeqLayers));
  auto d_info =
      ToDevice(std::vector<SkvSequenceInfo>(kSeqs, SkvSequenceInfo{1, 2, 8, kRecentBase}));
  std::vector<SkvRowMeta> meta(kSeqs);
  for (int r = 0; r < kSeqs; ++r) {
    meta[r].seq = kSeqs - 1 - r;
    meta[r].held_rows = kHeld;  // the most a step holds before it graduates
    meta[r].graduate_chunk = kGraduating;
    meta[r].num_chunks = kGraduating + 1;
  }
  auto d_meta = ToDevice(meta);
  SkvLayout l;
  l.num_layers = kLayers;
  l.num_kv_heads = kHeads;
  l.head_dim = kDim;
  l.group = 2;
  l.chunk_size = kChunk;
  l.rank = kRank;
  l.capacity_chunks = kCapacity;
  l.max_budget = 2;
  l.recent_capacity = kRecent;
  l.attn.keys = reinterpret_cast<__nv_bfloat16*>(d_attn_keys.get());
  l.attn.values = reinterpret_cast<__nv_bfloat16*>(d_attn_values.get());
  l.attn.num_slots = kSeqs;
  l.attn.num_layers = kLayers;
  l.attn.num_kv_heads = kHeads;
  l.attn.head_dim = kDim;
  l.attn.capacity = kAttnCapacity;
  l.keys_pre = reinterpret_cast<__nv_bfloat16*>(d_pre.get());
  l.coefficients = reinterpret_cast<__nv_bfloat16*>(d_coefficients.get());
  l.basis = reinterpret_cast<__nv_bfloat16*>(d_basis.get());
  l.layer_rank = d_layer_rank.get();
  l.landmarks = reinterpret_cast<__nv_bfloat16*>(d_landmarks.get());
  l.outlier = d_outlier.get();
  l.values = d_stores.get();
  l.info = d_info.get();
  SKV_ASSERT_CUDA(SkvConfigureKernels(l));
  SkvDecodeParams p;
  p.layout = l;
  p.meta = d_meta.get();
  p.rows = kSeqs;
  p.layer = -1;  // not read: graduation covers every layer
  SKV_ASSERT_CUDA(LaunchSkvGraduate(p, nullptr));
  const std::vector<float> coefficients = ToHostBf16(d_coefficients);
  const std::vector<float> moved_keys = ToHostBf16(d_attn_keys);
  const std::vector<float> moved_pre = ToHostBf16(d_pre);
  const std::vector<float> landmarks = ToHostBf16(d_landmarks);
  for (int s = 0; s < kSeqs; ++s) {
    for (int layer = 0; layer < kLayers; ++layer) {
      SCOPED_TRACE(::testing::Message() << "sequence " << s << " layer " << layer);
      const int64_t sl = int64_t{s} * kLayers + layer;
      for (int chunk = 0; chunk < kCapacity; ++chunk) {
        for (int t = 0; t < kChunk; ++t) {
          const float* a = coefficients.data() + ((sl * kCapacity + chunk) * kChunk + t) * kRank;
          for (int j = 0; j < kRank; ++j) {
            if (chunk != kGraduating) {
              ASSERT_TRUE(std::isnan(a[j])) << "chunk " << chunk << " written";
              continue;
            }
            if (j >= own_rank[s][layer]) {
              ASSERT_EQ(a[j], 0.0f) << "token " << t << " coefficient " << j << " past its rank";
              continue;
            }
            double want = 0.0;
            for (int e = 0; e < kWidth; ++e) {
              want += double{pre[(sl * kRecent + t) * kWidth + e]} *
                      basis[(sl * kRank + j) * kWidth + e];
            }
            ASSERT_NEAR(a[j], want, 1e-2 * std::max(1.0, std::fabs(want)))
                << "token " << t << " coefficient " << j;
          }
        }
      }
      for (int h = 0; h < kHeads; ++h) {
        // The landmark is the mean of the chunk's post-RoPE keys (the first C exact rows).
        const int64_t head = (sl * kHeads + h) * kAttnCapacity + kRecentBase;
        for (int e = 0; e < kDim; ++e) {
          double mean = 0.0;
          for (int t = 0; t < kChunk; ++t) mean += attn_keys[(head + t) * kDim + e];
          mean /= kChunk;
          const float landmark =
              landmarks[((sl * kHeads + h) * kCapacity + kGraduating) * kDim + e];
          ASSERT_NEAR(landmark, mean, 1e-2 * std::max(1.0, std::fabs(mean))) << "dim " << e;
        }
        // Rows [C, held) moved to [0, held - C), in the attention keys and the pre-RoPE keys.
        for (int t = 0; t < kHeld - kChunk; ++t) {
          for (int e = 0; e < kDim; ++e) {
            ASSERT_EQ(moved_keys[(head + t) * kDim + e], attn_keys[(head + t + kChunk) * kDim + e])
                << "head " << h << " row " << t;
            const int64_t pre_at = (sl * kRecent + t) * kWidth + h * kDim + e;
            ASSERT_EQ(moved_pre[pre_at], pre[pre_at + int64_t{kChunk} * kWidth])
                << "head " << h << " pre-RoPE row " << t;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaShadowKvKernelsTest,
                         ::testing::Values(kSkvKernelsFirst, kSkvKernelsFast),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == kSkvKernelsFirst ? std::string("First")
                                                                 : std::string("Fast");
                         });

}  // namespace
}  // namespace shadowkv::cuda
