// Device discovery through the CUDA runtime.
#include "ops/cuda/common/cuda_backend.h"

#include <cuda_runtime_api.h>

#include "ops/cuda/common/cuda_check.h"

namespace shadowkv::cuda {

bool CudaAvailable(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  std::string reason;
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    reason = fmt::format("cudaGetDeviceCount: {} ({})", cudaGetErrorName(error),
                         cudaGetErrorString(error));
  } else if (count == 0) {
    reason = "the CUDA runtime sees no device";
  } else {
    cudaDeviceProp props{};
    const cudaError_t prop_error = cudaGetDeviceProperties(&props, 0);
    if (prop_error != cudaSuccess) {
      reason = fmt::format("cudaGetDeviceProperties: {}", cudaGetErrorString(prop_error));
    } else if (props.major < 8) {
      reason = fmt::format("{} has compute capability {}.{}; the kernels need 8.0 or newer",
                           props.name, props.major, props.minor);
    }
  }
  if (why) *why = reason;
  return reason.empty();
}

Result<DeviceInfo> QueryDevice() {
  std::string why;
  if (!CudaAvailable(&why)) return Error(ErrorCode::kUnsupported, "no usable CUDA GPU: {}", why);
  cudaDeviceProp props{};
  SKV_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, 0));
  DeviceInfo info;
  info.name = props.name;
  info.compute_major = props.major;
  info.compute_minor = props.minor;
  info.multiprocessors = props.multiProcessorCount;
  info.l2_bytes = props.l2CacheSize;
  size_t free_bytes = 0, total_bytes = 0;
  SKV_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  info.free_bytes = static_cast<int64_t>(free_bytes);
  info.total_bytes = static_cast<int64_t>(total_bytes);
  SKV_CUDA_RETURN_IF_ERROR(cudaRuntimeGetVersion(&info.runtime_version));
  SKV_CUDA_RETURN_IF_ERROR(cudaDriverGetVersion(&info.driver_version));
  return info;
}

}  // namespace shadowkv::cuda
