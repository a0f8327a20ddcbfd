#include "ops/cuda/kernel_attributes.h"

#include <map>
#include <mutex>
#include <utility>

namespace shadowkv::cuda {

cudaError_t AllowDynamicSharedMemory(const void* kernel, int bytes) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes
  std::lock_guard<std::mutex> lock(mutex);
  int& current = allowed[{kernel, device}];
  if (bytes <= current) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) current = bytes;
  return e;
}

}  // namespace shadowkv::cuda
