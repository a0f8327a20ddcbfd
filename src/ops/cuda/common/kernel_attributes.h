// Kernel attributes per device. cudaFuncSetAttribute acts on the current device only, so a
// kernel configured once per process fails to launch ("invalid argument") on every other GPU of
// a tensor-parallel group; this remembers what was set on each device.
#pragma once

#include <cuda_runtime_api.h>

namespace shadowkv::cuda {

// Lets `kernel` use up to `bytes` of dynamic shared memory on the current device (a no-op where
// as much or more was already allowed there). Never lowers the limit: two layouts of one process
// (a test binary's, a tensor-parallel group's threads) each keep what they need. Every setting
// of this attribute goes through here. Thread-safe; no lock once this thread has seen the size.
cudaError_t AllowDynamicSharedMemory(const void* kernel, int bytes);

}  // namespace shadowkv::cuda
