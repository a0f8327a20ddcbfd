// The memory bounds of GPU pools and bench batches.
#include "gpu/serving/pool_memory.h"

#include <fmt/format.h>

#include <algorithm>

#include "gpu/model/shadowkv_plan.h"
#include "model/tensor_parallel.h"
#include "ops/cuda/common/cuda_backend.h"

namespace shadowkv::cuda {

namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
}  // namespace

Result<int64_t> LeastSequenceBytes(const ModelConfig& config, int64_t context,
                                   const kv::KvPolicyConfig* shadowkv, bool host_values,
                                   const TensorParallelOptions& tensor_parallel) {
  if (context < 1) return Error(ErrorCode::kInvalidArgument, "a context of {} tokens", context);
  const int size = std::max(1, tensor_parallel.size);
  if (config.num_kv_heads % size != 0) {
    return Error(ErrorCode::kInvalidArgument, "{} KV heads do not split over {} ranks",
                 config.num_kv_heads, size);
  }
  // A GPU holds one rank, or every rank with the local communicator.
  const int64_t ranks_per_gpu = tensor_parallel.local ? size : 1;
  const int kv_heads = config.num_kv_heads / size;
  if (shadowkv == nullptr) {
    return ranks_per_gpu * int64_t{2} * config.num_layers * kv_heads * config.head_dim * context *
           2;
  }
  SKV_ASSIGN_OR_RETURN(const SkvGeometry geometry,
                       MakeSkvGeometryFor(ShardKvPolicy(*shadowkv, size), config, kv_heads,
                                          context));
  // A store the re-rank reads at every selection stays in device memory.
  const bool store_on_host = host_values && !shadowkv->RerankReadsStore();
  return ranks_per_gpu * (geometry.DeviceBytesPerSequence() +
                          (store_on_host ? 0 : geometry.StoreBytesPerSequence()));
}

Result<int> BatchBoundBeforeLoad(int64_t least_sequence_bytes) {
  SKV_ASSIGN_OR_RETURN(const DeviceInfo device, QueryDevice());
  return static_cast<int>(std::clamp<int64_t>(
      device.free_bytes / std::max<int64_t>(1, least_sequence_bytes), 1, kMaxStepBatch));
}

std::string MemoryBoundText(int64_t count, const char* what, int64_t free_bytes,
                            int64_t total_bytes) {
  return fmt::format("{} {}: bounded by device memory, {:.1f} GiB free of {:.1f} GiB", count, what,
                     free_bytes / kGiB, total_bytes / kGiB);
}

}  // namespace shadowkv::cuda
