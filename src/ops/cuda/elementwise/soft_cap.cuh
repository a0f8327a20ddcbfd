// The final logit soft-cap on the GPU, in place: logits = cap * tanh(logits / cap) (Gemma).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

struct SoftCapParams {
  float* logits = nullptr;  // [count], capped in place
  int64_t count = 0;
  float cap = 0.0f;  // > 0
};

cudaError_t LaunchSoftCap(const SoftCapParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
