#include "ops/cuda/common/kernel_attributes.h"

#include <map>
#include <mutex>
#include <utility>

namespace shadowkv::cuda {

cudaError_t AllowDynamicSharedMemory(const void* kernel, int bytes) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const std::pair<const void*, int> key{kernel, device};
  // The attribute is the process's, per (kernel, device), and only ever raised here, so what
  // this thread saw allowed stays allowed: the launch path takes no lock once a thread has seen
  // its size (each tensor-parallel rank's thread launches on its own GPU).
  thread_local std::map<std::pair<const void*, int>, int> seen;
  int& local = seen[key];
  if (bytes <= local) return cudaSuccess;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;  // guarded by mutex
  std::lock_guard<std::mutex> lock(mutex);
  int& current = allowed[key];
  if (bytes > current) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    current = bytes;
  }
  local = current;
  return cudaSuccess;
}

}  // namespace shadowkv::cuda
