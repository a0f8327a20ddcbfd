// Row-wise CPU ops; fp32 throughout, sums of squares in fp64 for stable norms.
#include "ops/cpu/elementwise.h"

#include <cmath>

namespace shadowkv {

void RmsNorm(const float* x, const float* weight, int64_t rows, int width, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * width;
    float* o = out + r * width;
    double sum = 0.0;
    for (int c = 0; c < width; ++c) sum += static_cast<double>(in[c]) * in[c];
    const float scale = static_cast<float>(1.0 / std::sqrt(sum / width + eps));
    for (int c = 0; c < width; ++c) o[c] = in[c] * scale * weight[c];
  }
}

void SwiGlu(float* gate, const float* up, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void GeluTanhGlu(float* gate, const float* up, int64_t count) {
  const float k = std::sqrt(2.0f / 3.14159265358979323846f);
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    gate[i] = 0.5f * g * (1.0f + std::tanh(k * (g + 0.044715f * g * g * g))) * up[i];
  }
}

void SoftCap(float* x, int64_t count, float cap) {
  if (cap <= 0.0f) return;
  for (int64_t i = 0; i < count; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

void AddInPlace(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

void AddBias(float* x, const float* bias, int64_t rows, int width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < width; ++c) x[r * width + c] += bias[c];
}

}  // namespace shadowkv
