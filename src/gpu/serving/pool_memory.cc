// The memory bounds of GPU pools and bench batches.
#include "gpu/serving/pool_memory.h"

#include <fmt/format.h>

#include <algorithm>

#include "ops/cuda/common/cuda_backend.h"

namespace shadowkv::cuda {

namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
}  // namespace

Result<int> BatchBoundBeforeLoad(const ModelConfig& config, int64_t context, bool shadowkv,
                                 const TensorParallelOptions& tensor_parallel) {
  if (context < 1) return Error(ErrorCode::kInvalidArgument, "a context of {} tokens", context);
  SKV_ASSIGN_OR_RETURN(const DeviceInfo device, QueryDevice());
  const int64_t devices = tensor_parallel.local ? 1 : std::max(1, tensor_parallel.size);
  // Keys and values in bf16; ShadowKV keeps at least the values, in FP8 at the smallest.
  const int64_t elements =
      int64_t{2} * config.num_layers * config.num_kv_heads * config.head_dim * context;
  const int64_t least = std::max<int64_t>(1, (shadowkv ? elements / 2 : elements * 2) / devices);
  return static_cast<int>(std::clamp<int64_t>(device.free_bytes / least, 1, kMaxStepBatch));
}

std::string MemoryBoundText(int64_t count, const char* what, int64_t free_bytes,
                            int64_t total_bytes) {
  return fmt::format("{} {}: bounded by device memory, {:.1f} GiB free of {:.1f} GiB", count, what,
                     free_bytes / kGiB, total_bytes / kGiB);
}

}  // namespace shadowkv::cuda
