// Exact fp32 products with block-quantised weights for prefill: weights dequantised per tile.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"
#include "ops/cpu/quant_matmul.h"

namespace shadowkv {

// y [n, rows] = x [n, cols] · Wᵀ with W dequantised exactly to fp32, 64-row tiles per task, each
// multiplied by BLAS (single-threaded inside our pool). For many rows of x (prefill); decode
// rows use QuantMatVec.
void DequantGemm(const QuantMatrix& w, const float* x, int64_t n, float* y, ThreadPool& pool);

// Dequantises row `row` of w into out[cols].
void DequantRow(const QuantMatrix& w, int64_t row, float* out);

}  // namespace shadowkv
