// Device side of the FP8 e4m3 runs of core/fp8.h: a warp quantises a run with the same rule as
// the CPU (so codes and scales match bit for bit), and the decode paths unpack codes with the
// hardware conversion (exact: every e4m3 value is an fp16 value).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/fp8.h"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {

__device__ __forceinline__ float WarpMax(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// One warp (all 32 lanes) quantises the `count` values load(i) into codes[i] and *scale: the
// run's largest magnitude, then every value (two reads of the source).
template <typename Load>
__device__ __forceinline__ void WarpQuantizeFp8Run(const Load& load, int count, uint8_t* codes,
                                                   float* scale) {
  const int lane = threadIdx.x & 31;
  float amax = 0.0f;
  for (int i = lane; i < count; i += 32) amax = fmaxf(amax, fabsf(load(i)));
  amax = WarpMax(amax);
  const float inverse = Fp8RunInverseScale(amax);
  for (int i = lane; i < count; i += 32) codes[i] = Fp32ToFp8E4m3(load(i) * inverse);
  if (lane == 0) *scale = Fp8RunScale(amax);
}

// Two e4m3 codes (the low 16 bits) → fp16x2, exactly.
__device__ __forceinline__ uint32_t Fp8x2ToHalf2Bits(uint32_t codes) {
  const __half2_raw pair =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(pair.x) | (static_cast<uint32_t>(pair.y) << 16);
}

// Eight codes → eight fp32 values code · scale.
__device__ __forceinline__ void DecodeFp8x8ToFloat(uint2 codes, float scale, float out[8]) {
  const uint32_t words[2] = {codes.x, codes.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t half_bits = Fp8x2ToHalf2Bits(words[i / 2] >> (16 * (i % 2)));
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&half_bits));
    out[2 * i] = f.x * scale;
    out[2 * i + 1] = f.y * scale;
  }
}

// Eight codes → eight bf16 values code · scale, plus base[i] where a base is given (without
// one nothing is added, so a code of -0 stays -0 as on the CPU).
__device__ __forceinline__ uint4 DecodeFp8x8ToBf16(uint2 codes, float scale,
                                                   const float* base = nullptr) {
  float x[8];
  DecodeFp8x8ToFloat(codes, scale, x);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair =
        base ? __floats2bfloat162_rn(x[2 * i] + base[2 * i], x[2 * i + 1] + base[2 * i + 1])
             : __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    out[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Element e of stored landmark `landmark` (SkvLayout's [seqs, layers, kv_heads, capacity_chunks]
// index) as the scoring reads it: bf16, or with fp8_landmarks its code times its scale.
__device__ __forceinline__ float SkvLandmarkElement(const SkvLayout& l, int64_t landmark, int e) {
  const int64_t at = landmark * l.head_dim + e;
  if (!l.fp8_landmarks) return __bfloat162float(l.landmarks[at]);
  return Fp8E4m3ToFp32(l.landmark_codes[at]) * l.landmark_scales[landmark];
}

// Eight stored FP8 exact keys (fp8_keys) as loaded, before decoding: their codes and run scale,
// and the eight landmark elements of the same dimensions (bf16; with fp8_landmarks .x and .y
// hold the codes and .z the landmark's scale), which a run's codes do not include.
struct SkvFp8Keys8 {
  uint2 codes;
  float scale;
  uint4 landmark;
};

// Loads chunk `chunk`'s eight stored FP8 keys from element `at` of its run (a multiple of 8).
__device__ __forceinline__ SkvFp8Keys8 SkvLoadFp8Keys8(const SkvLayout& l, int seq, int layer,
                                                       int h, int chunk, int64_t at) {
  const int64_t landmark = l.ChunkIndex(seq, layer, h, chunk);
  const int64_t e = landmark * l.head_dim + at % l.head_dim;
  SkvFp8Keys8 k;
  k.codes = *reinterpret_cast<const uint2*>(l.KeyCodes(seq, layer, h, chunk) + at);
  k.scale = *l.KeyScale(seq, layer, h, chunk);
  if (l.fp8_landmarks) {
    const uint2 codes = *reinterpret_cast<const uint2*>(l.landmark_codes + e);
    k.landmark = make_uint4(codes.x, codes.y, __float_as_uint(l.landmark_scales[landmark]), 0u);
  } else {
    k.landmark = *reinterpret_cast<const uint4*>(l.landmarks + e);
  }
  return k;
}

// The keys as bf16: code · scale plus the landmark's element (a run holds each key less the
// chunk's landmark).
__device__ __forceinline__ uint4 SkvDecodeFp8Keys8(const SkvLayout& l, const SkvFp8Keys8& k) {
  float base[8];
  if (l.fp8_landmarks) {  // as SkvLandmarkElement reads it: code · scale in fp32
    DecodeFp8x8ToFloat(make_uint2(k.landmark.x, k.landmark.y), __uint_as_float(k.landmark.z),
                       base);
  } else {
    const __nv_bfloat16* values = reinterpret_cast<const __nv_bfloat16*>(&k.landmark);
#pragma unroll
    for (int i = 0; i < 8; ++i) base[i] = __bfloat162float(values[i]);
  }
  return DecodeFp8x8ToBf16(k.codes, k.scale, base);
}

__device__ __forceinline__ uint4 SkvDecodeFp8Keys8(const SkvLayout& l, int seq, int layer, int h,
                                                   int chunk, int64_t at) {
  return SkvDecodeFp8Keys8(l, SkvLoadFp8Keys8(l, seq, layer, h, chunk, at));
}

// Two fp32 values → fp16x2 bits, saturating to ±65504 (query fragments of the FP8 scoring).
__device__ __forceinline__ uint32_t PackHalf2Saturated(float low, float high) {
  constexpr float kLimit = 65504.0f;
  const __half2 pair = __floats2half2_rn(fminf(fmaxf(low, -kLimit), kLimit),
                                         fminf(fmaxf(high, -kLimit), kLimit));
  return *reinterpret_cast<const uint32_t*>(&pair);
}

}  // namespace shadowkv::cuda
