// How much of the GPU's memory a pool of sequences or a bench batch may take, before and after
// the model is loaded: shared by `shadowkv serve --device cuda` (a pool sized from memory) and
// `shadowkv bench --batch auto`. Pure C++ interface.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "kv/kv_config.h"
#include "model/config.h"
#include "model/tensor_parallel.h"

namespace shadowkv::cuda {

// The most sequences one step runs (CudaModel's limit for its step buffers).
inline constexpr int kMaxStepBatch = 1024;
// Device memory a pool sized from memory leaves free on each GPU: cuBLAS, the decode graphs,
// ShadowKV's per-row scoring buffers, fragmentation.
inline constexpr int64_t kPoolReserveBytes = 2ll << 30;

// The least device memory one sequence of `context` tokens takes on each GPU: its full cache
// (keys and values, bf16), or with `shadowkv` set, its compressed state without its store (values,
// and exact keys where kept) when `host_values` lets the store live in pinned host memory, with
// it when not or when the re-rank reads the store at every selection. Under tensor parallelism
// each GPU holds its ranks' share.
Result<int64_t> LeastSequenceBytes(const ModelConfig& config, int64_t context,
                                   const kv::KvPolicyConfig* shadowkv, bool host_values,
                                   const TensorParallelOptions& tensor_parallel);

// The largest batch that could run on this GPU before the model is loaded (so that its step
// buffers can be sized for it): the free device memory over `least_sequence_bytes`, at least
// 1 and at most kMaxStepBatch. Never below what fits once the weights are in.
Result<int> BatchBoundBeforeLoad(int64_t least_sequence_bytes);

// What bounded a pool or a batch, for logs: "12 sequences: bounded by device memory, 18.2 GiB
// free of 139.8 GiB".
std::string MemoryBoundText(int64_t count, const char* what, int64_t free_bytes,
                            int64_t total_bytes);

}  // namespace shadowkv::cuda
