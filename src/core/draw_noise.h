// Counter-based sampling noise shared by the CPU Sampler and the GPU sampling kernel: the noise of
// a draw is a function of (seed, draw, token id) only, so a sequence samples the same tokens
// whether it runs alone or batched, in any row, on either device.
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define SKV_DRAW_HD __host__ __device__ __forceinline__
#else
#define SKV_DRAW_HD inline
#endif

namespace shadowkv {

SKV_DRAW_HD uint64_t Mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The random stream of draw `draw` (0 for a sequence's first new token) under `seed`.
SKV_DRAW_HD uint64_t DrawStream(uint64_t seed, uint64_t draw) { return Mix64(seed ^ Mix64(draw)); }

// Gumbel(0, 1) noise of token `id` in a draw's stream. 23 random bits + 1/2 give u in (0, 1)
// exactly representable, so -log(-log(u)) is finite.
SKV_DRAW_HD float GumbelNoise(uint64_t stream, uint64_t id) {
  const uint64_t bits = Mix64(stream + id) >> 41;
  const float u = (static_cast<float>(bits) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

// A seed of its own for each row of a step that gives all its rows one setting (otherwise every
// row would draw with the same noise).
SKV_DRAW_HD uint64_t RowSeed(uint64_t seed, uint64_t row) {
  return Mix64(seed ^ Mix64(row ^ 0x5851f42d4c957f2dull));
}

}  // namespace shadowkv
