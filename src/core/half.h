// Scalar conversions between fp32 and the 16-bit float formats fp16 (IEEE binary16) and bf16.
#pragma once

#include <cstdint>
#include <cstring>

// The bit views below also compile in device code (core/fp8.h uses them in kernels).
#if defined(__CUDACC__)
#define SKV_BITS_HD __host__ __device__ __forceinline__
#else
#define SKV_BITS_HD inline
#endif

namespace shadowkv {

SKV_BITS_HD uint32_t FloatBits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

SKV_BITS_HD float FloatFromBits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// Exact: every fp16 value, subnormals, infinities and NaN payloads included, is an fp32 value.
inline float Fp16ToFp32(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return FloatFromBits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Subnormal (or zero): mantissa * 2^-24, a product that is exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return FloatFromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Rounds to nearest, ties to even; values at or past 65520 become infinity; NaN stays NaN (quiet).
inline uint16_t Fp32ToFp16(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and up
  const uint32_t exponent = magnitude >> 23;
  if (magnitude < 0x38800000u) {
    // Below the smallest normal fp16 (2^-14): count units of 2^-24, rounding the dropped bits.
    const uint32_t shift = 126 - exponent;
    if (shift > 24) return sign;  // below half the smallest subnormal (or exactly half: even is 0)
    const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t units = significand >> shift;
    const uint32_t dropped = significand & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (dropped > halfway || (dropped == halfway && (units & 1u))) ++units;
    return static_cast<uint16_t>(sign | units);
  }
  uint32_t result = ((exponent - 112) << 10) | ((magnitude >> 13) & 0x3ffu);
  const uint32_t dropped = magnitude & 0x1fffu;
  // A carry out of the mantissa correctly bumps the exponent.
  if (dropped > 0x1000u || (dropped == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

inline float Bf16ToFp32(uint16_t bf16) { return FloatFromBits(static_cast<uint32_t>(bf16) << 16); }

// Rounds to nearest, ties to even; NaN stays NaN (made quiet so rounding cannot turn it into inf).
inline uint16_t Fp32ToBf16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace shadowkv
