// Second-version ShadowKV decode kernels (kSkvKernelsFast), dispatched by shadowkv_kernels.cu's
// launchers: same contracts as the first ones, faster.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {

// The register-RoPE rebuild handles full-width rotary (rotary_dim == head_dim) of 64 or 128.
bool SkvRebuildFastApplies(const SkvDecodeParams& params);
int64_t SkvRebuildFastSharedBytes(int rank, int head_dim);
// Raises the shared-memory limits of the fast select (`select_dynamic_bytes`) and rebuild.
cudaError_t SkvConfigureFastKernels(const SkvLayout& layout, int64_t select_dynamic_bytes);
// The select's and the rebuild's parts of that (select.cu, rebuild.cu).
cudaError_t SkvConfigureSelectFast(const SkvLayout& layout, int64_t dynamic_bytes);
cudaError_t SkvConfigureRebuildFast(const SkvLayout& layout);

cudaError_t LaunchSkvScoreFast(const SkvDecodeParams& params, cudaStream_t stream);
cudaError_t LaunchSkvSelectFast(const SkvDecodeParams& params, int64_t dynamic_bytes,
                                cudaStream_t stream);
cudaError_t LaunchSkvRebuildFast(const SkvDecodeParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
