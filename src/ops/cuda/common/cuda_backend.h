// Whether a CUDA GPU can be used, and what it is. Pure C++: any part of the engine may include it
// (the GPU stack's pure C++ headers are gpu/model/cuda_model.h, gpu/tp/cuda_model_group.h,
// gpu/serving/cuda_serving_model.h and gpu/bench/cuda_bench.h).
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace shadowkv::cuda {

struct DeviceInfo {
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  int multiprocessors = 0;
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;  // at the time of the query (cudaMemGetInfo)
  int64_t l2_bytes = 0;
  int runtime_version = 0;  // e.g. 13000
  int driver_version = 0;
};

// True when device 0 can run our kernels (a driver, a device, compute capability 8.0 or newer).
// Otherwise false, with the reason in *why (when why is not null). Never aborts.
bool CudaAvailable(std::string* why);

// Properties and current memory of device 0.
Result<DeviceInfo> QueryDevice();

}  // namespace shadowkv::cuda
