// GPU logit soft-cap against the CPU op, and its refusal of a cap that is not positive.
#include "ops/cuda/elementwise/soft_cap.cuh"

#include "gpu_test_util.h"
#include "ops/cpu/elementwise.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

TEST(CudaSoftCapTest, MatchesCpu) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  const int64_t count = 3 * 262144 + 5;
  const std::vector<float> logits = RandomFloats(count, rng, 20.0f);  // many past the cap
  auto device = ToDevice(logits);
  SKV_ASSERT_CUDA(LaunchSoftCap(SoftCapParams{device.get(), count, 30.0f}, nullptr));
  const std::vector<float> got = ToHost(device);
  std::vector<float> want = logits;
  SoftCap(want.data(), count, 30.0f);
  double worst = 0;
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_LE(std::abs(got[i]), 30.0f) << i;
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_LT(worst, 1e-4);  // fp32 tanh on both sides, a few ulp of 30 apart at most
  EXPECT_LT(RelativeError(got, want), 1e-6);
}

TEST(CudaSoftCapTest, RefusesACapThatIsNotPositive) {
  SKV_SKIP_WITHOUT_GPU();
  DeviceBuffer<float> logits;
  ASSERT_TRUE(logits.Allocate(4).ok());
  EXPECT_EQ(LaunchSoftCap(SoftCapParams{logits.get(), 4, 0.0f}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSoftCap(SoftCapParams{logits.get(), 4, -1.0f}, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace shadowkv::cuda
