// Tests of RoPE: hand-computed rotations for both layouts, inverse, relative-position property.
#include "core/rope.h"

#include <gtest/gtest.h>

#include <cmath>

namespace shadowkv {
namespace {

TEST(RopeTest, PairsLayoutRotatesAdjacentElements) {
  RopeConfig config;
  config.rotary_dim = 4;
  config.theta_base = 100.0f;
  Rope rope(config);
  float x[4] = {1, 0, 0, 1};
  rope.Apply(x, 1, 4, 3);
  // Frequencies: 100^0 = 1 and 100^(-2/4) = 0.1; angles 3 and 0.3.
  EXPECT_NEAR(x[0], std::cos(3.0), 1e-6);
  EXPECT_NEAR(x[1], std::sin(3.0), 1e-6);
  EXPECT_NEAR(x[2], -std::sin(0.3), 1e-6);
  EXPECT_NEAR(x[3], std::cos(0.3), 1e-6);
}

TEST(RopeTest, HalvesLayoutRotatesAcrossHalves) {
  RopeConfig config;
  config.rotary_dim = 4;
  config.theta_base = 100.0f;
  config.style = RopeConfig::Style::kHalves;
  Rope rope(config);
  float x[4] = {1, 1, 0, 0};  // pairs (x0, x2) and (x1, x3)
  rope.Apply(x, 1, 4, 2);
  EXPECT_NEAR(x[0], std::cos(2.0), 1e-6);
  EXPECT_NEAR(x[2], std::sin(2.0), 1e-6);
  EXPECT_NEAR(x[1], std::cos(0.2), 1e-6);
  EXPECT_NEAR(x[3], std::sin(0.2), 1e-6);
}

TEST(RopeTest, FreqFactorsAndLinearScaleDivideFrequencies) {
  RopeConfig config;
  config.rotary_dim = 4;
  config.theta_base = 100.0f;
  config.freq_factors = {2.0f, 4.0f};
  config.linear_scale = 2.0f;
  Rope rope(config);
  float x[4] = {1, 0, 1, 0};
  rope.Apply(x, 1, 4, 8);
  EXPECT_NEAR(x[1], std::sin(8.0 / 2 / 2), 1e-6);
  EXPECT_NEAR(x[3], std::sin(8.0 * 0.1 / 4 / 2), 1e-6);
}

TEST(RopeTest, UnapplyInvertsAndDotDependsOnDistanceOnly) {
  RopeConfig config;
  config.rotary_dim = 8;
  config.theta_base = 10000.0f;
  Rope rope(config);
  float q[8] = {0.3f, -1, 2, 0.5f, 1, 1, -0.7f, 0.2f}, k[8] = {1, 0.4f, -0.2f, 0.9f, 0, 1, 2, -1};
  auto dot_at = [&](int64_t pq, int64_t pk) {
    float a[8], b[8];
    std::copy(q, q + 8, a);
    std::copy(k, k + 8, b);
    rope.Apply(a, 1, 8, pq);
    rope.Apply(b, 1, 8, pk);
    double d = 0;
    for (int i = 0; i < 8; ++i) d += a[i] * b[i];
    return d;
  };
  EXPECT_NEAR(dot_at(10, 7), dot_at(110, 107), 1e-4);
  float y[8];
  std::copy(q, q + 8, y);
  rope.Apply(y, 1, 8, 12345);
  rope.Unapply(y, 1, 8, 12345);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(y[i], q[i], 1e-5);
}

}  // namespace
}  // namespace shadowkv
