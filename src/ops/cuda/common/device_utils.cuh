// Device-side helpers shared by the kernels (.cu files only): bf16 vectors, warp and block sums.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace shadowkv::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// 8 bf16 values (one 16-byte load) to fp32.
__device__ __forceinline__ void Bf16x8ToFloat(const uint4& packed, float* out) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// sin and cos of an fp32 RoPE angle formed as the CPU forms it (position · inv_freq in fp32),
// reduced to about [−π, π] first, so that the fast hardware sincos (absolute error ~4e-7 there)
// stands in for the accurate one, whose slow path large angles (> 1e5) take. The reduction is
// in fp32 with 2π in three parts (Cody-Waite): 6.28125 has 8 significant bits, so the first
// product and difference are exact for angles below 2^24 (RoPE's: position · inv_freq with
// inv_freq <= 1), and the parts after it carry the rest. Against a reduction in fp64, sin and
// cos differ by at most 3e-7 (angles up to 1e6).
__device__ __forceinline__ void RopeSinCos(float angle, float* sine, float* cosine) {
  const float turns = rintf(angle * 0.159154943f);
  float reduced = fmaf(-turns, 6.28125f, angle);
  reduced = fmaf(-turns, 1.93530717e-3f, reduced);
  reduced = fmaf(-turns, 1.02533763e-11f, reduced);
  __sincosf(reduced, sine, cosine);
}

__device__ __forceinline__ float WarpSum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// The warp's first (value, index) pair under `before(a, a_index, b, b_index)`, a strict order
// (e.g. larger value, then lower index), in every lane.
template <typename Before>
__device__ __forceinline__ void WarpArgBest(float& value, int& index, Before before) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (before(other, other_index, value, index)) {
      value = other;
      index = other_index;
    }
  }
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `scratch` holds 32 floats of shared memory; the call contains barriers.
__device__ __forceinline__ float BlockSum(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = WarpSum(value);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  value = lane < num_warps ? scratch[lane] : 0.0f;
  return WarpSum(value);
}

// 2^x by the bare hardware approximation (flush-to-zero), for softmax exponents already scaled
// by log2(e).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace shadowkv::cuda
