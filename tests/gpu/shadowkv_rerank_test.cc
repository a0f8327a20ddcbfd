// ShadowKV re-ranking kernels (selection "rerank", both kernel variants) against a CPU reference
// written out here: the landmark candidates (ScoreLandmarks, SelectTopK of rerank_factor · K),
// their keys (rebuilt from A and B at each sequence's own rank with RoPE and rounded to bf16, or
// stored as FP8 codes of each key less its chunk's landmark and decoded in fp32), the exact
// logits and each chunk's log-sum-exp of them per query head, the per-head softmax over all
// candidate tokens whose per-chunk mass (max over the GQA group) picks the K, and the gather
// slots those take (GatherSlots), over two steps.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <set>

#include "core/fp8.h"
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

// Token t of chunk `chunk`'s key of the (row, KV head) scored: head_dim values into `key`.
using KeyOf = std::function<void(int32_t chunk, int t, float* key)>;

ExactReference ExactScores(const std::vector<int32_t>& chunks, const float* queries, int group,
                           int head_dim, int chunk_size, float scale, const KeyOf& key_of) {
  const int count = static_cast<int>(chunks.size()), tokens = count * chunk_size;
  ExactReference out;
  out.logits.assign(static_cast<size_t>(group) * tokens, 0.0f);
  std::vector<float> key(head_dim);
  for (int i = 0; i < count; ++i) {
    for (int t = 0; t < chunk_size; ++t) {
      key_of(chunks[i], t, key.data());
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

// Where the re-rank's candidate keys come from: rebuilt from A and B; stored FP8 runs scored as
// coded (the fast kernels) or decoded into key tiles (stored_key_prefetch 0, and the first
// kernels).
enum class RerankKeys { kRebuilt, kStoredFp8, kStoredFp8Decoded };

const char* KeysName(RerankKeys keys) {
  switch (keys) {
    case RerankKeys::kRebuilt:
      return "rebuilt keys";
    case RerankKeys::kStoredFp8:
      return "FP8 stored keys";
    default:
      return "FP8 stored keys decoded";
  }
}

void CheckRerank(int kernel_variant, int head_dim, RopeConfig::Style style,
                 RerankKeys keys = RerankKeys::kRebuilt) {
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
  // FP8 stored keys: each sequence's store holds, per (head, chunk) run, the codes of each key
  // less its chunk's landmark (the key: the landmark plus a residual of up to 0.25), then one
  // fp32 scale per run (SkvLayout::KeyCodes, KeyScale; the keys start the store here).
  const bool stored = keys != RerankKeys::kRebuilt;
  const int64_t runs = int64_t{kHeads} * kCapacity, run_size = int64_t{kChunk} * head_dim;
  std::vector<std::vector<uint8_t>> stores(stored ? kSeqs : 0);
  for (int s = 0; s < static_cast<int>(stores.size()); ++s) {
    std::vector<uint8_t>& store = stores[s];
    store.assign(runs * run_size + runs * 4, 0);
    std::uniform_real_distribution<float> residual(-0.25f, 0.25f);
    std::vector<float> run(run_size);
    for (int h = 0; h < kHeads; ++h) {
      for (int c = 0; c < num_chunks[s]; ++c) {
        for (float& x : run) x = residual(rng);
        const int64_t at = int64_t{h} * kCapacity + c;
        const float scale = QuantizeFp8Run(run.data(), run_size, store.data() + at * run_size);
        std::memcpy(store.data() + runs * run_size + at * 4, &scale, 4);
      }
    }
  }
  std::vector<DeviceBuffer<uint8_t>> d_stores;
  std::vector<__nv_bfloat16*> store_table;
  for (const std::vector<uint8_t>& store : stores) {
    d_stores.push_back(ToDevice(store));
    store_table.push_back(reinterpret_cast<__nv_bfloat16*>(d_stores.back().get()));
  }
  auto d_store_table = ToDevice(stored ? store_table : std::vector<__nv_bfloat16*>(1, nullptr));

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
  if (stored) {
    l.values = d_store_table.get();
    l.exact_keys = 1;
    l.fp8_keys = 1;
    l.rerank_stored = 1;
  }
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
    p.stored_key_prefetch = keys == RerankKeys::kStoredFp8Decoded ? 0 : 1;
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
        std::vector<float> rows(static_cast<size_t>(own_rank[s]));
        const KeyOf rebuilt = [&](int32_t chunk, int t, float* key) {
          const float* a = coefficients.data() +
                           ((int64_t{s} * kCapacity + chunk) * kChunk + t) * kRank;
          std::copy_n(a, own_rank[s], rows.data());
          kv::RebuildColumns(own_basis, rows.data(), 1, h * head_dim, head_dim, key, head_dim);
          rope.Apply(key, 1, head_dim, int64_t{chunk} * kChunk + t);
          for (int e = 0; e < head_dim; ++e) key[e] = Bf16ToFp32(Fp32ToBf16(key[e]));
        };
        const KeyOf decoded = [&](int32_t chunk, int t, float* key) {
          const int64_t at = int64_t{h} * kCapacity + chunk;
          const uint8_t* codes = stores[s].data() + at * run_size + int64_t{t} * head_dim;
          float scale;
          std::memcpy(&scale, stores[s].data() + runs * run_size + at * 4, 4);
          const float* landmark =
              landmarks.data() + ((int64_t{s} * kHeads + h) * kCapacity + chunk) * head_dim;
          for (int e = 0; e < head_dim; ++e) key[e] = Fp8E4m3ToFp32(codes[e]) * scale + landmark[e];
        };
        const ExactReference reference = ExactScores(want_candidates, q, kGroup, head_dim, kChunk,
                                                     p.scale, stored ? decoded : rebuilt);
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
      "[ rerank   ] head_dim %d, %s, %s: %d of 8 (step, row, head) choices decided by a "
      "near-tie; %lld hits\n",
      head_dim, style == RopeConfig::Style::kHalves ? "halves" : "pairs", KeysName(keys),
      near_ties, static_cast<long long>(hits));
}

TEST_P(CudaShadowKvRerankTest, KeepsTheCandidatesWhoseRebuiltKeysScoreBest) {
  SKV_SKIP_WITHOUT_GPU();
  CheckRerank(GetParam(), 128, RopeConfig::Style::kHalves);
  CheckRerank(GetParam(), 64, RopeConfig::Style::kPairs);
}

// FP8 stored keys (exact_keys with fp8_keys, scored from the store): the fast kernels score the
// codes as they are and add the landmark's logit (SkvExactScoreFp8Kernel), or with
// stored_key_prefetch 0 decode them into key tiles, as the first kernels do; either keeps the
// candidates whose keys, decoded exactly here, score best. Head dims 128, 96 and 64 (the
// as-coded kernel's three forms; 96 on the fast kernels only, which the first ones refuse).
TEST_P(CudaShadowKvRerankTest, KeepsTheCandidatesWhoseStoredFp8KeysScoreBest) {
  SKV_SKIP_WITHOUT_GPU();
  const bool fast = GetParam() == kSkvKernelsFast;
  for (const RerankKeys keys : {RerankKeys::kStoredFp8, RerankKeys::kStoredFp8Decoded}) {
    if (!fast && keys == RerankKeys::kStoredFp8) continue;  // the first kernels always decode
    CheckRerank(GetParam(), 128, RopeConfig::Style::kHalves, keys);
    CheckRerank(GetParam(), 64, RopeConfig::Style::kPairs, keys);
    if (fast) CheckRerank(GetParam(), 96, RopeConfig::Style::kHalves, keys);
  }
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
