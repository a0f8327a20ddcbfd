// bf16 GEMMs: y[rows, out] = x[rows, in] · W[out, in]ᵀ (+ beta·y), fp32 compute, on cuBLAS;
// one at a time or a strided batch of one shape.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "core/status.h"

namespace shadowkv::cuda {

enum class GemmOutput { kFloat32, kBfloat16 };

struct GemmParams {
  const __nv_bfloat16* x = nullptr;       // [rows, in] row-major
  const __nv_bfloat16* weight = nullptr;  // [out, in] row-major (a linear layer's weight)
  void* y = nullptr;                      // [rows, out] row-major, fp32 or bf16
  GemmOutput output = GemmOutput::kFloat32;
  int64_t rows = 0;
  int64_t in = 0;
  int64_t out = 0;
  float beta = 0.0f;  // 1 accumulates into y (e.g. a residual)
};

// Runs on the stream (and workspace) set on `handle`. Sizes must fit cuBLAS's int dimensions.
Status RunGemm(cublasHandle_t handle, const GemmParams& params);

// `batch` independent GEMMs of one shape in one launch: product b reads x + b * x_stride and
// weight + b * weight_stride and writes y + b * y_stride (strides in elements of each).
struct GemmBatch {
  int batch = 1;
  int64_t x_stride = 0;
  int64_t weight_stride = 0;
  int64_t y_stride = 0;
};
Status RunGemmBatched(cublasHandle_t handle, const GemmParams& params, const GemmBatch& batch);

// "CUBLAS_STATUS_..." with cuBLAS's description.
Status CublasStatus(cublasStatus_t status, const char* call, const char* file, int line);

}  // namespace shadowkv::cuda

#define SKV_CUBLAS_RETURN_IF_ERROR(expr) \
  SKV_RETURN_IF_ERROR(::shadowkv::cuda::CublasStatus((expr), #expr, __FILE__, __LINE__))
