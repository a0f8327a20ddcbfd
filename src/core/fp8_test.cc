#include "core/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace shadowkv {
namespace {

// Every finite e4m3 value, from its definition: (-1)^s · 2^(e-7) · (1 + m/8), subnormals
// 2^-6 · m/8.
double ReferenceDecode(int code) {
  const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                         : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

TEST(Fp8Test, DecodesEveryCodeAndEncodesItBack) {
  for (int code = 0; code < 256; ++code) {
    const float value = Fp8E4m3ToFp32(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(value)) << code;
      EXPECT_EQ(Fp32ToFp8E4m3(value), 0x7f);
      continue;
    }
    EXPECT_EQ(static_cast<double>(value), ReferenceDecode(code)) << code;
    // -0 encodes as 0x80 and 0 as 0x00: both decode to zero.
    EXPECT_EQ(Fp32ToFp8E4m3(value), code) << code;
  }
  EXPECT_EQ(Fp8E4m3ToFp32(0x7e), 448.0f);
}

// The nearest code by exhaustive search over the finite codes, ties to the even code, values
// past 448 saturated: what the encoder must return.
int ReferenceEncode(float value) {
  const double v = std::min(448.0, std::max(-448.0, static_cast<double>(value)));
  int best = 0;
  double best_error = std::numeric_limits<double>::infinity();
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    if ((code & 0x80) != 0 && v >= 0) continue;  // keep the sign of zero: positive side
    if ((code & 0x80) == 0 && v < 0) continue;
    const double error = std::abs(ReferenceDecode(code) - v);
    if (error < best_error || (error == best_error && (code & 1) == 0)) {
      best = code;
      best_error = error;
    }
  }
  return best;
}

TEST(Fp8Test, RoundsToNearestEvenAndSaturates) {
  std::mt19937 rng(7);
  std::vector<float> values = {0.0f,    1e-30f,   0.0009765625f, 0.00097656f, 0.0029296875f,
                               0.015625f, 0.0146484375f, 1.0625f, 1.1875f, 17.0f, 240.0f,
                               447.0f,  448.0f,   463.9f,  464.0f,  1e6f,
                               std::numeric_limits<float>::infinity()};
  // Every midpoint between neighbouring codes, and a hair on each side of it.
  for (int code = 0; code < 0x7e; ++code) {
    const double mid = (ReferenceDecode(code) + ReferenceDecode(code + 1)) / 2;
    values.push_back(static_cast<float>(mid));
    values.push_back(std::nextafter(static_cast<float>(mid), 0.0f));
    values.push_back(std::nextafter(static_cast<float>(mid), 1e9f));
  }
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) values.push_back(std::ldexp(unit(rng), (i % 24) - 12));
  const size_t positive = values.size();
  for (size_t i = 0; i < positive; ++i) values.push_back(-values[i]);
  for (float v : values) {
    if (v == 0.0f) continue;  // -0 and 0 checked above
    EXPECT_EQ(Fp32ToFp8E4m3(v), ReferenceEncode(v)) << v;
  }
}

TEST(Fp8Test, RunsKeepTheirLargestValueAndRelativeErrorWithinTheFormat) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> run(1024);
  for (float& v : run) v = normal(rng);
  run[17] = -25.0f;  // the largest magnitude
  std::vector<uint8_t> codes(run.size());
  const float scale = QuantizeFp8Run(run.data(), static_cast<int64_t>(run.size()), codes.data());
  EXPECT_FLOAT_EQ(scale, 25.0f / 448.0f);
  std::vector<float> back(run.size());
  DequantizeFp8Run(codes.data(), static_cast<int64_t>(codes.size()), scale, back.data());
  EXPECT_FLOAT_EQ(back[17], -25.0f);
  std::vector<float> round_trip = run;
  RoundTripFp8Run(round_trip.data(), static_cast<int64_t>(round_trip.size()));
  for (size_t i = 0; i < run.size(); ++i) {
    EXPECT_EQ(back[i], round_trip[i]) << i;
    // 3 mantissa bits: normal values within 2^-4 relative; subnormals within half a unit.
    const float bound = std::max(std::abs(run[i]) / 16.0f, scale * 0.0009765625f);
    EXPECT_LE(std::abs(back[i] - run[i]), bound * 1.0001f) << i << " " << run[i];
  }
  std::vector<float> zeros(8, 0.0f);
  EXPECT_EQ(QuantizeFp8Run(zeros.data(), 8, codes.data()), 0.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(codes[i], 0);
}

}  // namespace
}  // namespace shadowkv
