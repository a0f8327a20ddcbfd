// Skinny bf16 GEMM for decode steps (at most 16 rows): y[rows, out] = x[rows, in] · W[out, in]ᵀ
// (+ beta·y), fp32 accumulation on the tensor cores, weights streamed once at full bandwidth.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

constexpr int kSkinnyGemmMaxRows = 16;

struct SkinnyGemmParams {
  const __nv_bfloat16* x = nullptr;       // [rows, in] row-major
  const __nv_bfloat16* weight = nullptr;  // [out, in] row-major
  void* y = nullptr;                      // [rows, out] row-major, fp32 or bf16
  bool bf16_output = false;
  int rows = 0;  // 1..kSkinnyGemmMaxRows
  int in = 0;    // a multiple of 32
  int out = 0;
  float beta = 0.0f;
};

// True when the kernel takes this shape (rows <= 16, in a multiple of 32, aligned pointers are
// the caller's: x and weight 16-byte aligned rows).
bool SkinnyGemmSupports(int64_t rows, int64_t in, int64_t out);

cudaError_t LaunchSkinnyGemm(const SkinnyGemmParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
