// Rng: a seeded generator whose every draw is fully specified (SplitMix64 plus rejection
// sampling), so a task synthesised from a seed is the same text on every platform and library.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace shadowkv::eval {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound); bound > 0.
  uint64_t Below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x = Next();
    while (x >= limit) x = Next();
    return x % bound;
  }
  // Uniform in [low, high], inclusive.
  int64_t Range(int64_t low, int64_t high) {
    return low + static_cast<int64_t>(Below(static_cast<uint64_t>(high - low) + 1));
  }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }

  template <class T>
  void Shuffle(std::vector<T>& items) {
    for (size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[Below(i)]);
  }
  // `count` distinct indices of [0, population), in draw order (count <= population).
  std::vector<int64_t> Distinct(int64_t population, int64_t count) {
    std::vector<int64_t> all(population);
    for (int64_t i = 0; i < population; ++i) all[i] = i;
    for (int64_t i = 0; i < count; ++i) std::swap(all[i], all[i + Range(0, population - 1 - i)]);
    all.resize(count);
    return all;
  }

 private:
  uint64_t state_;
};

// A seed for one purpose: mixes a base seed with a tag and two numbers (FNV-1a, then SplitMix).
inline uint64_t DeriveSeed(uint64_t seed, std::string_view tag, uint64_t a = 0, uint64_t b = 0) {
  uint64_t h = 0xCBF29CE484222325ull ^ seed;
  for (char c : tag) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  Rng mix(h ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full));
  mix.Next();
  return mix.Next();
}

}  // namespace shadowkv::eval
