// RopeTable: the rotary cos/sin of every position a ShadowKV sequence rebuilds keys at.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/rope.h"

namespace shadowkv::kv {

// cos/sin of every rotary frequency at each position [0, num_positions), taken from Rope itself
// so rebuilt keys get bit-for-bit the rotation the model gave the originals, without recomputing
// sin/cos for every rebuilt token.
class RopeTable {
 public:
  RopeTable(const RopeConfig& config, int head_dim)
      : rope_(config),
        head_dim_(head_dim),
        half_(config.rotary_dim / 2),
        pairs_(config.style == RopeConfig::Style::kPairs) {}

  void Extend(int64_t num_positions) {
    if (half_ == 0 || num_positions <= num_positions_) return;
    table_.resize(static_cast<size_t>(num_positions) * 2 * half_);
    std::vector<float> unit(head_dim_);
    for (int64_t p = num_positions_; p < num_positions; ++p) {
      std::fill(unit.begin(), unit.end(), 0.0f);
      for (int i = 0; i < half_; ++i) unit[pairs_ ? 2 * i : i] = 1.0f;
      rope_.Apply(unit.data(), 1, head_dim_, p);  // (1, 0) turns into (cos, sin)
      float* row = table_.data() + p * 2 * half_;
      for (int i = 0; i < half_; ++i) {
        row[i] = unit[pairs_ ? 2 * i : i];
        row[half_ + i] = unit[pairs_ ? 2 * i + 1 : i + half_];
      }
    }
    num_positions_ = num_positions;
  }

  // out = `x` (one head vector, head_dim floats) rotated to `position` (< the extended range).
  void Rotate(const float* x, int64_t position, float* out) const {
    std::memcpy(out, x, head_dim_ * sizeof(float));  // dims past rotary_dim pass through
    const float* cosines = table_.data() + position * 2 * half_;
    const float* sines = cosines + half_;
    for (int i = 0; i < half_; ++i) {
      const int a = pairs_ ? 2 * i : i;
      const int b = pairs_ ? 2 * i + 1 : i + half_;
      out[a] = x[a] * cosines[i] - x[b] * sines[i];
      out[b] = x[a] * sines[i] + x[b] * cosines[i];
    }
  }

  // out = `x` rotated from `position` back to 0 (the inverse of Rotate).
  void Unrotate(const float* x, int64_t position, float* out) const {
    std::memcpy(out, x, head_dim_ * sizeof(float));
    const float* cosines = table_.data() + position * 2 * half_;
    const float* sines = cosines + half_;
    for (int i = 0; i < half_; ++i) {
      const int a = pairs_ ? 2 * i : i;
      const int b = pairs_ ? 2 * i + 1 : i + half_;
      out[a] = x[a] * cosines[i] + x[b] * sines[i];
      out[b] = x[b] * cosines[i] - x[a] * sines[i];
    }
  }

  int64_t bytes() const { return static_cast<int64_t>(table_.size() * sizeof(float)); }

 private:
  Rope rope_;
  int head_dim_;
  int half_;
  bool pairs_;
  int64_t num_positions_ = 0;
  std::vector<float> table_;  // [positions, rotary_dim]: cos of each frequency, then sin
};

}  // namespace shadowkv::kv
