// Row-wise CPU ops of the transformer block: RMSNorm, SwiGLU and GELU-tanh GLU, residual add,
// bias add, the final logit soft-cap.
#pragma once

#include <cstdint>

namespace shadowkv {

// out[r] = x[r] / rms(x[r]) * weight, for `rows` rows of `width` (out may alias x).
void RmsNorm(const float* x, const float* weight, int64_t rows, int width, float eps, float* out);
// gate[i] = silu(gate[i]) * up[i] over `count` values.
void SwiGlu(float* gate, const float* up, int64_t count);
// gate[i] = gelu_tanh(gate[i]) * up[i], GELU's tanh approximation as Gemma's FFN uses it.
void GeluTanhGlu(float* gate, const float* up, int64_t count);
// x[i] = cap * tanh(x[i] / cap) (Gemma's final logit soft-capping); cap <= 0 leaves x alone.
void SoftCap(float* x, int64_t count, float cap);
// x[i] += y[i].
void AddInPlace(float* x, const float* y, int64_t count);
// x[r][c] += bias[c] for `rows` rows of `width`.
void AddBias(float* x, const float* bias, int64_t rows, int width);

}  // namespace shadowkv
