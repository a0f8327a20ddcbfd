// FP8 e4m3 ("fn" form: no infinities, largest finite 448, NaN = 0x7f / 0xff) with one fp32 scale
// per run of values, shared by the CPU policies and the CUDA kernels (host and device code), so
// both tiers quantise bit-identically.
//
// A run (one chunk of one KV head, or one landmark vector) of floats x is stored as
//   scale = amax / 448, code_i = e4m3(x_i · (448 / amax))   (amax = max |x_i|; all codes 0 and
//   scale 0 when amax is 0), and read back as decode(code_i) · scale.
// Encoding rounds to nearest, ties to even, and saturates to ±448 (what the hardware conversion
// with satfinite does); NaN becomes 0x7f.
#pragma once

#include <cstdint>

#include "core/half.h"

#if defined(__CUDACC__)
#define SKV_FP8_HD __host__ __device__ __forceinline__
#else
#define SKV_FP8_HD inline
#endif

namespace shadowkv {

constexpr float kFp8E4m3Max = 448.0f;

// Exact: every e4m3 value is an fp32 value.
SKV_FP8_HD float Fp8E4m3ToFp32(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return FloatFromBits(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) {
    // Subnormal (or zero): mantissa · 2^-9.
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return FloatFromBits(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// Round to nearest even, saturating to ±448; NaN → 0x7f.
SKV_FP8_HD uint8_t Fp32ToFp8E4m3(float value) {
  const uint32_t bits = FloatBits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7f;
  if (magnitude >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // 448 and up
  const uint32_t exponent = magnitude >> 23;
  if (magnitude < 0x3c800000u) {
    // Below the smallest normal e4m3 (2^-6): count units of 2^-9, rounding the dropped bits.
    const uint32_t shift = 141 - exponent;  // 1.m · 2^(exponent-127) in units of 2^-9
    if (shift > 24) return sign;  // below half the smallest subnormal (or half: even is 0)
    const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t units = significand >> shift;
    const uint32_t dropped = significand & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (dropped > halfway || (dropped == halfway && (units & 1u))) ++units;
    return static_cast<uint8_t>(sign | units);  // 8 units is the smallest normal: still right
  }
  uint32_t result = ((exponent - 120) << 3) | ((magnitude >> 20) & 0x7u);
  const uint32_t dropped = magnitude & 0xfffffu;
  // A carry out of the mantissa correctly bumps the exponent; 464 and up were saturated above,
  // so the largest result is 0x7e (448).
  if (dropped > 0x80000u || (dropped == 0x80000u && (result & 1u))) ++result;
  return static_cast<uint8_t>(sign | result);
}

// The scale of a run whose largest magnitude is `amax` (0 for an all-zero run).
SKV_FP8_HD float Fp8RunScale(float amax) { return amax > 0.0f ? amax / kFp8E4m3Max : 0.0f; }
// What the run's values are multiplied by before encoding.
SKV_FP8_HD float Fp8RunInverseScale(float amax) {
  return amax > 0.0f ? kFp8E4m3Max / amax : 0.0f;
}

// The largest magnitude of a run (NaN ignored).
inline float Fp8RunAmax(const float* values, int64_t count) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    const float magnitude = values[i] < 0.0f ? -values[i] : values[i];
    if (magnitude > amax) amax = magnitude;
  }
  return amax;
}

// Quantises `count` floats into codes; returns the run's scale.
inline float QuantizeFp8Run(const float* values, int64_t count, uint8_t* codes) {
  const float amax = Fp8RunAmax(values, count);
  const float inverse = Fp8RunInverseScale(amax);
  for (int64_t i = 0; i < count; ++i) codes[i] = Fp32ToFp8E4m3(values[i] * inverse);
  return Fp8RunScale(amax);
}

inline void DequantizeFp8Run(const uint8_t* codes, int64_t count, float scale, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = Fp8E4m3ToFp32(codes[i]) * scale;
}

// Rounds `count` floats in place through the FP8 run format (what a reader of the stored run
// gets back).
inline void RoundTripFp8Run(float* values, int64_t count) {
  const float amax = Fp8RunAmax(values, count);
  const float inverse = Fp8RunInverseScale(amax), scale = Fp8RunScale(amax);
  for (int64_t i = 0; i < count; ++i) {
    values[i] = Fp8E4m3ToFp32(Fp32ToFp8E4m3(values[i] * inverse)) * scale;
  }
}

}  // namespace shadowkv
