// ExactMatVec against an fp64 dot of the dequantised weights, for every kernel type and batch.
#include "ops/cpu/exact_matvec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "format/quants.h"

namespace shadowkv {
namespace {

void Check(gguf::GgmlType type, int64_t rows, int64_t cols, int64_t batch, int threads) {
  std::mt19937 rng(static_cast<uint32_t>(rows * 31 + cols + batch));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> dense(rows * cols), x(batch * cols);
  for (auto& v : dense) v = normal(rng);
  for (auto& v : x) v = normal(rng);
  // Quantise with the reference quantiser, then compare with the dequantised weights.
  const size_t row_bytes = QuantRowBytes(type, cols);
  std::vector<uint8_t> packed(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_TRUE(gguf::QuantizeRow(type, dense.data() + r * cols, packed.data() + r * row_bytes, cols).ok());
  }
  QuantMatrix w{type, packed.data(), rows, cols, row_bytes};
  std::vector<float> y(batch * rows);
  ThreadPool pool(threads);
  ExactMatVec(w, x.data(), batch, y.data(), pool);
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_TRUE(gguf::DequantizeRow(type, packed.data() + r * row_bytes, row.data(), cols).ok());
    for (int64_t b = 0; b < batch; ++b) {
      double expected = 0, magnitude = 0;
      for (int64_t c = 0; c < cols; ++c) {
        expected += static_cast<double>(row[c]) * x[b * cols + c];
        magnitude += std::abs(static_cast<double>(row[c]) * x[b * cols + c]);
      }
      ASSERT_NEAR(y[b * rows + r], expected, 1e-5 * magnitude + 1e-6)
          << gguf::TypeName(type) << " row " << r << " batch " << b;
    }
  }
}

TEST(ExactMatVecTest, MatchesFp64DotOfDequantisedWeights) {
  for (auto type : {gguf::GgmlType::kQ4_0, gguf::GgmlType::kQ4_1, gguf::GgmlType::kQ8_0,
                    gguf::GgmlType::kF16, gguf::GgmlType::kF32}) {
    for (int64_t batch : {1, 3, 6}) Check(type, 37, 576, batch, 3);
  }
  Check(gguf::GgmlType::kQ4_1, 100, 1536, 2, 1);
}

}  // namespace
}  // namespace shadowkv
