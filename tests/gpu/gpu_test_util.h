// Shared pieces of the GPU tests: the no-GPU skip, device copies of host vectors, bf16 inputs
// that CPU and GPU see identically, the relative error ‖got − want‖ / ‖want‖, and a median
// event timer for the GPU benchmarks.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "ops/cuda/common/cuda_backend.h"
#include "ops/cuda/common/device_buffer.h"

// First statement of every GPU test: skips, saying why, where no usable GPU is present.
#define SKV_SKIP_WITHOUT_GPU()                                     \
  do {                                                             \
    std::string skv_why_;                                          \
    if (!::shadowkv::cuda::CudaAvailable(&skv_why_)) {             \
      GTEST_SKIP() << "no CUDA GPU: " << skv_why_;                 \
    }                                                              \
  } while (0)

#define SKV_ASSERT_CUDA(expr)                                                       \
  do {                                                                              \
    const cudaError_t skv_error_ = (expr);                                          \
    ASSERT_EQ(skv_error_, cudaSuccess) << #expr << ": " << cudaGetErrorString(skv_error_); \
  } while (0)

namespace shadowkv::cuda::testing {

// Normal values (mean 0, std `scale`) rounded to bf16, returned as fp32.
inline std::vector<float> RandomBf16Values(int64_t count, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(count);
  for (float& v : values) v = Bf16ToFp32(Fp32ToBf16(normal(rng)));
  return values;
}

inline std::vector<float> RandomFloats(int64_t count, std::mt19937& rng, float scale = 1.0f,
                                       float offset = 0.0f) {
  std::normal_distribution<float> normal(offset, scale);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

inline std::vector<uint16_t> ToBf16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = Fp32ToBf16(values[i]);
  return out;
}

inline std::vector<float> FromBf16(const std::vector<uint16_t>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = Bf16ToFp32(values[i]);
  return out;
}

// A device copy of `host` (an allocation failure fails the test and returns an empty buffer).
template <typename T>
DeviceBuffer<T> ToDevice(const std::vector<T>& host) {
  DeviceBuffer<T> buffer;
  const Status status = buffer.Allocate(static_cast<int64_t>(host.size()));
  EXPECT_TRUE(status.ok()) << status.ToString();
  if (status.ok() && !host.empty()) {
    EXPECT_EQ(cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return buffer;
}

// A device buffer of `count` elements with every byte 0xFF: NaN as fp32 and as bf16, so an
// element the kernel should have written and did not shows up in the comparison.
template <typename T>
DeviceBuffer<T> Poisoned(int64_t count) {
  DeviceBuffer<T> buffer;
  const Status status = buffer.Allocate(count);
  EXPECT_TRUE(status.ok()) << status.ToString();
  if (status.ok()) {
    EXPECT_EQ(cudaMemset(buffer.get(), 0xFF, count * sizeof(T)), cudaSuccess);
  }
  return buffer;
}

template <typename T>
std::vector<T> ToHost(const DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), buffer.get(), host.size() * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

inline std::vector<float> ToHostBf16(const DeviceBuffer<uint16_t>& buffer) {
  return FromBf16(ToHost(buffer));
}

// ‖got − want‖₂ / ‖want‖₂; infinity when got holds a NaN or the sizes differ.
inline double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// Tolerances (bf16 operands land between 1e-3 and 1e-2). One rounding to bf16 of a
// result computed in fp32 has a relative RMS error near 2^-9/√3 ≈ 1.1e-3.
constexpr double kBf16OutputTolerance = 5e-3;  // fp32 math, one bf16 rounding at the end
constexpr double kAttentionTolerance = 1e-2;   // probabilities rounded to bf16 as well

// Median milliseconds of `repeats` runs of `launch` (after two warm-ups), timed with events.
// SKV_BENCH_REPEATS overrides `repeats` (1 under a profiler, which times each launch itself).
template <typename Launch>
double MedianMs(int repeats, Launch launch) {
  if (const char* env = std::getenv("SKV_BENCH_REPEATS")) repeats = std::max(1, std::atoi(env));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < repeats + 2; ++i) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace shadowkv::cuda::testing
