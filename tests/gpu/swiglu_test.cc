// GPU SwiGLU against the CPU op.
#include "ops/cuda/elementwise/swiglu.cuh"

#include "gpu_test_util.h"
#include "ops/cpu/elementwise.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

TEST(CudaSwiGluTest, MatchesCpu) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  const int rows = 3, ffn = 14336;
  const std::vector<float> gate_up = RandomBf16Values(static_cast<int64_t>(rows) * 2 * ffn, rng, 3.0f);
  auto device_in = ToDevice(ToBf16(gate_up));
  auto out = Poisoned<uint16_t>(static_cast<int64_t>(rows) * ffn);
  SwiGluParams p;
  p.gate_up = reinterpret_cast<const __nv_bfloat16*>(device_in.get());
  p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  p.rows = rows;
  p.ffn = ffn;
  SKV_ASSERT_CUDA(LaunchSwiGlu(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);

  std::vector<float> gate(static_cast<size_t>(rows) * ffn), up(gate.size());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < ffn; ++c) {
      gate[static_cast<size_t>(r) * ffn + c] = gate_up[static_cast<size_t>(r) * 2 * ffn + c];
      up[static_cast<size_t>(r) * ffn + c] = gate_up[static_cast<size_t>(r) * 2 * ffn + ffn + c];
    }
  }
  SwiGlu(gate.data(), up.data(), static_cast<int64_t>(gate.size()));
  const double error = RelativeError(got, gate);
  EXPECT_LT(error, kBf16OutputTolerance);
  ::testing::Test::RecordProperty("relative_error", std::to_string(error));
}

}  // namespace
}  // namespace shadowkv::cuda
