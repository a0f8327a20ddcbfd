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

// Rounds activations x [n, cols] into out the way the integer kernels see them for weights of
// `weight_type`: block types get 8-bit values per 32-block with an fp16 scale (as QuantMatVec
// and ggml's CPU path do), F16 weights get fp16 activations, F32 weights the values unchanged.
// With this, the GEMM path and the mat-vec path compute the same products up to summation order.
void RoundActivations(gguf::GgmlType weight_type, const float* x, int64_t n, int64_t cols,
                      float* out);

// Dequantises row `row` of w into out[cols].
void DequantRow(const QuantMatrix& w, int64_t row, float* out);

}  // namespace shadowkv
