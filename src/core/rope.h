// Rotary position embedding (RoPE), computed in fp32 at each token's true position.
#pragma once

#include <cstdint>
#include <vector>

namespace shadowkv {

// How a model rotates its query/key vectors.
struct RopeConfig {
  int rotary_dim = 0;       // leading dims of each head that rotate (usually head_dim)
  float theta_base = 10000.0f;
  // kPairs rotates (x[2i], x[2i+1]) (GGUF llama: the converter permuted Q/K for this);
  // kHalves rotates (x[i], x[i + rotary_dim/2]) (qwen2, "neox" layout).
  enum class Style { kPairs, kHalves } style = Style::kPairs;
  float linear_scale = 1.0f;          // positions are divided by this (linear rope scaling)
  std::vector<float> freq_factors;    // [rotary_dim/2] llama3-style per-frequency divisors, or empty
};

// Precomputed inverse frequencies of a RopeConfig.
class Rope {
 public:
  explicit Rope(RopeConfig config);
  const RopeConfig& config() const { return config_; }
  // [rotary_dim / 2] the angle per position of each pair (base^(-2i/d), divided by the
  // frequency factor and the linear scale): what the GPU's rotation kernels take.
  const std::vector<float>& inverse_frequencies() const { return inv_freq_; }

  // Rotates `num_heads` heads of `head_dim` floats laid out contiguously in x, at `position`.
  void Apply(float* x, int num_heads, int head_dim, int64_t position) const;
  // Rotates back (the inverse rotation): used to recover pre-RoPE vectors in tests.
  void Unapply(float* x, int num_heads, int head_dim, int64_t position) const;

 private:
  void Rotate(float* x, int num_heads, int head_dim, int64_t position, float sign) const;
  RopeConfig config_;
  std::vector<float> inv_freq_;  // [rotary_dim/2]
};

}  // namespace shadowkv
