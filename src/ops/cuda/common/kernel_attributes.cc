#include "ops/cuda/common/kernel_attributes.h"

#include <map>
#include <utility>

namespace shadowkv::cuda {

cudaError_t AllowDynamicSharedMemory(const void* kernel, int bytes) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  // What this thread has set, per (kernel, device): each rank's thread launches on its own GPU,
  // so the launch path shares no lock between ranks. Two threads setting the same attribute on
  // one device set the same value.
  thread_local std::map<std::pair<const void*, int>, int> allowed;
  int& current = allowed[{kernel, device}];
  if (bytes <= current) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) current = bytes;
  return e;
}

}  // namespace shadowkv::cuda
