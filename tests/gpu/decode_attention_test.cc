// GPU split-KV decode attention against the CPU attention op: head dims 16-256, GQA groups
// 1-8 and the wide ones served 8 heads a block (12, 16: GLM-4-9B's, 32), one split or many, sequences of different lengths in one launch, sliding windows shorter
// and longer than the sequences, keys with log weights. With SKV_GPU_BENCH=1 a
// micro-benchmark also times it at Llama-3-8B decode shapes against the read probe.
#include "ops/cuda/attention/decode_attention.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "attention_test_util.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/elementwise/fill_random.cuh"
#include "read_probe.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

// Splits each head's one segment of `input` at the weighted runs of `first` (runs of `run`
// keys, run j weighted weights[h * runs + j]) into segments of their own, weighted as the CPU op
// weighs them.
AttentionInput WeightedRuns(const AttentionInput& input, int first, int runs, int run,
                            const float* weights) {
  AttentionInput out;
  out.Reset(static_cast<int>(input.heads.size()));
  for (size_t h = 0; h < input.heads.size(); ++h) {
    const KvSegment& whole = input.heads[h][0];
    auto piece = [&](int begin, int end, float log_weight) {
      end = std::min(end, whole.num_tokens);
      if (begin >= end) return;
      KvSegment part = whole;
      part.keys += static_cast<int64_t>(begin) * whole.row_stride;
      part.values += static_cast<int64_t>(begin) * whole.row_stride;
      part.num_tokens = end - begin;
      part.log_weight = log_weight;
      out.heads[h].push_back(part);
    };
    piece(0, first, 0.0f);
    for (int j = 0; j < runs; ++j) {
      piece(first + j * run, first + (j + 1) * run, weights[h * runs + j]);
    }
    piece(first + runs * run, whole.num_tokens, 0.0f);
  }
  return out;
}

// weighted: runs of keys carry log weights (DecodeAttentionParams::key_log_weight), as
// ShadowKV's chunks drawn at random do: 6 runs of `run` keys from a row's own first key, some of
// weight 0; window 0 only.
void CheckDecode(int head_dim, int group, int num_splits, int window = 0, bool weighted = false,
                 int run = 8) {
  std::mt19937 rng(head_dim * 1000 + group * 10 + num_splits + window * 7);
  const int num_kv_heads = 2, num_query_heads = num_kv_heads * group;
  const int q_width = num_query_heads * head_dim;
  const std::vector<int64_t> slot_lengths = {200, 1337, 1, 700};
  const std::vector<int32_t> slots = {2, 0, 1};  // rows: lengths 1, 200, 1337
  const int rows = static_cast<int>(slots.size()), layer = 1;
  RandomKvCache cache(4, 2, num_kv_heads, head_dim, 1400, slot_lengths, rng);
  std::vector<int32_t> positions;
  for (int slot : slots) positions.push_back(static_cast<int32_t>(slot_lengths[slot] - 1));
  const std::vector<float> queries = RandomBf16Values(static_cast<int64_t>(rows) * q_width, rng);

  auto device_queries = ToDevice(ToBf16(queries));
  auto device_slots = ToDevice(slots);
  auto device_positions = ToDevice(positions);
  auto partial_out = Poisoned<float>(static_cast<int64_t>(rows) * num_query_heads * num_splits * head_dim);
  auto partial_lse = Poisoned<float>(static_cast<int64_t>(rows) * num_query_heads * num_splits);
  auto out = Poisoned<uint16_t>(static_cast<int64_t>(rows) * q_width);
  DecodeAttentionParams p;
  p.queries = reinterpret_cast<const __nv_bfloat16*>(device_queries.get());
  p.cache = cache.view();
  p.layer = layer;
  p.slots = device_slots.get();
  p.positions = device_positions.get();
  p.partial_out = partial_out.get();
  p.partial_lse = partial_lse.get();
  p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  p.rows = rows;
  p.num_query_heads = num_query_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.num_splits = num_splits;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  p.window = window;
  constexpr int kRuns = 6;
  const std::vector<int32_t> first = {0, 40, 500};  // per row
  std::vector<float> weights(static_cast<size_t>(4) * 2 * num_kv_heads * kRuns);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = i % 3 == 0 ? 0.0f : 0.5f + i % 7 * 0.4f;
  auto device_first = ToDevice(first);
  auto device_weights = ToDevice(weights);
  if (weighted) {
    p.key_log_weight = device_weights.get();
    p.weight_first = device_first.get();
    p.weight_runs = kRuns;
    p.weight_run = run;
  }
  SKV_ASSERT_CUDA(LaunchDecodeAttention(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);

  // The CPU op masks a window only in positioned (causal) segments.
  const AttentionShape shape{num_query_heads, num_kv_heads, head_dim, p.scale, window};
  std::vector<float> want(got.size());
  std::vector<AttentionInput> inputs;
  for (int r = 0; r < rows; ++r) {
    inputs.push_back(cache.Segments(slots[r], layer, positions[r] + 1, window > 0));
    if (weighted) {
      const int64_t head_weights = (static_cast<int64_t>(slots[r]) * 2 + layer) * num_kv_heads;
      inputs.back() = WeightedRuns(inputs.back(), first[r], kRuns, run,
                                   weights.data() + head_weights * kRuns);
    }
  }
  std::vector<AttentionJob> jobs;
  for (int r = 0; r < rows; ++r) {
    jobs.push_back(AttentionJob{queries.data() + static_cast<int64_t>(r) * q_width,
                                want.data() + static_cast<int64_t>(r) * q_width, 1, positions[r],
                                &inputs[r]});
  }
  ThreadPool pool(2);
  RunAttention(shape, jobs, pool);
  if (weighted) {  // the weights matter: the same keys unweighted attend elsewhere
    std::vector<float> unweighted(got.size());
    std::vector<AttentionInput> plain;
    for (int r = 0; r < rows; ++r) plain.push_back(cache.Segments(slots[r], layer, positions[r] + 1, false));
    std::vector<AttentionJob> plain_jobs = jobs;
    for (int r = 0; r < rows; ++r) {
      plain_jobs[r].input = &plain[r];
      plain_jobs[r].out = unweighted.data() + static_cast<int64_t>(r) * q_width;
    }
    RunAttention(shape, plain_jobs, pool);
    EXPECT_GT(RelativeError(got, unweighted), 10 * kAttentionTolerance);
  }
  const double error = RelativeError(got, want);
  const std::string weighting = weighted ? "_weighted_run" + std::to_string(run) : "";
  EXPECT_LT(error, kAttentionTolerance) << "head_dim " << head_dim << " group " << group
                                        << " splits " << num_splits << " window " << window
                                        << weighting;
  ::testing::Test::RecordProperty("relative_error_h" + std::to_string(head_dim) + "_g" +
                                      std::to_string(group) + "_s" + std::to_string(num_splits) +
                                      "_w" + std::to_string(window) + weighting,
                                  std::to_string(error));
}

TEST(CudaDecodeAttentionTest, Llama3ShapeManySplits) {
  SKV_SKIP_WITHOUT_GPU();
  CheckDecode(128, 4, 64);
  CheckDecode(128, 4, 7);
}

TEST(CudaDecodeAttentionTest, OneSplitPerSequence) {
  SKV_SKIP_WITHOUT_GPU();
  CheckDecode(128, 4, 1);
  CheckDecode(64, 3, 1);
}

TEST(CudaDecodeAttentionTest, EveryGroupSizeAndHeadDim) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {16, 32, 64, 96, 128, 256}) {
    for (int group = 1; group <= 8; ++group) CheckDecode(head_dim, group, 16);
  }
}

// Groups above kDecodeHeadsPerBlock take several blocks per KV head, the last one partial (12).
TEST(CudaDecodeAttentionTest, WideGroups) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {64, 128, 256}) {
    for (int group : {9, 12, 16, 32}) CheckDecode(head_dim, group, 16);
  }
  CheckDecode(128, 16, 1);
  CheckDecode(128, 16, 64, 100);
  EXPECT_TRUE(DecodeAttentionSupports(128, kDecodeMaxGroup));
  EXPECT_FALSE(DecodeAttentionSupports(128, kDecodeMaxGroup + 1));
}

// Sliding windows: 8 (the tiny Gemma 3 model's), one split's worth, a window that is not a
// multiple of 16, and one longer than two of the three rows (those then see every key).
TEST(CudaDecodeAttentionTest, SlidingWindow) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {16, 32, 64, 96, 128, 256}) {
    for (int window : {8, 32, 100, 500}) {
      CheckDecode(head_dim, 2, 16, window);
      CheckDecode(head_dim, 4, 1, window);
    }
  }
  CheckDecode(128, 8, 64, 1000);
}

// Keys with log weights (ShadowKV's chunks drawn at random) attend as the CPU op weighs them:
// every head dim, narrow and wide groups, one split or many (a run split across splits), runs of
// 8 keys and of lengths that are not powers of two.
TEST(CudaDecodeAttentionTest, WeightedKeysCountAsCopies) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {16, 64, 96, 128, 256}) {
    CheckDecode(head_dim, 4, 1, 0, true);
    CheckDecode(head_dim, 2, 16, 0, true);
  }
  CheckDecode(128, 16, 64, 0, true);
  // Runs whose length is not a power of two.
  CheckDecode(64, 7, 1, 0, true, 6);
  CheckDecode(128, 4, 16, 0, true, 3);
}

// A window the CPU op would not apply to the same keys fails the comparison: the test sees it.
TEST(CudaDecodeAttentionTest, WindowChangesTheOutput) {
  SKV_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> lengths = {300};
  std::mt19937 rng(9);
  const int head_dim = 64, num_kv_heads = 1, num_query_heads = 2;
  RandomKvCache cache(1, 1, num_kv_heads, head_dim, 300, lengths, rng);
  const std::vector<float> queries = RandomBf16Values(num_query_heads * head_dim, rng);
  auto device_queries = ToDevice(ToBf16(queries));
  auto device_slots = ToDevice(std::vector<int32_t>{0});
  auto device_positions = ToDevice(std::vector<int32_t>{299});
  auto partial_out = Poisoned<float>(num_query_heads * 4 * head_dim);
  auto partial_lse = Poisoned<float>(num_query_heads * 4);
  std::vector<std::vector<float>> outputs;
  for (int window : {0, 50}) {
    auto out = Poisoned<uint16_t>(num_query_heads * head_dim);
    DecodeAttentionParams p;
    p.queries = reinterpret_cast<const __nv_bfloat16*>(device_queries.get());
    p.cache = cache.view();
    p.slots = device_slots.get();
    p.positions = device_positions.get();
    p.partial_out = partial_out.get();
    p.partial_lse = partial_lse.get();
    p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
    p.rows = 1;
    p.num_query_heads = num_query_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_dim = head_dim;
    p.num_splits = 4;
    p.scale = 0.125f;
    p.window = window;
    SKV_ASSERT_CUDA(LaunchDecodeAttention(p, nullptr));
    outputs.push_back(ToHostBf16(out));
  }
  EXPECT_GT(RelativeError(outputs[1], outputs[0]), 10 * kAttentionTolerance);
}

TEST(CudaDecodeAttentionTest, SplitCountDoesNotDependOnLengths) {
  // 132 multiprocessors: two waves of 3 x 132 blocks, over rows x 8 KV heads.
  EXPECT_EQ(DecodeNumSplits(1, 8, 1056), kDecodeMaxSplits);  // 792 / 8 = 99, capped
  EXPECT_EQ(DecodeNumSplits(16, 8, 1056), 6);
  EXPECT_EQ(DecodeNumSplits(7, 8, 1056), 14);
  EXPECT_EQ(DecodeNumSplits(200, 8, 1056), 1);
}


// Llama-3-8B decode attention of one layer (8 KV heads, 32 query heads, head dim 128) at the
// bench's batch and context: K/V bytes read per launch over time, against a plain read of the
// same bytes and a device-to-device copy. Timing only; SKV_GPU_BENCH=1 enables it.
TEST(CudaDecodeAttentionBench, StreamingRate) {
  SKV_SKIP_WITHOUT_GPU();
  if (std::getenv("SKV_GPU_BENCH") == nullptr) GTEST_SKIP() << "set SKV_GPU_BENCH=1 to run";
  auto device = QueryDevice();
  ASSERT_TRUE(device.ok());
  const int num_kv_heads = 8, num_query_heads = 32, head_dim = 128;
  struct Shape {
    int rows;
    int64_t context;
  };
  for (const Shape shape : {Shape{16, 61440}, Shape{8, 124928}}) {
    KvCacheView view;
    view.num_slots = shape.rows;
    view.num_layers = 1;
    view.num_kv_heads = num_kv_heads;
    view.head_dim = head_dim;
    view.capacity = shape.context;
    const int64_t count = view.HeadOffset(shape.rows, 0, 0);
    DeviceBuffer<__nv_bfloat16> keys, values, queries, out;
    DeviceBuffer<float> partial_out, partial_lse;
    DeviceBuffer<int32_t> slots_buffer, positions_buffer;
    DeviceBuffer<uint32_t> sink;
    ASSERT_TRUE(keys.Allocate(count).ok());
    ASSERT_TRUE(values.Allocate(count).ok());
    ASSERT_TRUE(queries.Allocate(shape.rows * num_query_heads * head_dim).ok());
    ASSERT_TRUE(out.Allocate(shape.rows * num_query_heads * head_dim).ok());
    ASSERT_TRUE(partial_out.Allocate(int64_t{shape.rows} * num_query_heads * kDecodeMaxSplits * head_dim).ok());
    ASSERT_TRUE(partial_lse.Allocate(int64_t{shape.rows} * num_query_heads * kDecodeMaxSplits).ok());
    ASSERT_TRUE(sink.Allocate(1).ok());
    SKV_ASSERT_CUDA(LaunchFillRandom({keys.get(), count, 1.0f, 1}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({values.get(), count, 1.0f, 2}, nullptr));
    SKV_ASSERT_CUDA(LaunchFillRandom({queries.get(), queries.size(), 1.0f, 3}, nullptr));
    std::vector<int32_t> slots(shape.rows), positions(shape.rows,
                                                      static_cast<int32_t>(shape.context - 1));
    for (int r = 0; r < shape.rows; ++r) slots[r] = r;
    slots_buffer = ToDevice(slots);
    positions_buffer = ToDevice(positions);
    view.keys = keys.get();
    view.values = values.get();
    const double bytes = 2.0 * count * 2;  // K and V, bf16

    const double read_ms = MedianMs(10, [&] {
      LaunchReadProbe(keys.get(), count * 2, sink.get(), nullptr);
      LaunchReadProbe(values.get(), count * 2, sink.get(), nullptr);
    });
    const double copy_ms = MedianMs(10, [&] {
      cudaMemcpyAsync(values.get(), keys.get(), count * 2, cudaMemcpyDeviceToDevice, nullptr);
    });
    SKV_ASSERT_CUDA(LaunchFillRandom({values.get(), count, 1.0f, 2}, nullptr));
    std::printf("[bench] rows %d context %lld: K+V %.2f GB; read probe %.3f ms = %.0f GB/s; "
                "D2D copy %.0f GB/s (read+write)\n",
                shape.rows, static_cast<long long>(shape.context), bytes / 1e9, read_ms,
                bytes / read_ms / 1e6, 2.0 * count * 2 / copy_ms / 1e6);

    const int auto_splits = DecodeNumSplits(shape.rows, num_kv_heads, 8 * device->multiprocessors);
    for (int splits : {auto_splits, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32}) {
      DecodeAttentionParams p;
      p.queries = queries.get();
      p.cache = view;
      p.layer = 0;
      p.slots = slots_buffer.get();
      p.positions = positions_buffer.get();
      p.partial_out = partial_out.get();
      p.partial_lse = partial_lse.get();
      p.out = out.get();
      p.rows = shape.rows;
      p.num_query_heads = num_query_heads;
      p.num_kv_heads = num_kv_heads;
      p.head_dim = head_dim;
      p.num_splits = splits;
      p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
      SKV_ASSERT_CUDA(LaunchDecodeAttention(p, nullptr));
      SKV_ASSERT_CUDA(cudaDeviceSynchronize());
      const double ms = MedianMs(10, [&] { LaunchDecodeAttention(p, nullptr); });
      std::printf("[bench] rows %d context %lld splits %d%s: %.3f ms = %.0f GB/s "
                  "(%.1f%% of the read probe)\n",
                  shape.rows, static_cast<long long>(shape.context), splits,
                  splits == auto_splits ? " (auto)" : "", ms, bytes / ms / 1e6,
                  100.0 * read_ms / ms);
    }
    SKV_ASSERT_CUDA(cudaDeviceSynchronize());
  }
}

}  // namespace
}  // namespace shadowkv::cuda
