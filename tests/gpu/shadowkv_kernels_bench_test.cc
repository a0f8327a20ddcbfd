// Times each ShadowKV decode kernel of one layer alone (Llama-3-8B shapes: 8 KV heads, group
// 4, head dim 128, rank 160; the bench's batches at 60K and 122K, every selected chunk a miss
// as with random weights), for each kernel variant, with the bytes each must move and the
// rate that gives; and the re-ranking kernels at Qwen2.5-0.5B's and Llama-3-8B's shapes.
// Timing only; SKV_GPU_BENCH=1 enables it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu_test_util.h"
#include "ops/cuda/elementwise/fill_random.cuh"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {
namespace {

using namespace testing;


TEST(CudaShadowKvKernelsBench, DecodeKernelTimes) {
  SKV_SKIP_WITHOUT_GPU();
  if (std::getenv("SKV_GPU_BENCH") == nullptr) GTEST_SKIP() << "set SKV_GPU_BENCH=1 to run";
  constexpr int kHeads = 8, kGroup = 4, kDim = 128, kRank = 160, kChunk = 8;
  struct Shape {
    int rows;
    int context;
    int budget_chunks;
    int outlier_chunks;
  };
  for (const Shape shape :
       {Shape{24, 61440, 128, 24}, Shape{12, 124928, 256, 48}, Shape{20, 124928, 256, 48}}) {
    const int rows = shape.rows, capacity = shape.context / kChunk + 16;
    const int num_chunks = shape.context / kChunk - 4;
    const int budget = shape.budget_chunks;
    const int gather_base = shape.outlier_chunks * kChunk;
    const int attn_capacity = gather_base + budget * kChunk + 48;
    const int64_t lm_count = int64_t{rows} * kHeads * capacity * kDim;
    const int64_t coef_count = int64_t{rows} * capacity * kChunk * kRank;
    const int64_t value_count = int64_t{kHeads} * capacity * kChunk * kDim;  // per sequence
    DeviceBuffer<__nv_bfloat16> landmarks, coefficients, basis, queries, values, attn_k, attn_v;
    DeviceBuffer<uint8_t> outlier;
    DeviceBuffer<int32_t> slot_chunk, miss;
    DeviceBuffer<float> logits, partials, inv_freq;
    DeviceBuffer<unsigned long long> counters;
    ASSERT_TRUE(landmarks.Allocate(lm_count).ok());
    ASSERT_TRUE(coefficients.Allocate(coef_count).ok());
    ASSERT_TRUE(basis.Allocate(int64_t{rows} * kRank * kHeads * kDim).ok());
    ASSERT_TRUE(queries.Allocate(int64_t{rows} * kHeads * kGroup * kDim).ok());
    ASSERT_TRUE(values.Allocate(value_count * rows).ok());
    ASSERT_TRUE(attn_k.Allocate(int64_t{rows} * kHeads * attn_capacity * kDim).ok());
    ASSERT_TRUE(attn_v.Allocate(int64_t{rows} * kHeads * attn_capacity * kDim).ok());
    ASSERT_TRUE(outlier.Allocate(int64_t{rows} * kHeads * capacity).ok());
    ASSERT_TRUE(slot_chunk.Allocate(int64_t{rows} * kHeads * budget).ok());
    ASSERT_TRUE(miss.Allocate(int64_t{rows} * kHeads * budget).ok());
    ASSERT_TRUE(logits.Allocate(int64_t{rows} * kHeads * kGroup * capacity).ok());
    ASSERT_TRUE(partials.Allocate(int64_t{rows} * kHeads * kGroup * SkvScoreBlocks(capacity) * 2).ok());
    ASSERT_TRUE(counters.Allocate(2 * rows).ok());
    SKV_ASSERT_CUDA(LaunchFillRandom({landmarks.get(), lm_count, 1.0f, 1}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({coefficients.get(), coef_count, 1.0f, 2}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({basis.get(), basis.size(), 0.1f, 3}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({queries.get(), queries.size(), 1.0f, 4}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({values.get(), values.size(), 1.0f, 5}, nullptr));
    SKV_ASSERT_CUDA(cudaMemset(outlier.get(), 0, outlier.bytes()));
    SKV_ASSERT_CUDA(cudaMemset(counters.get(), 0, counters.bytes()));
    std::vector<float> freq(kDim / 2);
    for (int i = 0; i < kDim / 2; ++i) freq[i] = std::pow(500000.0f, -2.0f * i / kDim);
    inv_freq = ToDevice(freq);
    std::vector<SkvSequenceInfo> info(rows, SkvSequenceInfo{shape.outlier_chunks, budget,
                                                            gather_base, gather_base + budget * kChunk});
    std::vector<SkvRowMeta> meta(rows);
    std::vector<__nv_bfloat16*> value_table(rows);
    for (int r = 0; r < rows; ++r) {
      meta[r].seq = r;
      meta[r].num_chunks = num_chunks;
      value_table[r] = values.get() + r * value_count;
    }
    auto d_info = ToDevice(info);
    auto d_meta = ToDevice(meta);
    auto d_values = ToDevice(value_table);

    SkvLayout l;
    l.num_layers = 1;
    l.num_kv_heads = kHeads;
    l.head_dim = kDim;
    l.group = kGroup;
    l.chunk_size = kChunk;
    l.rank = kRank;
    l.capacity_chunks = capacity;
    l.max_budget = budget;
    l.recent_capacity = 40;
    l.attn = KvCacheView{attn_k.get(), attn_v.get(), rows, 1, kHeads, kDim, attn_capacity};
    l.coefficients = coefficients.get();
    l.basis = basis.get();
    l.landmarks = landmarks.get();
    l.outlier = outlier.get();
    l.slot_chunk = slot_chunk.get();
    l.values = d_values.get();
    l.info = d_info.get();
    l.counters = counters.get();
    SKV_ASSERT_CUDA(SkvConfigureKernels(l));
    SkvDecodeParams p;
    p.layout = l;
    p.meta = d_meta.get();
    p.rows = rows;
    p.queries = queries.get();
    p.logits = logits.get();
    p.softmax_partials = partials.get();
    p.miss_chunk = miss.get();
    p.inv_freq = inv_freq.get();
    p.rotary_dim = kDim;
    p.halves = true;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kDim));

    const double gb = 1e9;
    const double score_bytes = 2.0 * rows * kHeads * num_chunks * kDim;
    const double miss_rows = double{1} * rows * kHeads * budget * kChunk;
    const double rebuild_bytes = miss_rows * 2.0 * (kRank + kDim);
    const double fetch_bytes = miss_rows * 2.0 * 2.0 * kDim;
    for (int variant : {kSkvKernelsFirst, kSkvKernelsFast}) {
      p.kernel_variant = variant;
      auto reset = [&] { cudaMemsetAsync(slot_chunk.get(), 0xFF, slot_chunk.bytes()); };
      const double reset_ms = MedianMs(20, reset);
      const double score_ms = MedianMs(20, [&] { LaunchSkvScore(p, nullptr); });
      auto time_select = [&] {
        return MedianMs(20, [&] {
          reset();
          LaunchSkvSelect(p, nullptr);
        }) - reset_ms;
      };
      // The fast select's other variant first (four 8-bit digits over every key), then the one
      // the model uses, so the slots below are those of the default.
      double radix8_ms = 0.0, registers32_ms = 0.0;
      if (variant == kSkvKernelsFast) {
        p.coarse_select = 0;
        radix8_ms = time_select();
        p.coarse_select = 1;
        p.select_registers = 32;
        registers32_ms = time_select();
        p.select_registers = 0;
      }
      const double select_ms = time_select();
      // Every slot missed (the slots were reset before the last select).
      const double rebuild_ms = MedianMs(20, [&] { LaunchSkvRebuildKeys(p, nullptr); });
      // The fast rebuild with more gather slots per block.
      double rebuild_64_ms = 0.0, rebuild_128_ms = 0.0;
      if (variant == kSkvKernelsFast) {
        p.rebuild_slots = 64;
        rebuild_64_ms = MedianMs(20, [&] { LaunchSkvRebuildKeys(p, nullptr); });
        p.rebuild_slots = 128;
        rebuild_128_ms = MedianMs(20, [&] { LaunchSkvRebuildKeys(p, nullptr); });
        p.rebuild_slots = 0;
      }
      const double fetch_ms = MedianMs(20, [&] { LaunchSkvFetchValues(p, nullptr); });
      // Scoring FP8 landmarks (codes and per-landmark scales).
      double fp8_score_ms = 0.0;
      if (variant == kSkvKernelsFast) {
        DeviceBuffer<uint8_t> codes;
        DeviceBuffer<float> scales;
        ASSERT_TRUE(codes.Allocate(lm_count).ok());
        ASSERT_TRUE(scales.Allocate(lm_count / kDim).ok());
        SKV_ASSERT_CUDA(cudaMemset(codes.get(), 0x38, codes.bytes()));  // 1.0 in e4m3
        SKV_ASSERT_CUDA(cudaMemset(scales.get(), 0, scales.bytes()));
        SkvDecodeParams fp8 = p;
        fp8.layout.fp8_landmarks = 1;
        fp8.layout.landmark_codes = codes.get();
        fp8.layout.landmark_scales = scales.get();
        SKV_ASSERT_CUDA(SkvConfigureKernels(fp8.layout));
        fp8_score_ms = MedianMs(20, [&] { LaunchSkvScore(fp8, nullptr); });
        SKV_ASSERT_CUDA(cudaDeviceSynchronize());
      }
      p.halves = false;  // the other RoPE style (Llama GGUF models rotate pairs)
      const double rebuild_pairs_ms = MedianMs(20, [&] { LaunchSkvRebuildKeys(p, nullptr); });
      p.halves = true;
      SKV_ASSERT_CUDA(cudaDeviceSynchronize());
      std::printf(
          "[ kernels ] %s context %d rows %d K %d: score %.1f us (%.0f GB/s; FP8 landmarks %.1f "
          "us), select %.1f us "
          "(8-bit digits over every key: %.1f us; 32 registers: %.1f us), "
          "rebuild %.1f us (%.0f GB/s; rotary pairs %.1f us; 64 / 128 slots a block %.1f / %.1f "
          "us), fetch %.1f us (%.0f GB/s); per "
          "step of 32 layers: score+select %.2f ms, rebuild %.2f ms, fetch %.2f ms\n",
          variant == kSkvKernelsFast ? "fast " : "first", shape.context, rows, budget,
          score_ms * 1e3, score_bytes / (score_ms * 1e-3) / gb, fp8_score_ms * 1e3, select_ms * 1e3, radix8_ms * 1e3, registers32_ms * 1e3,
          rebuild_ms * 1e3, rebuild_bytes / (rebuild_ms * 1e-3) / gb, rebuild_pairs_ms * 1e3,
          rebuild_64_ms * 1e3, rebuild_128_ms * 1e3,
          fetch_ms * 1e3,
          fetch_bytes / (fetch_ms * 1e-3) / gb, 32 * (score_ms + select_ms), 32 * rebuild_ms,
          32 * fetch_ms);
    }
  }
}

// The re-ranking selection's kernels (fast variant), one layer: the landmark score, the landmark
// select of K chunks and of the rerank_factor·K candidates, and the re-rank (exact scores of
// the candidates' rebuilt keys, then the best K into the gather slots).
TEST(CudaShadowKvKernelsBench, RerankKernelTimes) {
  SKV_SKIP_WITHOUT_GPU();
  if (std::getenv("SKV_GPU_BENCH") == nullptr) GTEST_SKIP() << "set SKV_GPU_BENCH=1 to run";
  struct Shape {
    const char* name;
    int heads, group, dim, rank, rows, context, budget_chunks, factor, layers;
  };
  for (const Shape shape : {Shape{"qwen2.5-0.5b", 2, 7, 64, 24, 64, 32000, 64, 4, 24},
                            Shape{"qwen2.5-0.5b", 2, 7, 64, 24, 64, 32000, 64, 8, 24},
                            Shape{"qwen2.5-0.5b", 2, 7, 64, 64, 64, 32000, 64, 8, 24},
                            Shape{"qwen2.5-0.5b", 2, 7, 64, 64, 64, 32000, 128, 4, 24},
                            // A 4,096-token budget at 32K at the bench's best batch.
                            Shape{"qwen2.5-0.5b", 2, 7, 64, 64, 293, 32000, 512, 4, 24},
                            Shape{"qwen2.5-0.5b", 2, 7, 64, 64, 293, 32000, 512, 2, 24},
                            Shape{"llama3-8b", 8, 4, 128, 160, 12, 124928, 256, 2, 32},
                            Shape{"llama3-8b", 8, 4, 128, 160, 12, 124928, 256, 4, 32}}) {
    constexpr int kChunk = 8;
    const int rows = shape.rows, heads = shape.heads, dim = shape.dim, rank = shape.rank;
    const int capacity = (shape.context / kChunk + 15) / 16 * 16;
    const int num_chunks = shape.context / kChunk - 4;
    const int budget = shape.budget_chunks, candidates = shape.factor * budget;
    const int64_t lm_count = int64_t{rows} * heads * capacity * dim;
    const int64_t coef_count = int64_t{rows} * capacity * kChunk * rank;
    DeviceBuffer<__nv_bfloat16> landmarks, coefficients, basis, queries;
    DeviceBuffer<uint8_t> outlier;
    DeviceBuffer<int32_t> slot_chunk, miss, candidate_list;
    DeviceBuffer<float> logits, partials, inv_freq, lse;
    DeviceBuffer<unsigned long long> counters;
    ASSERT_TRUE(landmarks.Allocate(lm_count).ok());
    ASSERT_TRUE(coefficients.Allocate(coef_count).ok());
    ASSERT_TRUE(basis.Allocate(int64_t{rows} * rank * heads * dim).ok());
    ASSERT_TRUE(queries.Allocate(int64_t{rows} * heads * shape.group * dim).ok());
    ASSERT_TRUE(outlier.Allocate(int64_t{rows} * heads * capacity).ok());
    ASSERT_TRUE(slot_chunk.Allocate(int64_t{rows} * heads * budget).ok());
    ASSERT_TRUE(miss.Allocate(int64_t{rows} * heads * budget).ok());
    ASSERT_TRUE(candidate_list.Allocate(int64_t{rows} * heads * candidates).ok());
    ASSERT_TRUE(lse.Allocate(int64_t{rows} * heads * shape.group * candidates).ok());
    ASSERT_TRUE(logits.Allocate(int64_t{rows} * heads * shape.group * capacity).ok());
    ASSERT_TRUE(
        partials.Allocate(int64_t{rows} * heads * shape.group * SkvScoreBlocks(capacity) * 2).ok());
    ASSERT_TRUE(counters.Allocate(2 * rows).ok());
    SKV_ASSERT_CUDA(LaunchFillRandom({landmarks.get(), lm_count, 1.0f, 1}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({coefficients.get(), coef_count, 1.0f, 2}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({basis.get(), basis.size(), 0.1f, 3}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({queries.get(), queries.size(), 1.0f, 4}, nullptr));
    SKV_ASSERT_CUDA(cudaMemset(outlier.get(), 0, outlier.bytes()));
    SKV_ASSERT_CUDA(cudaMemset(counters.get(), 0, counters.bytes()));
    std::vector<float> freq(dim / 2);
    for (int i = 0; i < dim / 2; ++i) freq[i] = std::pow(500000.0f, -2.0f * i / dim);
    inv_freq = ToDevice(freq);
    const int outliers = 12;
    std::vector<SkvSequenceInfo> info(
        rows, SkvSequenceInfo{outliers, budget, outliers * kChunk, (outliers + budget) * kChunk});
    std::vector<SkvRowMeta> meta(rows);
    for (int r = 0; r < rows; ++r) {
      meta[r].seq = r;
      meta[r].num_chunks = num_chunks;
    }
    auto d_info = ToDevice(info);
    auto d_meta = ToDevice(meta);
    SkvLayout l;
    l.num_layers = 1;
    l.num_kv_heads = heads;
    l.head_dim = dim;
    l.group = shape.group;
    l.chunk_size = kChunk;
    l.rank = rank;
    l.capacity_chunks = capacity;
    l.max_budget = budget;
    l.max_candidates = candidates;
    l.recent_capacity = 40;
    l.coefficients = coefficients.get();
    l.basis = basis.get();
    l.landmarks = landmarks.get();
    l.outlier = outlier.get();
    l.slot_chunk = slot_chunk.get();
    l.info = d_info.get();
    l.counters = counters.get();
    SKV_ASSERT_CUDA(SkvConfigureKernels(l));
    SkvDecodeParams p;
    p.layout = l;
    p.meta = d_meta.get();
    p.rows = rows;
    p.queries = queries.get();
    p.logits = logits.get();
    p.softmax_partials = partials.get();
    p.miss_chunk = miss.get();
    p.inv_freq = inv_freq.get();
    p.rotary_dim = dim;
    p.halves = true;
    p.scale = 1.0f / std::sqrt(static_cast<float>(dim));
    p.kernel_variant = kSkvKernelsFast;
    auto reset = [&] { cudaMemsetAsync(slot_chunk.get(), 0xFF, slot_chunk.bytes()); };
    const double reset_ms = MedianMs(20, reset);
    const double score_ms = MedianMs(20, [&] { LaunchSkvScore(p, nullptr); });
    const double select_ms = MedianMs(20, [&] {
      reset();
      LaunchSkvSelect(p, nullptr);
    }) - reset_ms;
    SkvDecodeParams r = p;
    r.rerank_factor = shape.factor;
    r.candidates = candidate_list.get();
    r.candidate_lse = lse.get();
    const double candidates_ms = MedianMs(20, [&] { LaunchSkvSelect(r, nullptr); });
    const double rerank_ms = MedianMs(20, [&] {
      reset();
      LaunchSkvRerank(r, nullptr);
    }) - reset_ms;
    SKV_ASSERT_CUDA(cudaDeviceSynchronize());
    std::printf(
        "[ rerank   ] %s rows %d context %d K %d rank %d factor %d: score %.1f us, select K %.1f "
        "us, select %d candidates %.1f us, re-rank (exact scores + select) %.1f us; per step of "
        "%d layers: landmarks %.2f ms, re-ranked %.2f ms\n",
        shape.name, rows, shape.context, budget, rank, shape.factor, score_ms * 1e3,
        select_ms * 1e3, candidates, candidates_ms * 1e3, rerank_ms * 1e3, shape.layers,
        shape.layers * (score_ms + select_ms), shape.layers * (score_ms + candidates_ms + rerank_ms));
  }
}

}  // namespace
}  // namespace shadowkv::cuda
