// GPU causal flash prefill attention against the CPU attention op (wgmma for head dim 128 on
// sm_90a builds, mma.sync otherwise): fresh prompts and later chunks (a cached prefix), several
// sequences in one launch, GQA groups that do and do not divide the row tile, head dims 16, 32,
// 64, 96, 128 and 256, sliding windows (a block's first tiles skipped, keys below each row's window
// masked). With SKV_GPU_BENCH=1 a micro-benchmark also times the last 4096-query chunk of a 32K and
// of a 122K prompt.
#include "ops/cuda/attention/prefill_attention.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "attention_test_util.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/elementwise/fill_random.cuh"

namespace shadowkv::cuda {
namespace {

using namespace testing;

struct Chunk {
  int slot;
  int first_position;
  int num_queries;
};

void CheckPrefill(int head_dim, int group, const std::vector<Chunk>& chunks, int window = 0) {
  std::mt19937 rng(head_dim * 100 + group + static_cast<int>(chunks.size()) + window * 3);
  const int num_kv_heads = 2, num_query_heads = num_kv_heads * group;
  const int q_width = num_query_heads * head_dim, layer = 0;
  std::vector<int64_t> slot_lengths(4, 0);
  int rows = 0;
  std::vector<PrefillSequence> sequences;
  for (const Chunk& c : chunks) {
    slot_lengths[c.slot] = c.first_position + c.num_queries;
    sequences.push_back(PrefillSequence{rows, c.num_queries, c.first_position, c.slot});
    rows += c.num_queries;
  }
  RandomKvCache cache(4, 1, num_kv_heads, head_dim, 1100, slot_lengths, rng);
  const std::vector<float> queries = RandomBf16Values(static_cast<int64_t>(rows) * q_width, rng);
  auto device_queries = ToDevice(ToBf16(queries));
  auto device_sequences = ToDevice(sequences);
  auto out = Poisoned<uint16_t>(static_cast<int64_t>(rows) * q_width);
  PrefillAttentionParams p;
  p.queries = reinterpret_cast<const __nv_bfloat16*>(device_queries.get());
  p.cache = cache.view();
  p.layer = layer;
  p.sequences = device_sequences.get();
  p.num_sequences = static_cast<int>(sequences.size());
  for (const Chunk& c : chunks) p.max_queries = std::max(p.max_queries, c.num_queries);
  p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  p.num_query_heads = num_query_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  p.window = window;
  SKV_ASSERT_CUDA(LaunchPrefillAttention(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);

  const AttentionShape shape{num_query_heads, num_kv_heads, head_dim, p.scale, window};
  std::vector<float> want(got.size());
  std::vector<AttentionInput> inputs;
  for (const Chunk& c : chunks) {
    inputs.push_back(cache.Segments(c.slot, layer, c.first_position + c.num_queries, true));
  }
  std::vector<AttentionJob> jobs;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t row = sequences[i].first_row;
    jobs.push_back(AttentionJob{queries.data() + row * q_width, want.data() + row * q_width,
                                chunks[i].num_queries, chunks[i].first_position, &inputs[i]});
  }
  ThreadPool pool(2);
  RunAttention(shape, jobs, pool);
  const double error = RelativeError(got, want);
  EXPECT_LT(error, kAttentionTolerance)
      << "head_dim " << head_dim << " group " << group << " window " << window;
  ::testing::Test::RecordProperty("relative_error_h" + std::to_string(head_dim) + "_g" +
                                      std::to_string(group) + "_" + std::to_string(chunks.size()) +
                                      "_w" + std::to_string(window),
                                  std::to_string(error));
}

TEST(CudaPrefillAttentionTest, FreshPromptLlama3Shape) {
  SKV_SKIP_WITHOUT_GPU();
  CheckPrefill(128, 4, {{0, 0, 300}});
}

TEST(CudaPrefillAttentionTest, LaterChunkSeesTheCachedPrefix) {
  SKV_SKIP_WITHOUT_GPU();
  CheckPrefill(128, 4, {{1, 700, 129}});
  CheckPrefill(64, 2, {{1, 64, 64}});
}

TEST(CudaPrefillAttentionTest, SequencesOfDifferentLengthsInOneLaunch) {
  SKV_SKIP_WITHOUT_GPU();
  CheckPrefill(64, 3, {{2, 0, 5}, {0, 333, 200}, {3, 1000, 17}});
}

// Head dims 16 and 32 (the tiny Phi-3, GLM-4 and Gemma 3 models'), 96 (Phi-3-mini's) and 256
// (Gemma 3's, 16-row warps and 32-key tiles) on the mma.sync kernel.
TEST(CudaPrefillAttentionTest, OtherHeadDims) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {16, 32, 96, 256}) {
    CheckPrefill(head_dim, 2, {{0, 0, 40}});
    CheckPrefill(head_dim, 4, {{2, 0, 5}, {0, 333, 200}, {3, 1000, 17}});
  }
}

// Sliding windows of 8 (the tiny Gemma 3 model's), 64 (one or two tiles), 100 and 700, over fresh
// prompts and later chunks whose first tiles no row sees; every head dim (128 is the wgmma
// kernel on sm_90a).
TEST(CudaPrefillAttentionTest, SlidingWindow) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {16, 32, 64, 96, 128, 256}) {
    for (int window : {8, 64, 100, 700}) {
      CheckPrefill(head_dim, 2, {{0, 0, 300}}, window);
      CheckPrefill(head_dim, 3, {{2, 0, 5}, {0, 333, 200}, {3, 900, 150}}, window);
    }
  }
  CheckPrefill(128, 8, {{1, 700, 129}}, 100);
}

TEST(CudaPrefillAttentionTest, EveryGroupSize) {
  SKV_SKIP_WITHOUT_GPU();
  for (int group = 1; group <= 8; ++group) {
    CheckPrefill(128, group, {{0, 0, 77}, {1, 100, 31}});
    CheckPrefill(64, group, {{0, 10, 90}});
  }
}

// Llama-3-8B prefill attention of one layer (8 KV heads, 32 query heads, head dim 128): the last
// 4096-query chunk of a 32K and of a 122K prompt, and a fresh 4096-token prompt.
// Causal FLOP: 4 * head_dim * query heads * visible keys, summed over the queries. Timing only;
// SKV_GPU_BENCH=1 enables it.
TEST(CudaPrefillAttentionBench, ChunkThroughput) {
  SKV_SKIP_WITHOUT_GPU();
  if (std::getenv("SKV_GPU_BENCH") == nullptr) GTEST_SKIP() << "set SKV_GPU_BENCH=1 to run";
  const int num_kv_heads = 8, num_query_heads = 32, head_dim = 128, chunk = 4096;
  const int64_t capacity = 124928;
  KvCacheView view;
  view.num_slots = 1;
  view.num_layers = 1;
  view.num_kv_heads = num_kv_heads;
  view.head_dim = head_dim;
  view.capacity = capacity;
  const int64_t count = view.HeadOffset(1, 0, 0);
  DeviceBuffer<__nv_bfloat16> keys, values, queries, out;
  ASSERT_TRUE(keys.Allocate(count).ok());
  ASSERT_TRUE(values.Allocate(count).ok());
  ASSERT_TRUE(queries.Allocate(int64_t{chunk} * num_query_heads * head_dim).ok());
  ASSERT_TRUE(out.Allocate(int64_t{chunk} * num_query_heads * head_dim).ok());
  SKV_ASSERT_CUDA(LaunchFillRandom({keys.get(), count, 1.0f, 11}, nullptr));
  SKV_ASSERT_CUDA(LaunchFillRandom({values.get(), count, 1.0f, 12}, nullptr));
  SKV_ASSERT_CUDA(LaunchFillRandom({queries.get(), queries.size(), 1.0f, 13}, nullptr));
  view.keys = keys.get();
  view.values = values.get();
  for (const int first_position : {0, 32768 - chunk, static_cast<int>(capacity) - chunk}) {
    auto sequences = ToDevice(std::vector<PrefillSequence>{{0, chunk, first_position, 0}});
    double flop = 0;
    for (int i = 0; i < chunk; ++i) flop += 4.0 * head_dim * num_query_heads * (first_position + i + 1);
    PrefillAttentionParams p;
    p.queries = queries.get();
    p.cache = view;
    p.sequences = sequences.get();
    p.num_sequences = 1;
    p.max_queries = chunk;
    p.out = out.get();
    p.num_query_heads = num_query_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_dim = head_dim;
    p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    SKV_ASSERT_CUDA(LaunchPrefillAttention(p, nullptr));
    SKV_ASSERT_CUDA(cudaDeviceSynchronize());
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<float> times;
    for (int i = 0; i < 5; ++i) {
      cudaEventRecord(start);
      LaunchPrefillAttention(p, nullptr);
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      times.push_back(ms);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::sort(times.begin(), times.end());
    const double ms = times[times.size() / 2];
    std::printf("[bench] prefill chunk of %d at position %d: %.3f ms = %.0f TFLOP/s\n",
                chunk, first_position, ms, flop / ms / 1e9);
  }
  SKV_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace shadowkv::cuda
