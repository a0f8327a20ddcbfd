// CudaServingModel: the server's model on the GPU (`shadowkv serve --device cuda`), split over
// tensor-parallel ranks or not. It serves one KV setting, full attention or ShadowKV, from a
// fixed pool of sequences made when it loads:
//   - full: every sequence is a full-cache slot of `context` tokens;
//   - shadowkv: a prompt is prefilled into a full-cache slot (with its pre-RoPE keys), then
//     compressed into a ShadowKV sequence (values in device memory, or pinned host memory when
//     the device is short) and its slot goes back to the pool; decode rows of compressed
//     sequences run as ShadowKV decode steps. A prompt too short to form the budget's chunks
//     plus the outliers stays in its slot and decodes with full attention (which is what the
//     sparse attention would read anyway).
// A held sequence forks (a device copy) so that one held prompt serves several requests.
// Each step runs the full-cache rows as one batched forward (a graph-replayed decode step when
// they are all single-token decode rows) and the compressed sequences' rows as one ShadowKV
// decode step; every row's next token is drawn on the device and only the ids come back.
// Pure C++ interface (no CUDA types).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/serving_model.h"
#include "gpu/model/cuda_model.h"
#include "kv/kv_config.h"
#include "kv/policies.h"
#include "model/tensor_parallel.h"

namespace shadowkv::cuda {

class CudaModelGroup;

struct CudaServingOptions {
  kv::KvPolicyConfig kv;    // the one setting served: policy "full" or "shadowkv"
  int max_batch = 16;       // sequences in one step (the scheduler's batch)
  int prefill_chunk = 512;  // prompt tokens per step
  int sequences = 16;       // sequences held at once, running or kept for reuse
  int prefill_slots = 0;    // shadowkv: full-cache slots for prompts (0: as many as sequences)
  int64_t context = 0;      // tokens per sequence, prompt plus new ones (0: the model's)
  TensorParallelOptions tensor_parallel;
  CudaKernelOptions kernels;
};

class CudaServingModel final : public engine::ServingModel {
 public:
  // Loads the model, then makes the pool: kResourceExhausted (naming the sizes) when it does not
  // fit the GPU memory, kInvalidArgument for impossible settings, kUnsupported for KV policies
  // other than full and shadowkv.
  static Result<std::unique_ptr<CudaServingModel>> Load(const std::string& path,
                                                        const CudaServingOptions& options);
  ~CudaServingModel() override;

  const ModelConfig& config() const override { return config_; }
  const Tokenizer& tokenizer() const override { return *tokenizer_; }
  const gguf::GgufFile& file() const override { return *file_; }
  std::string device() const override;
  // Only the served setting (policy and budget); any other is kInvalidArgument.
  Result<std::unique_ptr<kv::KvPolicy>> MakePolicy(const kv::KvPolicyConfig& config) const override;
  Status Step(std::span<const engine::StepRow> rows, std::span<int32_t> next_tokens) override;

  // The pool in words (sequences, context, device and host memory), for the start-up line.
  std::string Describe() const;
  CudaModelGroup& group() { return *group_; }

  class Sequence;

 private:
  class Policy;
  CudaServingModel() = default;
  Status MakePool();
  Result<std::unique_ptr<kv::SequenceKv>> NewSequence();
  void Release(Sequence& sequence);
  Result<std::unique_ptr<kv::SequenceKv>> Fork(const Sequence& sequence);
  Status Compress(Sequence& sequence);
  bool shadowkv() const { return kv::IsPolicy(options_.kv, kv::PolicyKind::kShadowKv); }

  CudaServingOptions options_;
  std::unique_ptr<gguf::GgufFile> file_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<CudaModelGroup> group_;
  ModelConfig config_;           // the model's, with context_length = the served context
  int num_slots_ = 0;            // full-cache slots in the pool
  int64_t slot_bytes_ = 0;       // device bytes of one full-cache slot
  int64_t skv_bytes_ = 0;        // device bytes of one ShadowKV sequence without values
  int64_t skv_value_bytes_ = 0;  // and of its values

  std::mutex mutex_;  // the free lists (sequences end on the scheduler's thread, policies anywhere)
  std::vector<int> free_slots_;
  std::vector<int> free_sequences_;
  std::vector<float> logits_;  // [rows, vocab] of a decode step some row wants logits of
};

}  // namespace shadowkv::cuda
