// Device-side random weights: in range, uniform moments, the same values for the same seed.
#include "ops/cuda/elementwise/fill_random.cuh"

#include "gpu_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

std::vector<float> Fill(int64_t count, float scale, uint64_t seed) {
  auto out = Poisoned<uint16_t>(count);
  FillRandomParams p;
  p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  p.count = count;
  p.scale = scale;
  p.seed = seed;
  EXPECT_EQ(LaunchFillRandom(p, nullptr), cudaSuccess);
  return ToHostBf16(out);
}

TEST(CudaFillRandomTest, UniformInRangeAndReproducible) {
  SKV_SKIP_WITHOUT_GPU();
  const int64_t count = 1 << 22;
  const float scale = 0.03f;
  const std::vector<float> values = Fill(count, scale, 42);
  double sum = 0.0, sum_squares = 0.0;
  for (float v : values) {
    ASSERT_LE(std::fabs(v), scale * 1.01f);  // bf16 rounding may touch the bound
    sum += v;
    sum_squares += static_cast<double>(v) * v;
  }
  // Uniform on [-a, a): mean 0, variance a²/3; with 4M samples the estimates are tight.
  EXPECT_NEAR(sum / count, 0.0, 1e-4);
  EXPECT_NEAR(sum_squares / count, scale * scale / 3.0, 0.01 * scale * scale / 3.0);
  EXPECT_EQ(Fill(count, scale, 42), values);
  EXPECT_NE(Fill(count, scale, 43), values);
}

}  // namespace
}  // namespace shadowkv::cuda
