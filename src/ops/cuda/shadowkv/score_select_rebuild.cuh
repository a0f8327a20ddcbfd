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

// The most dynamic shared memory a block of this device may opt in to.
cudaError_t SkvSharedMemoryLimit(int* limit);
// The re-ranking kernels' shared memory limits (rerank.cu).
cudaError_t SkvConfigureRerank(const SkvLayout& layout);
// The re-rank's select (rerank_select.cu): refuses a layout whose select does not fit `limit`
// bytes of shared memory (or more candidates or budget chunks than it takes), else raises its
// limit; and its launch, after the scorer has written candidate_lse.
cudaError_t SkvConfigureRerankSelect(const SkvLayout& layout, int limit);
cudaError_t LaunchSkvRerankSelect(const SkvDecodeParams& params, cudaStream_t stream);
// The per-query-head select (select_heads.cu), either kernel variant.
cudaError_t LaunchSkvSelectHeads(const SkvDecodeParams& params, cudaStream_t stream);

// Chunks a select keeps for (row, KV head) of a sequence with `budget_chunks`: K, or under
// re-ranking its candidates (before the cap by the selectable chunks).
__device__ __forceinline__ int SkvSelectWanted(const SkvDecodeParams& p, int budget_chunks) {
  return p.candidates ? min(max(budget_chunks * p.rerank_factor, p.rerank_min_chunks),
                            p.layout.max_candidates)
                      : budget_chunks;
}

// Under re-ranking, instead of assigning the gather slots: the k selected chunks (increasing)
// to the row's candidate list, -1 after. Needs `selected` visible.
__device__ __forceinline__ void SkvWriteCandidates(const SkvDecodeParams& p, int row, int h, int k,
                                                   const int* selected) {
  const int limit = p.layout.max_candidates;
  int32_t* out = p.candidates + (static_cast<int64_t>(row) * p.layout.num_kv_heads + h) * limit;
  for (int i = threadIdx.x; i < limit; i += blockDim.x) out[i] = i < k ? selected[i] : -1;
}

// The two dims rotary pair `pair` (of head_dim / 2) rotates, or leaves as they are past the
// rotary dims: halves (x[i], x[i + rotary/2]), else adjacent pairs; dims past rotary_dim pair up
// adjacently either way, as the QKV kernel leaves them.
// Rotates the pair (x0, x1) to `position` at `inv_freq` as the QKV kernel rotates new keys: the
// angle formed in fp32, sincosf (the slow path's accuracy for large angles).
__device__ __forceinline__ void SkvRotatePair(int64_t position, float inv_freq, float* x0,
                                              float* x1) {
  const float angle = static_cast<float>(position) * inv_freq;
  float sine, cosine;
  sincosf(angle, &sine, &cosine);
  const float r0 = *x0 * cosine - *x1 * sine;
  const float r1 = *x0 * sine + *x1 * cosine;
  *x0 = r0;
  *x1 = r1;
}

__device__ __forceinline__ void SkvRopePairDims(int pair, int rotary_dim, bool halves, int* a,
                                                int* b) {
  const int rotary_half = rotary_dim / 2;
  if (pair < rotary_half && halves) {
    *a = pair;
    *b = pair + rotary_half;
  } else if (halves) {
    *a = rotary_dim + 2 * (pair - rotary_half);
    *b = *a + 1;
  } else {
    *a = 2 * pair;
    *b = 2 * pair + 1;
  }
}

}  // namespace shadowkv::cuda
