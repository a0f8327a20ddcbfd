// CudaModelGroup: one model split over N tensor-parallel ranks (Megatron style: attention heads
// and FFN units split, one all-reduce after the attention output and one after the FFN), each
// rank a CudaModel shard driven by its own thread. The methods mirror CudaModel's; every call
// runs on all ranks at once and returns when all are done, with rank 0's tokens and logits
// (every rank computes the same ones). With N = 1 the group is a thin forwarder to one
// CudaModel on the caller's thread: no threads, no communicator, no extra GPU work.
// See docs/TENSOR_PARALLEL.md. Pure C++ interface (no CUDA types).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "gpu/model/cuda_model.h"
#include "kv/kv_config.h"
#include "model/config.h"
#include "model/tensor_parallel.h"

namespace shadowkv::cuda {

// To be called before the process's first CUDA call when it will split a model (size > 1):
// makes CUDA load every module at start-up (CUDA_MODULE_LOADING=EAGER unless the caller set the
// variable). With lazy loading, a rank that launches a kernel for the first time may have to
// wait for its GPU to go idle while another rank's all-reduce kernel waits for it: a deadlock.
// Also gives every stream a hardware queue of its own (CUDA_DEVICE_MAX_CONNECTIONS=32 unless
// set): with the default 8, the streams of ranks sharing one GPU (the local communicator) can
// share a queue, and a rank's spinning all-reduce then blocks the kernel of the rank it waits for.
void PrepareProcessForTensorParallel(int size);

// One ShadowKV sequence of every rank.
struct CudaShadowKvGroupSnapshot {
  std::vector<CudaShadowKvSnapshot> ranks;
};

class CudaModelGroup {
 public:
  // As CudaModel::Load / CreateSynthetic, split over `tp.size` ranks. kInvalidArgument when the
  // model's KV heads do not divide by the size; kUnsupported when the GPUs or NCCL are missing.
  static Result<std::unique_ptr<CudaModelGroup>> Load(const std::string& path,
                                                      const CudaModelOptions& options,
                                                      const TensorParallelOptions& tp);
  static Result<std::unique_ptr<CudaModelGroup>> CreateSynthetic(const ModelConfig& config,
                                                                 uint64_t seed,
                                                                 const CudaModelOptions& options,
                                                                 const TensorParallelOptions& tp);
  ~CudaModelGroup();
  CudaModelGroup(const CudaModelGroup&) = delete;
  CudaModelGroup& operator=(const CudaModelGroup&) = delete;

  int size() const;
  int num_devices() const;            // GPUs in use: size, or 1 with the local communicator
  std::string communicator() const;   // "none", "nccl" or "local"
  CudaModel& rank(int i);             // rank i's shard (its config() has the shard's shapes)
  const ModelConfig& config() const;  // the whole model
  const CudaModelOptions& options() const;
  bool synthetic() const;
  // Summed over the ranks (divide by num_devices() for one GPU's share).
  int64_t weight_bytes() const;
  int64_t decode_weight_bytes() const;
  int64_t activation_bytes() const;
  int64_t KvBytesPerToken() const;
  // The least free memory over the GPUs in use.
  Result<int64_t> FreeDeviceBytes();

  Status AllocateKvCache(int num_slots, int64_t capacity, bool keep_pre_rope_keys = false);
  void FreeKvCache();
  int num_slots() const;
  int64_t slot_capacity() const;
  int64_t slot_length(int slot) const;
  void ResetSlot(int slot);
  Status CopySlot(int from, int to);
  Status Forward(std::span<const CudaStepInput> inputs);
  // Every rank samples alike from the same logits; rank 0's ids come back.
  Status DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                    std::span<const CudaSampling> sampling, float* logits_out = nullptr);
  Status DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                    const CudaSampling& sampling, float* logits_out = nullptr);
  Result<StepBreakdown> ProfileDecodeStep(std::span<const int> slots, std::span<int32_t> tokens);

  // ShadowKV: each rank compresses and decodes its own KV heads; the low-rank basis is
  // factorised per rank over its heads' keys (see tensor_parallel.h, ShardKvPolicy).
  Status AllocateShadowKv(const kv::KvPolicyConfig& config, int num_sequences, int64_t capacity);
  void FreeShadowKv();
  // Summed over the ranks.
  Result<std::pair<int64_t, int64_t>> ShadowKvBytesPerSequence(const kv::KvPolicyConfig& config,
                                                               int64_t capacity) const;
  Status AllocateShadowKvValues(int seq, bool on_host);
  Status FreeShadowKvValues(int seq);
  Status CompressToShadowKv(int full_slot, int seq);
  Status DecompressShadowKv(int seq, int full_slot);  // every rank its own heads
  Status AllocateShadowKvKeys(int seq);
  Status CopyShadowKvSequence(int from, int to);
  Result<CudaShadowKvGroupSnapshot> SaveShadowKvSequence(int seq);
  Status RestoreShadowKvSequence(const CudaShadowKvGroupSnapshot& snapshot, int seq);
  int64_t shadowkv_length(int seq) const;
  Status ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                            std::span<const CudaSampling> sampling, float* logits_out = nullptr);
  Status ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                            const CudaSampling& sampling, float* logits_out = nullptr);
  Result<StepBreakdown> ProfileShadowKvDecodeStep(std::span<const int> seqs,
                                                  std::span<int32_t> tokens);
  // Bytes and counters summed over the ranks; rank = the ranks' ranks summed; compress_seconds
  // of the whole group's last compression.
  CudaShadowKvStats shadowkv_stats() const;
  void ResetShadowKvCounters();
  // Every sequence's chunk counts, summed over the ranks (each selects for its own KV heads).
  Result<std::vector<CudaChunkCounts>> ShadowKvSequenceCounts() const;
  // `kv_head` of the whole model (the rank holding it answers).
  Result<std::vector<int32_t>> ShadowKvGatheredChunks(int seq, int layer, int kv_head);

  struct State;

 private:
  explicit CudaModelGroup(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace shadowkv::cuda
