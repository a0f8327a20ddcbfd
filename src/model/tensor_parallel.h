// Megatron-style tensor-parallel sharding of a llama/qwen2 model, pure index arithmetic: which
// query heads, KV heads and FFN columns rank i of N holds, the shard's own shapes, and which
// rows / columns of every weight matrix (in the engine's [out, in] layout) it takes. The CUDA
// backend uses it to load a shard; the unit tests check it without a GPU.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "kv/kv_config.h"
#include "model/config.h"

namespace shadowkv {

// How a model is split (docs/TENSOR_PARALLEL.md): over `size` GPUs of this host, rank i on GPU i
// through NCCL, or with `local`, every rank on the current GPU through the single-device
// communicator (tests, and measuring the sharded model on one GPU).
struct TensorParallelOptions {
  int size = 1;
  bool local = false;
};

// A contiguous range [begin, begin + count) of some index space.
struct IndexRange {
  int64_t begin = 0;
  int64_t count = 0;
  int64_t end() const { return begin + count; }
  bool operator==(const IndexRange&) const = default;
};

// Rank `rank` of `size`: KV heads [i·Hkv/N, (i+1)·Hkv/N) and the query heads that attend to them
// (the same fraction of the query heads, since every KV head serves a fixed group); FFN units
// split as evenly as the width allows, in multiples of 8 where it is a multiple of 8 (the first
// ranks take what does not divide).
struct TensorParallelShard {
  int size = 1;
  int rank = 0;
  IndexRange query_heads;
  IndexRange kv_heads;
  IndexRange ffn;  // the FFN's inner units: columns of W_gate / W_up, rows of W_down

  // Output rows of the full model's W_q / W_k (= W_v) / W_gate (= W_up) this rank holds: its
  // heads' rows (heads · head_dim wide) and its FFN units.
  IndexRange QueryRows(int head_dim) const;
  IndexRange KvRows(int head_dim) const;
  IndexRange FfnRows() const { return ffn; }
  // Input columns of W_o (the attention output's features) and of W_down (the FFN's units)
  // this rank holds: the same ranges, seen from the input side.
  IndexRange OutputProjectionColumns(int head_dim) const { return QueryRows(head_dim); }
  IndexRange DownColumns() const { return ffn; }
};

// kInvalidArgument unless `size` ranks can split `config`: 1 <= size, the KV heads divide evenly
// (num_kv_heads % size == 0) and every rank gets at least one FFN unit.
Status CheckTensorParallel(const ModelConfig& config, int size);

Result<TensorParallelShard> MakeShard(const ModelConfig& config, int size, int rank);

// The shapes one rank computes with: its heads and FFN units; everything else (hidden size,
// vocabulary, rope, norms) as in `config`. The identity for size 1.
ModelConfig ShardConfig(const ModelConfig& config, const TensorParallelShard& shard);

// ShadowKV settings for one rank of `size`: each rank factorises its own heads' keys. The rank
// ratio applies to the rank's own key width as it does to the whole width; an explicit rank r
// becomes ceil8(r / size) per rank, so that the ranks together keep about r dimensions.
kv::KvPolicyConfig ShardKvPolicy(const kv::KvPolicyConfig& config, int size);

}  // namespace shadowkv
