// GEMMs through cuBLAS (row-major products expressed as cuBLAS's column-major ones).
#include "ops/cuda/gemm/gemm.h"

#include <limits>

#include "ops/cuda/common/cuda_check.h"

namespace shadowkv::cuda {
Status CublasStatus(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  const ErrorCode code = status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorCode::kResourceExhausted
                                                              : ErrorCode::kInternal;
  return Error(code, "{}:{}: {} failed: {} ({})", file, line, call, cublasGetStatusName(status),
               cublasGetStatusString(status));
}

namespace {

Status CheckShape(const GemmParams& p) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.rows > kMax || p.in > kMax || p.out > kMax) {
    return Error(ErrorCode::kInvalidArgument, "GEMM of [{} x {}] by [{} x {}]ᵀ is out of range",
                 p.rows, p.in, p.out, p.in);
  }
  return Status::Ok();
}

}  // namespace

// Row-major y[rows, out] is column-major yᵀ[out, rows] = W[out, in] · xᵀ[in, rows], where the
// row-major W reads as a column-major [in, out] matrix, hence the transpose on it.
Status RunGemm(cublasHandle_t handle, const GemmParams& p) {
  if (p.rows == 0) return Status::Ok();
  SKV_RETURN_IF_ERROR(CheckShape(p));
  const float alpha = 1.0f;
  const cudaDataType_t y_type = p.output == GemmOutput::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
  SKV_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(p.out), static_cast<int>(p.rows),
      static_cast<int>(p.in), &alpha, p.weight, CUDA_R_16BF, static_cast<int>(p.in), p.x,
      CUDA_R_16BF, static_cast<int>(p.in), &p.beta, p.y, y_type, static_cast<int>(p.out),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

Status RunGemmBatched(cublasHandle_t handle, const GemmParams& p, const GemmBatch& b) {
  if (p.rows == 0 || b.batch == 0) return Status::Ok();
  SKV_RETURN_IF_ERROR(CheckShape(p));
  if (b.batch < 0 || b.x_stride < 0 || b.weight_stride < 0 || b.y_stride < 0) {
    return Error(ErrorCode::kInvalidArgument, "GEMM batch of {} with strides {}, {}, {}", b.batch,
                 b.x_stride, b.weight_stride, b.y_stride);
  }
  const float alpha = 1.0f;
  const cudaDataType_t y_type = p.output == GemmOutput::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
  SKV_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(p.out), static_cast<int>(p.rows),
      static_cast<int>(p.in), &alpha, p.weight, CUDA_R_16BF, static_cast<int>(p.in),
      b.weight_stride, p.x, CUDA_R_16BF, static_cast<int>(p.in), b.x_stride, &p.beta, p.y, y_type,
      static_cast<int>(p.out), b.y_stride, b.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

}  // namespace shadowkv::cuda
