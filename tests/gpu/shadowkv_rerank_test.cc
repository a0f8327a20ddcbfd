// ShadowKV re-ranking kernels (selection "rerank", both kernel variants) against a CPU reference
// written out here: the landmark candidates (ScoreLandmarks, SelectTopK of rerank_factor · K),
// their keys rebuilt from A and B at each sequence's own rank with RoPE and rounded to bf16, the
// exact logits and each chunk's log-sum-exp of them per query head, the per-head softmax over all
// candidate tokens whose per-chunk mass (max over the GQA group) picks the K, and the gather
// slots those take (GatherSlots), over two steps.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "core/rope.h"
#include "gpu_test_util.h"
#include "kv/chunk_selection.h"
#include "kv/low_rank.h"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"
#include "shadowkv_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

class CudaShadowKvRerankTest : public ::testing::TestWithParam<int> {};

// The CPU side of one (row, KV head): the candidates' exact scores, in candidate order.
struct ExactReference {
  std::vector<float> logits;  // [group, candidates * C]
  std::vector<float> lse;     // [group, candidates]: log-sum-exp of each chunk's logits
  std::vector<float> scores;  // [candidates]
};

ExactReference ExactScores(const std::vector<int32_t>& chunks, const float* queries, int group,
                           int head_dim, int head, const kv::LowRankBasis& basis,
                           const float* coefficients, int layout_rank, int chunk_size,
                           const Rope& rope, float scale) {
  const int count = static_cast<int>(chunks.size()), tokens = count * chunk_size;
  const int own = basis.rank;
  ExactReference out;
  out.logits.assign(static_cast<size_t>(group) * tokens, 0.0f);
  std::vector<float> rows(static_cast<size_t>(chunk_size) * own);
  std::vector<float> keys(static_cast<size_t>(chunk_size) * head_dim);
  for (int i = 0; i < count; ++i) {
    for (int t = 0; t < chunk_size; ++t) {
      std::copy_n(coefficients + (int64_t{chunks[i]} * chunk_size + t) * layout_rank, own,
                  rows.data() + int64_t{t} * own);
    }
    kv::RebuildColumns(basis, rows.data(), chunk_size, head * head_dim, head_dim, keys.data(),
                       head_dim);
    for (int t = 0; t < chunk_size; ++t) {
      float* key = keys.data() + int64_t{t} * head_dim;
      rope.Apply(key, 1, head_dim, int64_t{chunks[i]} * chunk_size + t);
      for (int e = 0; e < head_dim; ++e) key[e] = Bf16ToFp32(Fp32ToBf16(key[e]));
      for (int g = 0; g < group; ++g) {
        double dot = 0.0;
        for (int e = 0; e < head_dim; ++e) dot += double{queries[g * head_dim + e]} * key[e];
        out.logits[static_cast<size_t>(g) * tokens + i * chunk_size + t] =
            static_cast<float>(dot * scale);
      }
    }
  }
  out.lse.assign(static_cast<size_t>(group) * count, 0.0f);
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < count; ++i) {
      const float* x = out.logits.data() + static_cast<size_t>(g) * tokens + i * chunk_size;
      const double top = *std::max_element(x, x + chunk_size);
      double sum = 0.0;
      for (int t = 0; t < chunk_size; ++t) sum += std::exp(x[t] - top);
      out.lse[static_cast<size_t>(g) * count + i] = static_cast<float>(top + std::log(sum));
    }
  }
  out.scores.assign(count, 0.0f);
  for (int g = 0; g < group; ++g) {
    const float* x = out.logits.data() + static_cast<size_t>(g) * tokens;
    const double top = *std::max_element(x, x + tokens);
    double sum = 0.0;
    for (int t = 0; t < tokens; ++t) sum += std::exp(x[t] - top);
    for (int i = 0; i < count; ++i) {
      double mass = 0.0;
      for (int t = 0; t < chunk_size; ++t) mass += std::exp(x[i * chunk_size + t] - top) / sum;
      out.scores[i] = std::max(out.scores[i], static_cast<float>(mass));
    }
  }
  return out;
}

// The shape of the one re-rank layer both tests drive.
struct RerankShape {
  int heads, group, head_dim, chunk, rank, capacity, budget, candidates;
};

// The layout's shape fields (one layer, a 40-row window); the caller points it at its buffers.
SkvLayout RerankLayout(const RerankShape& s) {
  SkvLayout l;
  l.num_layers = 1;
  l.num_kv_heads = s.heads;
  l.head_dim = s.head_dim;
  l.group = s.group;
  l.chunk_size = s.chunk;
  l.rank = s.rank;
  l.capacity_chunks = s.capacity;
  l.max_budget = s.budget;
  l.max_candidates = s.candidates;
  l.recent_capacity = 40;
  return l;
}

// A re-rank's decode parameters over `l`, full-width rotary; the caller adds its buffers.
SkvDecodeParams RerankParams(const SkvLayout& l, int kernel_variant, bool halves, int factor) {
  SkvDecodeParams p;
  p.layout = l;
  p.rotary_dim = l.head_dim;
  p.halves = halves;
  p.scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
  p.kernel_variant = kernel_variant;
  p.rerank_factor = factor;
  return p;
}

// RoPE's frequencies at base 10000, as the CPU's Rope forms them.
std::vector<float> InvFreq(int head_dim) {
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / head_dim));
  }
  return inv_freq;
}

void CheckRerank(int kernel_variant, int head_dim, RopeConfig::Style style) {
  constexpr int kHeads = 2, kGroup = 4, kChunk = 8, kCapacity = 2000, kBudget = 16, kFactor = 4;
  constexpr int kSeqs = 2, kRank = 40, kCandidates = kFactor * kBudget, kOutliers = 12;
  const int width = kHeads * head_dim;
  const int num_chunks[kSeqs] = {1900, 1234};
  const int own_rank[kSeqs] = {40, 24};
  std::mt19937 rng(17 + head_dim);
  const std::vector<float> landmarks =
      RandomBf16Values(int64_t{kSeqs} * kHeads * kCapacity * head_dim, rng);
  const std::vector<float> coefficients =
      RandomBf16Values(int64_t{kSeqs} * kCapacity * kChunk * kRank, rng, 0.5f);
  std::vector<float> basis = RandomBf16Values(int64_t{kSeqs} * kRank * width, rng, 0.2f);
  for (int s = 0; s < kSeqs; ++s) {  // the layout's zeros past a sequence's own rank
    std::fill(basis.begin() + (int64_t{s} * kRank + own_rank[s]) * width,
              basis.begin() + int64_t{s + 1} * kRank * width, 0.0f);
  }
  std::vector<uint8_t> outlier(kSeqs * kHeads * kCapacity, 0);
  for (int s = 0; s < kSeqs; ++s) {
    for (int h = 0; h < kHeads; ++h) {
      for (int i = 0; i < kOutliers; ++i) {
        outlier[(s * kHeads + h) * kCapacity + (i * 97 + h * 13) % num_chunks[s]] = 1;
      }
    }
  }
  RopeConfig rope_config;
  rope_config.rotary_dim = head_dim;
  rope_config.theta_base = 10000.0f;
  rope_config.style = style;
  const Rope rope(rope_config);

  auto d_landmarks = ToDevice(ToBf16(landmarks));
  auto d_coefficients = ToDevice(ToBf16(coefficients));
  auto d_basis = ToDevice(ToBf16(basis));
  auto d_layer_rank = ToDevice(std::vector<int32_t>(own_rank, own_rank + kSeqs));
  auto d_freq = ToDevice(InvFreq(head_dim));
  auto d_outlier = ToDevice(outlier);
  auto d_slots = ToDevice(std::vector<int32_t>(kSeqs * kHeads * kBudget, -1));
  std::vector<SkvSequenceInfo> info(kSeqs, SkvSequenceInfo{kOutliers, kBudget, kOutliers * kChunk,
                                                           (kOutliers + kBudget) * kChunk});
  auto d_info = ToDevice(info);
  auto d_counters = ToDevice(std::vector<unsigned long long>(kSkvCounters * kSeqs, 0));
  auto d_logits = Poisoned<float>(int64_t{kSeqs} * kHeads * kGroup * kCapacity);
  auto d_partials =
      Poisoned<float>(int64_t{kSeqs} * kHeads * kGroup * SkvScoreBlocks(kCapacity) * 2);
  auto d_miss = Poisoned<int32_t>(kSeqs * kHeads * kBudget);
  auto d_candidates = Poisoned<int32_t>(kSeqs * kHeads * kCandidates);
  auto d_lse = Poisoned<float>(int64_t{kSeqs} * kHeads * kGroup * kCandidates);
  std::vector<SkvRowMeta> meta(kSeqs);
  for (int r = 0; r < kSeqs; ++r) {
    meta[r].seq = kSeqs - 1 - r;  // rows in the other order than sequences
    meta[r].num_chunks = num_chunks[kSeqs - 1 - r];
  }
  auto d_meta = ToDevice(meta);

  SkvLayout l =
      RerankLayout({kHeads, kGroup, head_dim, kChunk, kRank, kCapacity, kBudget, kCandidates});
  l.landmarks = reinterpret_cast<__nv_bfloat16*>(d_landmarks.get());
  l.coefficients = reinterpret_cast<__nv_bfloat16*>(d_coefficients.get());
  l.basis = reinterpret_cast<__nv_bfloat16*>(d_basis.get());
  l.layer_rank = d_layer_rank.get();
  l.outlier = d_outlier.get();
  l.slot_chunk = d_slots.get();
  l.info = d_info.get();
  l.counters = d_counters.get();
  SKV_ASSERT_CUDA(SkvConfigureKernels(l));

  std::vector<kv::GatherSlots> cpu_slots(kSeqs * kHeads);
  std::vector<int64_t> expected_hits(kSeqs, 0);
  int near_ties = 0;
  std::vector<float> queries = RandomBf16Values(int64_t{kSeqs} * kHeads * kGroup * head_dim, rng);
  for (int step = 0; step < 2; ++step) {
    if (step == 1) PerturbQueries(&queries, rng);
    auto d_queries = ToDevice(ToBf16(queries));
    SkvDecodeParams p =
        RerankParams(l, kernel_variant, style == RopeConfig::Style::kHalves, kFactor);
    p.meta = d_meta.get();
    p.rows = kSeqs;
    p.queries = reinterpret_cast<const __nv_bfloat16*>(d_queries.get());
    p.logits = d_logits.get();
    p.softmax_partials = d_partials.get();
    p.miss_chunk = d_miss.get();
    p.inv_freq = d_freq.get();
    p.candidates = d_candidates.get();
    p.candidate_lse = d_lse.get();
    SKV_ASSERT_CUDA(LaunchSkvScore(p, nullptr));
    SKV_ASSERT_CUDA(LaunchSkvSelect(p, nullptr));
    SKV_ASSERT_CUDA(LaunchSkvRerank(p, nullptr));
    SKV_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<int32_t> slots = ToHost(d_slots), miss = ToHost(d_miss);
    const std::vector<int32_t> candidates = ToHost(d_candidates);
    const std::vector<float> lse = ToHost(d_lse);

    for (int row = 0; row < kSeqs; ++row) {
      const int s = meta[row].seq, n = num_chunks[s];
      kv::LowRankBasis own_basis;
      own_basis.width = width;
      own_basis.rank = own_rank[s];
      own_basis.basis.assign(basis.begin() + int64_t{s} * kRank * width,
                             basis.begin() + (int64_t{s} * kRank + own_rank[s]) * width);
      for (int h = 0; h < kHeads; ++h) {
        SCOPED_TRACE(::testing::Message()
                     << "step " << step << ", sequence " << s << ", head " << h);
        // Landmark candidates.
        const SelectableLandmarks selectable =
            LandmarksOf(landmarks, outlier, s, h, kHeads, kCapacity, n, head_dim);
        const std::vector<int32_t>& chunk_of = selectable.chunk_of;
        const std::vector<float>& list = selectable.list;
        const int64_t count = selectable.count();
        const float* q = queries.data() + (int64_t{row} * kHeads + h) * kGroup * head_dim;
        std::vector<float> landmark_scores(count), top_values;
        kv::ScoreScratch scratch;
        kv::ScoreLandmarks(q, 1, kHeads * kGroup * head_dim, kGroup, list.data(), count, head_dim,
                           &scratch, landmark_scores.data());
        std::vector<int32_t> picked;
        kv::SelectTopK(landmark_scores, kCandidates, &top_values, &picked);
        std::vector<int32_t> want_candidates;
        for (int32_t item : picked) want_candidates.push_back(chunk_of[item]);
        const int32_t* got_candidates = candidates.data() + (row * kHeads + h) * kCandidates;
        ASSERT_EQ(std::vector<int32_t>(got_candidates, got_candidates + kCandidates),
                  want_candidates)
            << "landmark candidates";

        // Exact scores and the K they keep.
        const ExactReference reference =
            ExactScores(want_candidates, q, kGroup, head_dim, h, own_basis,
                        coefficients.data() + int64_t{s} * kCapacity * kChunk * kRank, kRank,
                        kChunk, rope, p.scale);
        const float* got_lse = lse.data() + (int64_t{row} * kHeads + h) * kGroup * kCandidates;
        EXPECT_LT(RelativeError(std::vector<float>(got_lse, got_lse + kGroup * kCandidates),
                                reference.lse),
                  2e-3)
            << "log-sum-exps of the candidates' exact logits";
        std::vector<int32_t> kept_positions;
        kv::SelectTopK(reference.scores, kBudget, &top_values, &kept_positions);
        std::set<int32_t> want_kept, got_kept;
        for (int32_t i : kept_positions) want_kept.insert(want_candidates[i]);
        const int32_t* got = slots.data() + (s * kHeads + h) * kBudget;
        for (int slot = 0; slot < kBudget; ++slot) got_kept.insert(got[slot]);
        if (got_kept != want_kept) {
          // Allowed only at a near-tie of the K-th score: fp32 on the GPU, fp64 here, and a key
          // element that rounds to the other bf16 moves a chunk's mass by about 1e-3.
          std::vector<float> sorted = reference.scores;
          std::sort(sorted.begin(), sorted.end(), std::greater<float>());
          const float kth = sorted[kBudget - 1];
          for (int i = 0; i < kCandidates; ++i) {
            const int32_t chunk = want_candidates[i];
            if (want_kept.count(chunk) != got_kept.count(chunk)) {
              EXPECT_NEAR(reference.scores[i], kth, 2e-3 * kth)
                  << "chunk " << chunk << " kept " << got_kept.count(chunk)
                  << " on the GPU; its exact score " << reference.scores[i] << ", the K-th " << kth;
            }
          }
          ++near_ties;
          want_kept = got_kept;
        }
        // Gather slots of the kept chunks, as the CPU's GatherSlots places them.
        std::vector<int32_t> kept_items;
        for (int64_t item = 0; item < count; ++item) {
          if (want_kept.count(chunk_of[item])) kept_items.push_back(static_cast<int32_t>(item));
        }
        ASSERT_EQ(kept_items.size(), static_cast<size_t>(kBudget));
        kv::GatherSlots& gather = cpu_slots[s * kHeads + h];
        if (step == 0) gather.Resize(kBudget, count);
        std::vector<kv::GatherSlots::Fill> fills;
        expected_hits[s] += gather.Assign(kept_items, &fills);
        std::vector<int32_t> want_miss(kBudget, -1);
        for (const auto& fill : fills) want_miss[fill.slot] = chunk_of[fill.item];
        const int32_t* got_miss = miss.data() + (row * kHeads + h) * kBudget;
        for (int slot = 0; slot < kBudget; ++slot) {
          const int32_t item = gather.item_in_slot(slot);
          EXPECT_EQ(got[slot], item < 0 ? -1 : chunk_of[item]) << "slot " << slot;
          EXPECT_EQ(got_miss[slot], want_miss[slot]) << "miss of slot " << slot;
        }
      }
    }
  }
  std::vector<unsigned long long> counters = ToHost(d_counters);
  int64_t hits = 0;
  for (int s = 0; s < kSeqs; ++s) {
    EXPECT_EQ(counters[kSkvCounters * s], 2ull * kHeads * kBudget) << "sequence " << s;
    EXPECT_EQ(static_cast<int64_t>(counters[kSkvCounters * s + 1]), expected_hits[s])
        << "sequence " << s;
    hits += expected_hits[s];
  }
  EXPECT_GT(hits, 0);  // the second step reuses chunks
  std::printf(
      "[ rerank   ] head_dim %d, %s: %d of 8 (step, row, head) choices decided by a "
      "near-tie; %lld hits\n",
      head_dim, style == RopeConfig::Style::kHalves ? "halves" : "pairs", near_ties,
      static_cast<long long>(hits));
}

TEST_P(CudaShadowKvRerankTest, KeepsTheCandidatesWhoseRebuiltKeysScoreBest) {
  SKV_SKIP_WITHOUT_GPU();
  CheckRerank(GetParam(), 128, RopeConfig::Style::kHalves);
  CheckRerank(GetParam(), 64, RopeConfig::Style::kPairs);
}

// Candidates that all score the same (zero queries: every logit is 0, every chunk holds the
// same mass) keep the K of lowest index, as the CPU's top-K breaks ties, and take the free
// slots in that order; a list shorter than the layout's (packed, -1 after) counts only its own.
TEST_P(CudaShadowKvRerankTest, TiedScoresKeepTheLowerChunks) {
  SKV_SKIP_WITHOUT_GPU();
  constexpr int kHeads = 2, kGroup = 4, kDim = 64, kChunk = 8, kCapacity = 640, kBudget = 16;
  constexpr int kRows = 2, kRank = 24, kCandidates = 4 * kBudget, kListed = 40, kChunks = 600;
  std::mt19937 rng(5);
  auto d_coefficients =
      ToDevice(ToBf16(RandomBf16Values(int64_t{kRows} * kCapacity * kChunk * kRank, rng, 0.5f)));
  auto d_basis =
      ToDevice(ToBf16(RandomBf16Values(int64_t{kRows} * kRank * kHeads * kDim, rng, 0.2f)));
  auto d_layer_rank = ToDevice(std::vector<int32_t>(kRows, kRank));
  auto d_freq = ToDevice(InvFreq(kDim));
  auto d_outlier = ToDevice(std::vector<uint8_t>(kRows * kHeads * kCapacity, 0));
  auto d_slots = ToDevice(std::vector<int32_t>(kRows * kHeads * kBudget, -1));
  auto d_info = ToDevice(
      std::vector<SkvSequenceInfo>(kRows, SkvSequenceInfo{0, kBudget, 0, kBudget * kChunk}));
  auto d_counters = ToDevice(std::vector<unsigned long long>(kSkvCounters * kRows, 0));
  auto d_miss = Poisoned<int32_t>(kRows * kHeads * kBudget);
  auto d_lse = Poisoned<float>(int64_t{kRows} * kHeads * kGroup * kCandidates);
  auto d_queries = ToDevice(std::vector<uint16_t>(int64_t{kRows} * kHeads * kGroup * kDim, 0));
  // Ascending, distinct chunks per (row, head); row 1 lists all kCandidates, row 0 kListed.
  std::vector<int32_t> list(kRows * kHeads * kCandidates, -1);
  for (int row = 0; row < kRows; ++row) {
    for (int h = 0; h < kHeads; ++h) {
      const int listed = row == 0 ? kListed : kCandidates;
      for (int i = 0; i < listed; ++i) list[(row * kHeads + h) * kCandidates + i] = 3 + 9 * i + h;
    }
  }
  auto d_candidates = ToDevice(list);
  std::vector<SkvRowMeta> meta(kRows);
  for (int r = 0; r < kRows; ++r) {
    meta[r].seq = r;
    meta[r].num_chunks = kChunks;
  }
  auto d_meta = ToDevice(meta);

  SkvLayout l =
      RerankLayout({kHeads, kGroup, kDim, kChunk, kRank, kCapacity, kBudget, kCandidates});
  l.coefficients = reinterpret_cast<__nv_bfloat16*>(d_coefficients.get());
  l.basis = reinterpret_cast<__nv_bfloat16*>(d_basis.get());
  l.layer_rank = d_layer_rank.get();
  l.outlier = d_outlier.get();
  l.slot_chunk = d_slots.get();
  l.info = d_info.get();
  l.counters = d_counters.get();
  SKV_ASSERT_CUDA(SkvConfigureKernels(l));
  SkvDecodeParams p = RerankParams(l, GetParam(), /*halves=*/true, /*factor=*/4);
  p.meta = d_meta.get();
  p.rows = kRows;
  p.queries = reinterpret_cast<const __nv_bfloat16*>(d_queries.get());
  p.miss_chunk = d_miss.get();
  p.inv_freq = d_freq.get();
  p.candidates = d_candidates.get();
  p.candidate_lse = d_lse.get();
  SKV_ASSERT_CUDA(LaunchSkvRerank(p, nullptr));
  SKV_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<int32_t> slots = ToHost(d_slots), miss = ToHost(d_miss);
  for (int row = 0; row < kRows; ++row) {
    for (int h = 0; h < kHeads; ++h) {
      SCOPED_TRACE(::testing::Message() << "row " << row << ", head " << h);
      for (int slot = 0; slot < kBudget; ++slot) {
        const int32_t want = list[(row * kHeads + h) * kCandidates + slot];
        EXPECT_EQ(slots[(row * kHeads + h) * kBudget + slot], want) << "slot " << slot;
        EXPECT_EQ(miss[(row * kHeads + h) * kBudget + slot], want) << "miss of slot " << slot;
      }
    }
  }
  const std::vector<unsigned long long> counters = ToHost(d_counters);
  for (int row = 0; row < kRows; ++row) {
    EXPECT_EQ(counters[kSkvCounters * row], 1ull * kHeads * kBudget) << "row " << row;
    EXPECT_EQ(counters[kSkvCounters * row + 1], 0ull) << "row " << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaShadowKvRerankTest,
                         ::testing::Values(kSkvKernelsFirst, kSkvKernelsFast),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == kSkvKernelsFirst ? std::string("First")
                                                                 : std::string("Fast");
                         });

}  // namespace
}  // namespace shadowkv::cuda
