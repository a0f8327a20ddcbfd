// CUDA runtime return codes as Status (with file and line): every CUDA call in the backend is checked.
#pragma once

#include <cuda_runtime_api.h>

#include "core/status.h"

namespace shadowkv::cuda {

// Ok for cudaSuccess; otherwise an error naming the call, where it was made and what CUDA said.
// Allocation failures are kResourceExhausted (the caller may shrink its request and retry), and
// the runtime's last-error slot is cleared so that the next launch check does not see them.
inline Status CudaStatus(cudaError_t error, const char* call, const char* file, int line) {
  if (error == cudaSuccess) return Status::Ok();
  ErrorCode code = ErrorCode::kInternal;
  if (error == cudaErrorMemoryAllocation) {
    code = ErrorCode::kResourceExhausted;
    (void)cudaGetLastError();
  }
  return Error(code, "{}:{}: {} failed: {} ({})", file, line, call, cudaGetErrorName(error),
               cudaGetErrorString(error));
}

}  // namespace shadowkv::cuda

#define SKV_CUDA_RETURN_IF_ERROR(expr) \
  SKV_RETURN_IF_ERROR(::shadowkv::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__))
