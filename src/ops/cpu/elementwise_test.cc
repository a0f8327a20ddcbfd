// GELU-tanh GLU and the logit soft-cap against values of their formulas worked out in fp64.
#include "ops/cpu/elementwise.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace shadowkv {
namespace {

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in fp64, times up.
TEST(ElementwiseTest, GeluTanhGluIsTheTanhApproximationTimesUp) {
  std::vector<float> gate = {1.0f, -1.0f, 3.0f, -2.5f, 0.25f, 0.0f};
  const std::vector<float> up = {1.0f, 2.0f, -1.0f, 4.0f, 0.5f, 7.0f};
  const std::vector<double> want = {0.8411919906082768,      -2 * 0.15880800939172324,
                                    -2.996362607918227,      4 * -0.015084266089998577,
                                    0.5 * 0.149675350701685, 0.0};
  GeluTanhGlu(gate.data(), up.data(), static_cast<int64_t>(gate.size()));
  for (size_t i = 0; i < gate.size(); ++i) EXPECT_NEAR(gate[i], want[i], 2e-6) << i;
  // Not the erf form: GELU(1) = 0.8413447460685429 there.
  EXPECT_GT(std::abs(0.8413447460685429 - gate[0]), 1e-4);
}

TEST(ElementwiseTest, SoftCapBoundsByTheCapAndZeroLeavesValuesAlone) {
  std::vector<float> x = {1.0f, 30.0f, -100.0f, 0.0f};
  SoftCap(x.data(), static_cast<int64_t>(x.size()), 8.0f);
  const std::vector<double> want = {0.9948240141727696, 7.991155541809222, -7.999999999777793, 0.0};
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], want[i], 2e-6) << i;
  std::vector<float> same = {1.0f, 30.0f, -100.0f};
  SoftCap(same.data(), static_cast<int64_t>(same.size()), 0.0f);
  EXPECT_EQ(same, (std::vector<float>{1.0f, 30.0f, -100.0f}));
}

}  // namespace
}  // namespace shadowkv
