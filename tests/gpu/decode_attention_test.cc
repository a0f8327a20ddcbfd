// GPU split-KV decode attention against the CPU attention op: head dims 64/128, GQA groups 1-8,
// one split or many, sequences of different lengths in one launch.
#include "ops/cuda/decode_attention.cuh"

#include "attention_test_util.h"
#include "ops/cpu/attention.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

void CheckDecode(int head_dim, int group, int num_splits) {
  std::mt19937 rng(head_dim * 1000 + group * 10 + num_splits);
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
  SKV_ASSERT_CUDA(LaunchDecodeAttention(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);

  const AttentionShape shape{num_query_heads, num_kv_heads, head_dim, p.scale};
  std::vector<float> want(got.size());
  std::vector<kv::AttentionInput> inputs;
  for (int r = 0; r < rows; ++r) {
    inputs.push_back(cache.Segments(slots[r], layer, positions[r] + 1, false));
  }
  std::vector<AttentionJob> jobs;
  for (int r = 0; r < rows; ++r) {
    jobs.push_back(AttentionJob{queries.data() + static_cast<int64_t>(r) * q_width,
                                want.data() + static_cast<int64_t>(r) * q_width, 1, positions[r],
                                &inputs[r]});
  }
  ThreadPool pool(2);
  RunAttention(shape, jobs, pool);
  const double error = RelativeError(got, want);
  EXPECT_LT(error, kAttentionTolerance) << "head_dim " << head_dim << " group " << group
                                        << " splits " << num_splits;
  ::testing::Test::RecordProperty("relative_error", std::to_string(error));
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
  for (int head_dim : {64, 128}) {
    for (int group = 1; group <= 8; ++group) CheckDecode(head_dim, group, 16);
  }
}

TEST(CudaDecodeAttentionTest, SplitCountDoesNotDependOnLengths) {
  EXPECT_EQ(DecodeNumSplits(1, 8, 1056), kDecodeMaxSplits);
  EXPECT_EQ(DecodeNumSplits(7, 8, 1056), 19);
  EXPECT_EQ(DecodeNumSplits(200, 8, 1056), 1);
}

}  // namespace
}  // namespace shadowkv::cuda
