// Rope implementation.
#include "core/rope.h"

#include <cmath>

#include "core/check.h"

namespace shadowkv {

Rope::Rope(RopeConfig config) : config_(std::move(config)) {
  const int half = config_.rotary_dim / 2;
  SKV_CHECK(config_.freq_factors.empty() || static_cast<int>(config_.freq_factors.size()) == half);
  inv_freq_.resize(half);
  for (int i = 0; i < half; ++i) {
    // base^(-2i/d) in double, stored as fp32: the angle itself is then formed in fp32.
    double inv = std::pow(static_cast<double>(config_.theta_base), -2.0 * i / config_.rotary_dim);
    if (!config_.freq_factors.empty()) inv /= config_.freq_factors[i];
    inv_freq_[i] = static_cast<float>(inv / config_.linear_scale);
  }
}

void Rope::Rotate(float* x, int num_heads, int head_dim, int64_t position, float sign) const {
  const int half = config_.rotary_dim / 2;
  const float pos = static_cast<float>(position);
  for (int i = 0; i < half; ++i) {
    const float angle = pos * inv_freq_[i];
    const float c = std::cos(angle);
    const float s = sign * std::sin(angle);
    for (int h = 0; h < num_heads; ++h) {
      float* head = x + static_cast<int64_t>(h) * head_dim;
      float* a;
      float* b;
      if (config_.style == RopeConfig::Style::kPairs) {
        a = head + 2 * i;
        b = head + 2 * i + 1;
      } else {
        a = head + i;
        b = head + i + half;
      }
      const float x0 = *a, x1 = *b;
      *a = x0 * c - x1 * s;
      *b = x0 * s + x1 * c;
    }
  }
}

void Rope::Apply(float* x, int num_heads, int head_dim, int64_t position) const {
  Rotate(x, num_heads, head_dim, position, 1.0f);
}

void Rope::Unapply(float* x, int num_heads, int head_dim, int64_t position) const {
  Rotate(x, num_heads, head_dim, position, -1.0f);
}

}  // namespace shadowkv
