// Mat-vec products with fp32 activations and exactly dequantised block weights (no rounding of
// the activations): the arithmetic of the dequantised model, for decode in "exact" numerics.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"
#include "ops/cpu/quant_matmul.h"

namespace shadowkv {

// y [batch, rows] = x [batch, cols] · Wᵀ, W dequantised exactly (any type DequantizeRow knows;
// AVX2 kernels for Q4_0, Q4_1 and Q8_0). Each output row is computed the same way whatever the
// batch and thread count, so a sequence gets the same result alone or batched.
void ExactMatVec(const QuantMatrix& w, const float* x, int64_t batch, float* y, ThreadPool& pool);

}  // namespace shadowkv
