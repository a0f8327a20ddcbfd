// ExactMatVec: nibbles/int8 widened to fp32 in registers, FMA with the activations, per-block
// scale (and Q4_1 offset through the block sum of x).
#include "ops/cpu/exact_matvec.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "ops/cpu/gemm.h"

namespace shadowkv {
namespace {

using gguf::GgmlType;
constexpr int kBlock = 32;
constexpr int64_t kRowsPerTask = 16;
constexpr int kMaxBatchTile = 4;

float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of a block as integers in 4 x 8 fp32 lanes (element order), its scale d and
// offset m (w = d * q + m).
template <GgmlType kType>
inline void LoadBlock(const uint8_t* block, __m256 q[4], float* d, float* m) {
  uint16_t half;
  std::memcpy(&half, block, 2);
  *d = Fp16ToFp32(half);
  if constexpr (kType == GgmlType::kQ8_0) {
    *m = 0.0f;
    for (int i = 0; i < 4; ++i) {
      __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    return;
  } else {
    const uint8_t* nibbles = block + (kType == GgmlType::kQ4_1 ? 4 : 2);
    if constexpr (kType == GgmlType::kQ4_1) {
      std::memcpy(&half, block + 2, 2);
      *m = Fp16ToFp32(half);
    } else {
      *m = -8.0f * *d;  // Q4_0: w = d * (q - 8)
    }
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask);                     // elements 0..15
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // elements 16..31
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
  }
}

// Rows [row_begin, row_end) for up to kMaxBatchTile activation vectors at a time.
template <GgmlType kType>
void BlockRows(const QuantMatrix& w, const float* x, const float* block_sums, int64_t batch,
               int64_t row_begin, int64_t row_end, float* y) {
  const int64_t blocks = w.cols / kBlock;
  const size_t block_bytes = w.row_bytes / blocks;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.data + r * w.row_bytes;
    for (int64_t b0 = 0; b0 < batch; b0 += kMaxBatchTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kMaxBatchTile, batch - b0));
      __m256 acc[kMaxBatchTile];
      float offset_acc[kMaxBatchTile] = {0, 0, 0, 0};
      for (int b = 0; b < tile; ++b) acc[b] = _mm256_setzero_ps();
      for (int64_t j = 0; j < blocks; ++j) {
        __m256 q[4];
        float d, m;
        LoadBlock<kType>(row + j * block_bytes, q, &d, &m);
        const __m256 scale = _mm256_set1_ps(d);
        for (int b = 0; b < tile; ++b) {
          const float* xb = x + (b0 + b) * w.cols + j * kBlock;
          __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
          dot = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), dot);
          dot = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), dot);
          dot = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), dot);
          acc[b] = _mm256_fmadd_ps(dot, scale, acc[b]);
          offset_acc[b] += m * block_sums[(b0 + b) * blocks + j];
        }
      }
      for (int b = 0; b < tile; ++b) {
        y[(b0 + b) * w.rows + r] = HorizontalSum(acc[b]) + offset_acc[b];
      }
    }
  }
}

// Any other type: dequantise a row, then fp32 dots.
void GenericRows(const QuantMatrix& w, const float* x, int64_t batch, int64_t row_begin,
                 int64_t row_end, float* y) {
  thread_local std::vector<float> dense;
  dense.resize(w.cols);
  for (int64_t r = row_begin; r < row_end; ++r) {
    DequantRow(w, r, dense.data());
    for (int64_t b = 0; b < batch; ++b) {
      const float* xb = x + b * w.cols;
      __m256 acc = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 8 <= w.cols; c += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(dense.data() + c), _mm256_loadu_ps(xb + c), acc);
      }
      float sum = HorizontalSum(acc);
      for (; c < w.cols; ++c) sum += dense[c] * xb[c];
      y[b * w.rows + r] = sum;
    }
  }
}

}  // namespace

void ExactMatVec(const QuantMatrix& w, const float* x, int64_t batch, float* y, ThreadPool& pool) {
  if (batch <= 0 || w.rows <= 0) return;
  const bool blocked = (w.type == GgmlType::kQ4_0 || w.type == GgmlType::kQ4_1 ||
                        w.type == GgmlType::kQ8_0) && w.cols % kBlock == 0;
  // Block sums of x carry the offsets (Q4_0's -8d, Q4_1's m): [batch, blocks].
  thread_local std::vector<float> block_sums;
  std::vector<float>& sums = block_sums;
  if (blocked) {
    const int64_t blocks = w.cols / kBlock;
    sums.assign(batch * blocks, 0.0f);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < blocks; ++j) {
        float s = 0;
        for (int i = 0; i < kBlock; ++i) s += x[b * w.cols + j * kBlock + i];
        sums[b * blocks + j] = s;
      }
  }
  const int64_t tasks = (w.rows + kRowsPerTask - 1) / kRowsPerTask;
  pool.ParallelFor(tasks, 4, [&](int64_t begin, int64_t end, int) {
    const int64_t row_begin = begin * kRowsPerTask;
    const int64_t row_end = std::min(w.rows, end * kRowsPerTask);
    switch (blocked ? w.type : GgmlType::kF32) {
      case GgmlType::kQ4_0:
        return BlockRows<GgmlType::kQ4_0>(w, x, sums.data(), batch, row_begin, row_end, y);
      case GgmlType::kQ4_1:
        return BlockRows<GgmlType::kQ4_1>(w, x, sums.data(), batch, row_begin, row_end, y);
      case GgmlType::kQ8_0:
        return BlockRows<GgmlType::kQ8_0>(w, x, sums.data(), batch, row_begin, row_end, y);
      default:
        return GenericRows(w, x, batch, row_begin, row_end, y);
    }
  });
}

}  // namespace shadowkv
