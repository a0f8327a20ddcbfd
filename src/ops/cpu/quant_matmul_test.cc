// Tests of QuantMatVec and QuantizeRowsQ8_0 against fp64 products of independently decoded weights.
#include "ops/cpu/quant_matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace shadowkv {
namespace {

using gguf::GgmlType;

// Decodes a normal or subnormal fp16 bit pattern from its definition (no shared code with the
// library): (-1)^s * 2^(e-15) * (1 + m/1024), or 2^-14 * m/1024 when e == 0.
double DecodeHalf(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 1024.0, -14)
                                         : std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  return (bits & 0x8000) ? -magnitude : magnitude;
}

// A random normal fp16 with magnitude in [2^(min_exp-15), 2^(max_exp-14)) and a random sign.
uint16_t RandomHalf(std::mt19937& rng, int min_exp, int max_exp) {
  const int exponent = std::uniform_int_distribution<int>(min_exp, max_exp)(rng);
  const int mantissa = std::uniform_int_distribution<int>(0, 1023)(rng);
  const int sign = std::uniform_int_distribution<int>(0, 1)(rng);
  return static_cast<uint16_t>((sign << 15) | (exponent << 10) | mantissa);
}

void PutHalf(uint8_t* p, uint16_t bits) { std::memcpy(p, &bits, 2); }
uint16_t GetHalf(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// A random matrix in `type` with `padding` spare bytes after each row, and its values decoded
// element by element from the block definitions.
struct TestMatrix {
  std::vector<uint8_t> bytes;
  std::vector<double> values;   // [rows, cols]
  std::vector<double> offsets;  // [rows, cols / 32]: m (Q4_1), else 0
  QuantMatrix matrix;
};

TestMatrix MakeMatrix(GgmlType type, int64_t rows, int64_t cols, std::mt19937& rng,
                      size_t padding = 6) {
  TestMatrix m;
  const size_t row_bytes = QuantRowBytes(type, cols) + padding;
  m.bytes.assign(rows * row_bytes, 0xee);
  m.values.resize(rows * cols);
  m.offsets.assign(rows * (cols / 32), 0.0);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = m.bytes.data() + r * row_bytes;
    double* values = m.values.data() + r * cols;
    if (type == GgmlType::kF32) {
      std::normal_distribution<float> normal(0.0f, 0.05f);
      for (int64_t c = 0; c < cols; ++c) {
        const float v = normal(rng);
        std::memcpy(row + 4 * c, &v, 4);
        values[c] = v;
      }
      continue;
    }
    if (type == GgmlType::kF16) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t h = RandomHalf(rng, 5, 12);
        PutHalf(row + 2 * c, h);
        values[c] = DecodeHalf(h);
      }
      continue;
    }
    for (int64_t j = 0; j < cols / 32; ++j) {
      double* v = values + 32 * j;
      const uint16_t d_bits = RandomHalf(rng, 5, 10);
      const double d = DecodeHalf(d_bits);
      if (type == GgmlType::kQ8_0) {
        uint8_t* block = row + 34 * j;
        PutHalf(block, d_bits);
        for (int i = 0; i < 32; ++i) {
          block[2 + i] = static_cast<uint8_t>(byte(rng));  // all of -128..127
          v[i] = d * static_cast<int8_t>(block[2 + i]);
        }
        continue;
      }
      const bool has_min = type == GgmlType::kQ4_1;
      uint8_t* block = row + (has_min ? 20 : 18) * j;
      PutHalf(block, d_bits);
      double min = 0.0;
      if (has_min) {
        const uint16_t m_bits = RandomHalf(rng, 8, 12);
        PutHalf(block + 2, m_bits);
        min = DecodeHalf(m_bits);
      }
      m.offsets[r * (cols / 32) + j] = min;
      uint8_t* qs = block + (has_min ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        qs[i] = static_cast<uint8_t>(byte(rng));
        const int low = qs[i] & 0x0f, high = qs[i] >> 4;
        v[i] = has_min ? d * low + min : d * (low - 8);
        v[i + 16] = has_min ? d * high + min : d * (high - 8);
      }
    }
  }
  m.matrix = {type, m.bytes.data(), rows, cols, row_bytes};
  return m;
}

// Activations with spread-out magnitudes; one block of the second vector is all zeros (scale 0).
std::vector<float> MakeActivations(int64_t batch, int64_t cols, std::mt19937& rng) {
  std::vector<float> x(batch * cols);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < cols / 32; ++j) {
      const float block_scale = std::exp(log_scale(rng));
      for (int i = 0; i < 32; ++i) x[b * cols + 32 * j + i] = block_scale * normal(rng);
    }
  }
  if (batch > 1 && cols >= 64) std::fill_n(x.begin() + cols + 32, 32, 0.0f);
  return x;
}

struct Reference {
  std::vector<double> y;          // [batch, rows] fp64 product of the decoded weights
  std::vector<double> magnitude;  // [batch, rows] sum |w| |x|
  std::vector<double> bound;      // [batch, rows] worst error of 8-bit activations
};

// The kernels round each 32-block of x to q * s with step s = max|x_block| / 127 and q =
// round(x / s), then keep s as fp16 (ggml's Q8_0/Q8_1 activation layout). With s' = fp16(s),
// |s' - s| <= s * 2^-11, so an element moves by at most s / 2 + 127 * s * 2^-11. For Q4_1 the
// block sum is fp16(s * sum q) (Q8_1's), so the term m * sum differs from m * s' * sum q by at
// most |m| * 2^-10 * s * |sum q| <= |m| * 2^-10 * (sum |x| + 16 s).
Reference ComputeReference(const TestMatrix& m, const std::vector<float>& x, int64_t batch) {
  const int64_t rows = m.matrix.rows, cols = m.matrix.cols;
  const int64_t num_blocks = cols / 32;
  Reference ref;
  ref.y.assign(batch * rows, 0.0);
  ref.magnitude.assign(batch * rows, 0.0);
  ref.bound.assign(batch * rows, 0.0);
  std::vector<double> element_error(cols);    // worst movement of each rounded element
  std::vector<double> sum_error(num_blocks);  // worst error of s' * sum q, per unit offset
  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = x.data() + b * cols;
    for (int64_t c = 0; c < cols; c += 32) {
      double max_abs = 0.0, sum_abs = 0.0;
      for (int i = 0; i < 32 && c + i < cols; ++i) {
        max_abs = std::max<double>(max_abs, std::fabs(xb[c + i]));
        sum_abs += std::fabs(xb[c + i]);
      }
      const double step = max_abs / 127.0;
      for (int i = 0; i < 32 && c + i < cols; ++i) {
        element_error[c + i] = step / 2 + 127 * step * std::ldexp(1.0, -11);
      }
      if (c / 32 < num_blocks) sum_error[c / 32] = std::ldexp(1.0, -10) * (sum_abs + 16 * step);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const double* w = m.values.data() + r * cols;
      double y = 0.0, magnitude = 0.0, bound = 0.0;
      for (int64_t c = 0; c < cols; ++c) {
        y += w[c] * xb[c];
        magnitude += std::fabs(w[c] * xb[c]);
        bound += std::fabs(w[c]) * element_error[c];
      }
      if (m.matrix.type == GgmlType::kQ4_1) {
        for (int64_t j = 0; j < num_blocks; ++j) {
          bound += std::fabs(m.offsets[r * num_blocks + j]) * sum_error[j];
        }
      }
      ref.y[b * rows + r] = y;
      ref.magnitude[b * rows + r] = magnitude;
      ref.bound[b * rows + r] = bound;
    }
  }
  return ref;
}

std::vector<float> MatVec(const QuantMatrix& w, const std::vector<float>& x, int64_t batch,
                          int threads, CpuIsa isa) {
  // More threads than this machine may have cores: the split, not the speed, is under test.
  static ThreadPool one_thread(1), two_threads(2), three_threads(3);
  ThreadPool& pool = threads == 1 ? one_thread : threads == 2 ? two_threads : three_threads;
  std::vector<float> y(batch * w.rows, std::nanf(""));
  QuantMatVec(w, x.data(), batch, y.data(), pool, isa);
  return y;
}

class QuantMatVecTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(QuantMatVecTest, MatchesFp64WithinActivationRounding) {
  const GgmlType type = GetParam();
  const bool is_float = type == GgmlType::kF32 || type == GgmlType::kF16;
  const bool have_avx2 = CpuIsaAvailable(CpuIsa::kAvx2);
  std::mt19937 rng(1234 + static_cast<int>(type));
  double ratio_total = 0.0;
  int64_t ratio_count = 0;
  for (int64_t cols : {576, 1536, 4096}) {
    for (int64_t rows : {1, 7, 37, 301}) {
      const TestMatrix m = MakeMatrix(type, rows, cols, rng);
      // 1..8 fit one tile of activations; 11 takes a tile of 8 and one of 3 per row.
      for (int64_t batch : {1, 2, 3, 4, 5, 6, 7, 8, 11}) {
        SCOPED_TRACE(testing::Message()
                     << "cols " << cols << " rows " << rows << " batch " << batch);
        const std::vector<float> x = MakeActivations(batch, cols, rng);
        const Reference ref = ComputeReference(m, x, batch);
        const std::vector<float> scalar = MatVec(m.matrix, x, batch, 1, CpuIsa::kScalar);
        EXPECT_EQ(MatVec(m.matrix, x, batch, 3, CpuIsa::kScalar), scalar);
        std::vector<float> avx2;
        if (have_avx2) {
          avx2 = MatVec(m.matrix, x, batch, 1, CpuIsa::kAvx2);
          // Rows are computed the same way whichever thread runs them.
          EXPECT_EQ(MatVec(m.matrix, x, batch, 3, CpuIsa::kAvx2), avx2);
        }
        for (int64_t i = 0; i < batch * rows; ++i) {
          // fp32 accumulation error, well above what a few thousand terms produce.
          const double rounding = 1e-5 * ref.magnitude[i] + 1e-30;
          const double allowed = is_float ? rounding : ref.bound[i] * (1 + 1e-4) + rounding;
          const double error = std::fabs(scalar[i] - ref.y[i]);
          ASSERT_LE(error, allowed)
              << "output " << i << " scalar " << scalar[i] << " want " << ref.y[i];
          if (!is_float) {
            ratio_total += error / ref.bound[i];
            ++ratio_count;
          }
          if (have_avx2) {
            // Same integer block dots; only the order of fp32 sums differs.
            ASSERT_LE(std::fabs(avx2[i] - scalar[i]), rounding) << "output " << i;
          }
        }
      }
    }
  }
  if (ratio_count > 0) {
    // Rounding errors of independent elements mostly cancel; the worst case is far from typical.
    EXPECT_LT(ratio_total / ratio_count, 0.2);
  }
}

// With integer activations whose block maximum is 127, 8-bit rounding is exact, so the
// product must equal the fp64 one up to fp32 rounding: this isolates weight decoding.
TEST_P(QuantMatVecTest, ExactWhenActivationsAreRepresentable) {
  const GgmlType type = GetParam();
  std::mt19937 rng(99);
  const int64_t rows = 19, cols = 576, batch = 3;
  const TestMatrix m = MakeMatrix(type, rows, cols, rng);
  std::vector<float> x(batch * cols);
  std::uniform_int_distribution<int> value(-127, 127);
  for (int64_t i = 0; i < batch * cols; ++i)
    x[i] = (i % 32 == 5) ? (i % 64 < 32 ? 127 : -127) : value(rng);
  const Reference ref = ComputeReference(m, x, batch);
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2}) {
    if (!CpuIsaAvailable(isa)) continue;
    const std::vector<float> y = MatVec(m.matrix, x, batch, 2, isa);
    for (int64_t i = 0; i < batch * rows; ++i) {
      EXPECT_NEAR(y[i], ref.y[i], 2e-6 * ref.magnitude[i]) << "isa " << static_cast<int>(isa);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, QuantMatVecTest,
                         ::testing::Values(GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0,
                                           GgmlType::kF16, GgmlType::kF32),
                         [](const auto& info) {
                           switch (info.param) {
                             case GgmlType::kQ4_0:
                               return std::string("Q4_0");
                             case GgmlType::kQ4_1:
                               return std::string("Q4_1");
                             case GgmlType::kQ8_0:
                               return std::string("Q8_0");
                             case GgmlType::kF16:
                               return std::string("F16");
                             default:
                               return std::string("F32");
                           }
                         });

TEST(QuantMatVecCaseTest, RoundsActivationsToNearestEven) {
  // One Q8_0 block with d = 1 and all weights 1: y is the sum of the rounded activations.
  // max|x| = 127 gives an activation step of exactly 1.
  std::vector<uint8_t> block(34, 1);
  PutHalf(block.data(), 0x3c00);
  std::vector<float> x(32, 0.0f);
  const float values[] = {127.0f, 0.5f, 1.5f, 2.5f, -3.5f, -0.4f, 0.6f, -126.5f};
  std::copy(std::begin(values), std::end(values), x.begin());
  // Rounded: 127 + 0 + 2 + 2 - 4 + 0 + 1 - 126 = 2.
  const QuantMatrix w{GgmlType::kQ8_0, block.data(), 1, 32, 34};
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2}) {
    if (!CpuIsaAvailable(isa)) continue;
    EXPECT_EQ(MatVec(w, x, 1, 1, isa), std::vector<float>{2.0f});
  }
}

TEST(QuantMatVecCaseTest, DecodesF16Constants) {
  // x is the identity, so y[b] is weight b: 1, -2, the largest fp16, the smallest subnormal, 1/3.
  const uint16_t halves[] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x3555, 0x3c00, 0x3c00,
                             0x3c00, 0x3c00, 0x3c00, 0x3c00, 0x4000, 0x0400};
  const float expected[] = {
      1.0f, -2.0f, 65504.0f, 5.9604644775390625e-8f, 0.333251953125f, 1, 1, 1, 1,
      1,    1,     2,        6.103515625e-5f};
  const int64_t cols = 13;
  std::vector<uint8_t> bytes(2 * cols);
  std::memcpy(bytes.data(), halves, sizeof(halves));
  std::vector<float> x(cols * cols, 0.0f);
  for (int64_t i = 0; i < cols; ++i) x[i * cols + i] = 1.0f;
  const QuantMatrix w{GgmlType::kF16, bytes.data(), 1, cols, bytes.size()};
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2}) {
    if (!CpuIsaAvailable(isa)) continue;
    const std::vector<float> y = MatVec(w, x, cols, 1, isa);
    for (int64_t i = 0; i < cols; ++i) EXPECT_EQ(y[i], expected[i]) << i;
  }
}

TEST(QuantizeRowsQ8_0Test, HandComputedBlock) {
  // w_i = i / 2: max 15.5, d = 15.5 / 127 = 0.12205 -> fp16 0x2fd0 = 0.1220703125,
  // q_i = round(i / 2 / 0.1220703125) = round(4.096 i).
  std::vector<float> w(64, 0.0f);
  for (int i = 0; i < 32; ++i) w[i] = 0.5f * i;
  const std::vector<uint8_t> q = QuantizeRowsQ8_0(w.data(), 2, 32);  // second row all zeros
  ASSERT_EQ(q.size(), 68u);
  EXPECT_EQ(GetHalf(q.data()), 0x2fd0);
  const auto at = [&](int i) { return static_cast<int8_t>(q[2 + i]); };
  EXPECT_EQ(at(0), 0);
  EXPECT_EQ(at(1), 4);
  EXPECT_EQ(at(10), 41);
  EXPECT_EQ(at(16), 66);
  EXPECT_EQ(at(31), 127);
  EXPECT_EQ(GetHalf(q.data() + 34), 0);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q[36 + i], 0) << i;
}

TEST(QuantizeRowsQ8_0Test, ReconstructsWithinHalfAStep) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const int64_t rows = 5, cols = 1536;
  std::vector<float> w(rows * cols);
  for (float& v : w) v = normal(rng);
  w[3] = -0.5f;  // a negative maximum
  const std::vector<uint8_t> q = QuantizeRowsQ8_0(w.data(), rows, cols);
  ASSERT_EQ(q.size(), static_cast<size_t>(rows * cols / 32 * 34));
  for (int64_t block = 0; block < rows * cols / 32; ++block) {
    const uint8_t* bytes = q.data() + 34 * block;
    const double d = DecodeHalf(GetHalf(bytes));
    double max_abs = 0.0;
    for (int i = 0; i < 32; ++i) max_abs = std::max<double>(max_abs, std::fabs(w[32 * block + i]));
    EXPECT_NEAR(d, max_abs / 127, max_abs / 127 * std::ldexp(1.0, -11));
    for (int i = 0; i < 32; ++i) {
      const int8_t qi = static_cast<int8_t>(bytes[2 + i]);
      EXPECT_GE(qi, -127);
      EXPECT_LE(std::fabs(d * qi - w[32 * block + i]), d / 2 * (1 + 1e-6));
    }
  }
}

}  // namespace
}  // namespace shadowkv
