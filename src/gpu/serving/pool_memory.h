// How much of the GPU's memory a pool of sequences or a bench batch may take, before and after
// the model is loaded: shared by `shadowkv serve --device cuda` (a pool sized from memory) and
// `shadowkv bench --batch auto`. Pure C++ interface.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "model/config.h"
#include "model/tensor_parallel.h"

namespace shadowkv::cuda {

// The most sequences one step runs (CudaModel's limit for its step buffers).
inline constexpr int kMaxStepBatch = 1024;
// Device memory a pool sized from memory leaves free on each GPU: cuBLAS, the decode graphs,
// ShadowKV's per-row scoring buffers, fragmentation.
inline constexpr int64_t kPoolReserveBytes = 2ll << 30;

// The largest batch `config` could run at `context` tokens a sequence on this GPU, before the
// model is loaded (so that its step buffers can be sized for it): the free device memory over
// the least a sequence can take (its full cache; under ShadowKV its values at one byte per
// element), at most kMaxStepBatch. Never below what fits once the model is loaded. Under tensor
// parallelism each GPU holds its ranks' share.
Result<int> BatchBoundBeforeLoad(const ModelConfig& config, int64_t context, bool shadowkv,
                                 const TensorParallelOptions& tensor_parallel);

// What bounded a pool or a batch, for logs: "12 sequences: bounded by device memory, 18.2 GiB
// free of 139.8 GiB".
std::string MemoryBoundText(int64_t count, const char* what, int64_t free_bytes,
                            int64_t total_bytes);

}  // namespace shadowkv::cuda
