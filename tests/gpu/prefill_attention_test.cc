// GPU causal flash prefill attention against the CPU attention op: fresh prompts and later chunks
// (a cached prefix), several sequences in one launch, GQA groups that do and do not divide the
// 64-row tile, head dims 64 and 128.
#include "ops/cuda/prefill_attention.cuh"

#include "attention_test_util.h"
#include "ops/cpu/attention.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

struct Chunk {
  int slot;
  int first_position;
  int num_queries;
};

void CheckPrefill(int head_dim, int group, const std::vector<Chunk>& chunks) {
  std::mt19937 rng(head_dim * 100 + group + static_cast<int>(chunks.size()));
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
  SKV_ASSERT_CUDA(LaunchPrefillAttention(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);

  const AttentionShape shape{num_query_heads, num_kv_heads, head_dim, p.scale};
  std::vector<float> want(got.size());
  std::vector<kv::AttentionInput> inputs;
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
  EXPECT_LT(error, kAttentionTolerance) << "head_dim " << head_dim << " group " << group;
  ::testing::Test::RecordProperty("relative_error", std::to_string(error));
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

TEST(CudaPrefillAttentionTest, EveryGroupSize) {
  SKV_SKIP_WITHOUT_GPU();
  for (int group = 1; group <= 8; ++group) {
    CheckPrefill(128, group, {{0, 0, 77}, {1, 100, 31}});
    CheckPrefill(64, group, {{0, 10, 90}});
  }
}

}  // namespace
}  // namespace shadowkv::cuda
