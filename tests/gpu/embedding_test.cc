// GPU embedding lookup against the CPU op (DequantRow of a BF16 table, then the CPU model's fp32
// multiply by the embedding scale): exact.
#include "ops/cuda/elementwise/embedding.cuh"

#include "gpu_test_util.h"
#include "ops/cpu/gemm.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

void CheckLookup(float scale) {
  std::mt19937 rng(11);
  const int vocab = 1000, hidden = 320;
  const std::vector<float> table = RandomBf16Values(static_cast<int64_t>(vocab) * hidden, rng);
  const std::vector<uint16_t> table_bf16 = ToBf16(table);
  const std::vector<int32_t> tokens = {0, 999, 17, 17, 512, 3, 998};
  auto device_table = ToDevice(table_bf16);
  auto device_tokens = ToDevice(tokens);
  auto out = Poisoned<float>(static_cast<int64_t>(tokens.size()) * hidden);

  EmbeddingParams p;
  p.tokens = device_tokens.get();
  p.table = reinterpret_cast<const __nv_bfloat16*>(device_table.get());
  p.out = out.get();
  p.rows = static_cast<int>(tokens.size());
  p.hidden = hidden;
  p.scale = scale;
  SKV_ASSERT_CUDA(LaunchEmbedding(p, nullptr));
  const std::vector<float> got = ToHost(out);

  QuantMatrix matrix{gguf::GgmlType::kBF16, reinterpret_cast<const uint8_t*>(table_bf16.data()),
                     vocab, hidden, static_cast<size_t>(hidden) * 2};
  std::vector<float> want(got.size());
  for (size_t r = 0; r < tokens.size(); ++r) DequantRow(matrix, tokens[r], want.data() + r * hidden);
  if (scale != 1.0f) {
    for (float& value : want) value *= scale;
  }
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
}

TEST(CudaEmbeddingTest, RowsMatchTheCpuLookupExactly) {
  SKV_SKIP_WITHOUT_GPU();
  CheckLookup(1.0f);
}

// Gemma's sqrt(hidden) scale, applied in fp32 as the CPU model applies it.
TEST(CudaEmbeddingTest, ScaledRowsMatchTheCpuExactly) {
  SKV_SKIP_WITHOUT_GPU();
  CheckLookup(std::sqrt(320.0f));
}

}  // namespace
}  // namespace shadowkv::cuda
