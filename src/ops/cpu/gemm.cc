// DequantGemm: tile dequantisation + cblas_sgemm.
#include "ops/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "format/quants.h"

namespace shadowkv {
namespace {
constexpr int64_t kTileRows = 64;
}

void RoundActivations(gguf::GgmlType weight_type, const float* x, int64_t n, int64_t cols,
                      float* out) {
  using gguf::GgmlType;
  const int64_t count = n * cols;
  if (weight_type == GgmlType::kF32) {
    std::copy(x, x + count, out);
    return;
  }
  if (weight_type == GgmlType::kF16) {
    for (int64_t i = 0; i < count; ++i) out[i] = Fp16ToFp32(Fp32ToFp16(x[i]));
    return;
  }
  constexpr int kBlock = 32;
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t end = std::min(count, start + kBlock);
    float max_abs = 0.0f;
    for (int64_t i = start; i < end; ++i) max_abs = std::max(max_abs, std::fabs(x[i]));
    const float inverse = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
    const float scale = Fp16ToFp32(Fp32ToFp16(max_abs / 127.0f));
    for (int64_t i = start; i < end; ++i) {
      const float q = std::fmin(std::fmax(std::nearbyint(x[i] * inverse), -127.0f), 127.0f);
      out[i] = q * scale;
    }
  }
}

void DequantRow(const QuantMatrix& w, int64_t row, float* out) {
  const Status status = gguf::DequantizeRow(w.type, w.data + row * w.row_bytes, out, w.cols);
  SKV_CHECK(status.ok());  // types were checked when the weights were loaded
}

void DequantGemm(const QuantMatrix& w, const float* x, int64_t n, float* y, ThreadPool& pool) {
  const int64_t tiles = (w.rows + kTileRows - 1) / kTileRows;
  pool.ParallelFor(tiles, 1, [&](int64_t begin, int64_t end, int) {
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(kTileRows * w.cols));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * kTileRows;
      const int64_t rows = std::min(kTileRows, w.rows - row0);
      for (int64_t r = 0; r < rows; ++r) DequantRow(w, row0 + r, tile.data() + r * w.cols);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n),
                  static_cast<int>(rows), static_cast<int>(w.cols), 1.0f, x,
                  static_cast<int>(w.cols), tile.data(), static_cast<int>(w.cols), 0.0f, y + row0,
                  static_cast<int>(w.rows));
    }
  });
}

}  // namespace shadowkv
