// The Hopper prefill attention kernel (prefill_attention_wgmma.cu), internal to the launcher in
// prefill_attention.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "ops/cuda/attention/prefill_attention.cuh"

namespace shadowkv::cuda {

// Whether this build has the kernel's sm_90a code (otherwise it is compiled empty).
bool PrefillWgmmaAvailable();
// Head dim 128; `group` query heads per KV head.
cudaError_t LaunchPrefillWgmma(const PrefillAttentionParams& params, int group,
                               cudaStream_t stream);

}  // namespace shadowkv::cuda
