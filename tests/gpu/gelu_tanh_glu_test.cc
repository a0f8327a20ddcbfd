// GPU GELU-tanh GLU against the CPU op.
#include "ops/cuda/elementwise/gelu_tanh_glu.cuh"

#include "gpu_test_util.h"
#include "ops/cpu/elementwise.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

void CheckGeluTanhGlu(int rows, int ffn, float spread) {
  std::mt19937 rng(static_cast<uint32_t>(rows * 7 + ffn));
  const std::vector<float> gate_up =
      RandomBf16Values(static_cast<int64_t>(rows) * 2 * ffn, rng, spread);
  auto device_in = ToDevice(ToBf16(gate_up));
  auto out = Poisoned<uint16_t>(static_cast<int64_t>(rows) * ffn);
  GeluTanhGluParams p;
  p.gate_up = reinterpret_cast<const __nv_bfloat16*>(device_in.get());
  p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  p.rows = rows;
  p.ffn = ffn;
  SKV_ASSERT_CUDA(LaunchGeluTanhGlu(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);

  std::vector<float> gate(static_cast<size_t>(rows) * ffn), up(gate.size());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < ffn; ++c) {
      gate[static_cast<size_t>(r) * ffn + c] = gate_up[static_cast<size_t>(r) * 2 * ffn + c];
      up[static_cast<size_t>(r) * ffn + c] = gate_up[static_cast<size_t>(r) * 2 * ffn + ffn + c];
    }
  }
  GeluTanhGlu(gate.data(), up.data(), static_cast<int64_t>(gate.size()));
  const double error = RelativeError(got, gate);
  EXPECT_LT(error, kBf16OutputTolerance) << rows << " x " << ffn;
  ::testing::Test::RecordProperty("relative_error_" + std::to_string(ffn), std::to_string(error));
}

TEST(CudaGeluTanhGluTest, MatchesCpu) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGeluTanhGlu(3, 14336, 3.0f);  // gates far into both tails
  CheckGeluTanhGlu(40, 96, 1.0f);    // the tiny gemma3 model's width
}

// The SwiGLU op is not what it computes: the two differ far beyond the tolerance.
TEST(CudaGeluTanhGluTest, DiffersFromSwiGlu) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const int rows = 2, ffn = 256;
  const std::vector<float> gate_up = RandomBf16Values(int64_t{rows} * 2 * ffn, rng, 2.0f);
  auto device_in = ToDevice(ToBf16(gate_up));
  auto out = Poisoned<uint16_t>(int64_t{rows} * ffn);
  GeluTanhGluParams p{reinterpret_cast<const __nv_bfloat16*>(device_in.get()),
                      reinterpret_cast<__nv_bfloat16*>(out.get()), rows, ffn};
  SKV_ASSERT_CUDA(LaunchGeluTanhGlu(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);
  std::vector<float> gate(int64_t{rows} * ffn), up(gate.size());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < ffn; ++c) {
      gate[r * ffn + c] = gate_up[r * 2 * ffn + c];
      up[r * ffn + c] = gate_up[r * 2 * ffn + ffn + c];
    }
  }
  SwiGlu(gate.data(), up.data(), static_cast<int64_t>(gate.size()));
  EXPECT_GT(RelativeError(got, gate), 10 * kBf16OutputTolerance);
}

}  // namespace
}  // namespace shadowkv::cuda
