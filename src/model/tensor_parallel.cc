// Tensor-parallel shard arithmetic (see tensor_parallel.h).
#include "model/tensor_parallel.h"

#include <algorithm>

#include "kv/low_rank.h"

namespace shadowkv {

IndexRange TensorParallelShard::QueryRows(int head_dim) const {
  return {query_heads.begin * head_dim, query_heads.count * head_dim};
}

IndexRange TensorParallelShard::KvRows(int head_dim) const {
  return {kv_heads.begin * head_dim, kv_heads.count * head_dim};
}

Status CheckTensorParallel(const ModelConfig& config, int size) {
  if (size < 1) {
    return Error(ErrorCode::kInvalidArgument, "tensor-parallel size {} must be at least 1", size);
  }
  if (config.num_kv_heads <= 0 || config.num_query_heads <= 0 || config.ffn_size <= 0) {
    return Error(ErrorCode::kInvalidArgument, "model config has an empty dimension: {}",
                 config.Summary());
  }
  if (config.num_query_heads % config.num_kv_heads != 0) {
    return Error(ErrorCode::kInvalidArgument, "{} query heads are not a multiple of {} KV heads",
                 config.num_query_heads, config.num_kv_heads);
  }
  // Each rank must own whole KV heads: a KV head split across ranks would need its keys and
  // values on both (and its query group too).
  if (config.num_kv_heads % size != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "tensor-parallel size {} does not divide the model's {} KV heads (each rank "
                 "holds whole KV heads and their query heads)",
                 size, config.num_kv_heads);
  }
  if (config.ffn_size < size) {
    return Error(ErrorCode::kInvalidArgument, "tensor-parallel size {} exceeds the FFN width {}",
                 size, config.ffn_size);
  }
  return Status::Ok();
}

Result<TensorParallelShard> MakeShard(const ModelConfig& config, int size, int rank) {
  SKV_RETURN_IF_ERROR(CheckTensorParallel(config, size));
  if (rank < 0 || rank >= size) {
    return Error(ErrorCode::kInvalidArgument, "tensor-parallel rank {} is outside [0, {})", rank,
                 size);
  }
  TensorParallelShard s;
  s.size = size;
  s.rank = rank;
  const int kv_per_rank = config.num_kv_heads / size;
  const int group = config.num_query_heads / config.num_kv_heads;
  s.kv_heads = {static_cast<int64_t>(rank) * kv_per_rank, kv_per_rank};
  // Query head h attends to KV head h / group, so the rank's KV heads bring their groups.
  s.query_heads = {s.kv_heads.begin * group, s.kv_heads.count * group};
  // FFN units in granules of 8 where the width allows (the GEMMs' tensor-core tiles keep
  // aligned leading dimensions), else one by one; the first ranks take the remainder.
  const int64_t granule = config.ffn_size % 8 == 0 && config.ffn_size / 8 >= size ? 8 : 1;
  const int64_t units = config.ffn_size / granule;
  const int64_t base = units / size, extra = units % size;
  s.ffn = {(rank * base + std::min<int64_t>(rank, extra)) * granule,
           (base + (rank < extra ? 1 : 0)) * granule};
  return s;
}

ModelConfig ShardConfig(const ModelConfig& config, const TensorParallelShard& shard) {
  ModelConfig c = config;
  c.num_query_heads = static_cast<int>(shard.query_heads.count);
  c.num_kv_heads = static_cast<int>(shard.kv_heads.count);
  c.ffn_size = static_cast<int>(shard.ffn.count);
  return c;
}

kv::KvPolicyConfig ShardKvPolicy(const kv::KvPolicyConfig& config, int size) {
  kv::KvPolicyConfig c = config;
  c.rank = kv::RankPerGroup(config.rank, size);  // the CPU's basis_groups = size rule
  return c;
}

}  // namespace shadowkv
