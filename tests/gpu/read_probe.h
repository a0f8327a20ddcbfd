// The device's read-only streaming rate, the ceiling the decode attention bench is measured
// against (a bench helper of the GPU tests, not a library kernel).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

// Reads `bytes` (a multiple of 64) once with 16-byte loads and no output but a never-taken
// store into `sink` (4 bytes).
cudaError_t LaunchReadProbe(const void* data, int64_t bytes, uint32_t* sink, cudaStream_t stream);

}  // namespace shadowkv::cuda
