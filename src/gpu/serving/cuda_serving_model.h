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
// A held sequence forks (a device copy) so that one held prompt serves several requests; its
// later turn goes back into a prompt slot for its new tokens and is compressed again.
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
#include "gpu/serving/pool_memory.h"
#include "kv/kv_config.h"
#include "kv/policies.h"
#include "model/tensor_parallel.h"

namespace shadowkv::cuda {

class CudaModelGroup;

struct CudaServingOptions {
  kv::KvPolicyConfig kv;    // the one setting served: policy "full" or "shadowkv"
  int max_batch = 16;       // sequences in one step (the scheduler's batch); 0: the pool's size
  int prefill_chunk = 512;  // prompt tokens per step
  // Sequences held at once, running or kept for reuse; 0: as many as the device memory left
  // after the weights, the step buffers and kPoolReserveBytes holds (see MakePool).
  int sequences = 16;
  // ShadowKV: full-cache slots for prompts; 0: as many as sequences, or with sequences = 0,
  // kDefaultPrefillSlots.
  int prefill_slots = 0;
  int64_t context = 0;  // tokens per sequence, prompt plus new ones (0: the model's)
  // ShadowKV: a held sequence's later turn (a continuation of several tokens) is decompressed
  // into a free prompt slot (CudaModel::DecompressShadowKv), its new tokens prefilled there with
  // full attention, and the whole compressed again; false, or no slot free: the new tokens go in
  // one ShadowKV decode step each.
  bool recompress_turns = true;
  // With recompress_turns: a compressed sequence keeps a pinned host copy of its prompt's exact
  // pre-RoPE keys (CudaModel::AllocateShadowKvKeys: the size of its bf16 value store, kept with
  // the pool's sequence index), which the decompression then reads instead of rank-r keys: a
  // later turn is then as accurate as a fresh prefill of the conversation (docs/RESULTS.md,
  // "Multi-turn on the GPU"). Sequences past kept_keys_limit_bytes recompress from rank-r keys.
  bool keep_prompt_keys = true;
  // Pinned host memory the kept keys may take in all, pinned when the pool is made (not in the
  // loop); -1: a quarter of the host's available memory then (HostAvailableBytes); 0: none kept.
  int64_t kept_keys_limit_bytes = -1;
  TensorParallelOptions tensor_parallel;
  CudaKernelOptions kernels;
};

// ShadowKV prompt slots of a pool sized from memory: one prompt prefills while another's
// compression or a short prompt's exact decode holds the other.
inline constexpr int kDefaultPrefillSlots = 2;

class CudaServingModel final : public engine::ServingModel {
 public:
  // Loads the model, then makes the pool: kResourceExhausted (naming the sizes) when it does not
  // fit the GPU memory, kInvalidArgument for impossible settings, kUnsupported for KV policies
  // other than full and shadowkv.
  static Result<std::unique_ptr<CudaServingModel>> Load(const std::string& path,
                                                        const CudaServingOptions& options);
  // Random weights with `config`'s shapes (model/synthetic.h) and the synthetic vocabulary of
  // its size: throughput only, every output made with it must say so. A context beyond the
  // config's is allowed (random weights were never trained to a length).
  static Result<std::unique_ptr<CudaServingModel>> CreateSynthetic(
      const ModelConfig& config, const CudaServingOptions& options);
  ~CudaServingModel() override;

  const ModelConfig& config() const override { return config_; }
  const Tokenizer& tokenizer() const override { return *tokenizer_; }
  const gguf::GgufFile& file() const override { return *file_; }
  std::string device() const override;
  // Only the served setting (policy and budget); any other is kInvalidArgument.
  Result<std::unique_ptr<kv::KvPolicy>> MakePolicy(const kv::KvPolicyConfig& config) const override;
  Status Step(std::span<const engine::StepRow> rows, std::span<int32_t> next_tokens) override;

  // ShadowKV: runs one throwaway prompt through prefill, compression and a decode step, so that
  // what the first use of each costs (library and kernel loading, solver set-up) is paid before
  // any request waits on it; the sequence goes back to the pool. Full attention: nothing.
  // Call before the engine loop starts (it uses Step).
  Status WarmUp();
  // The pool in words (sequences, context, device and host memory, what bounded it), for the
  // start-up line.
  std::string Describe() const;
  int max_batch() const { return max_batch_; }  // the batch the pool was made for
  int sequences() const { return sequences_; }
  bool synthetic() const;
  CudaModelGroup& group() { return *group_; }
  // Frees the pool and makes one for other settings (bench cases, which also use group()
  // directly between pools). kInvalidArgument while any of its sequences is alive; the
  // context must be within the model's.
  Status RemakePool(const kv::KvPolicyConfig& kv, int sequences, int prefill_slots,
                    int64_t context);
  // ShadowKV: how many of the pool's sequences could have their values in device memory now
  // (values are placed as each prompt is compressed); the pool's size for full attention.
  Result<int> SequencesWithDeviceValues();

  class Sequence;

 private:
  class Policy;
  CudaServingModel() = default;
  // Load and CreateSynthetic past their own parts: checks, the group made by `make_group` with
  // step buffers for the batch, then the pool.
  template <typename MakeGroup>
  static Result<std::unique_ptr<CudaServingModel>> Assemble(const CudaServingOptions& options,
                                                            std::unique_ptr<gguf::GgufFile> file,
                                                            std::unique_ptr<Tokenizer> tokenizer,
                                                            const ModelConfig& config,
                                                            MakeGroup make_group);
  Status MakePool();
  Result<std::unique_ptr<kv::SequenceKv>> NewSequence();
  void Release(Sequence& sequence);
  Result<std::unique_ptr<kv::SequenceKv>> Fork(const Sequence& sequence);
  void GiveBackSlot(Sequence& sequence);  // its full-cache slot back to the pool
  Status Compress(Sequence& sequence);
  // CudaServingOptions::keep_prompt_keys: gives sequence index `index` its exact-key copy where
  // the limit allows (false: its later turns recompress from rank-r keys).
  Result<bool> KeepPromptKeys(int index);
  // CudaServingOptions::recompress_turns: a compressed sequence back into a free full-cache
  // slot (false where none is free: it stays compressed).
  Result<bool> Decompress(Sequence& sequence);
  bool shadowkv() const { return kv::IsPolicy(options_.kv, kv::PolicyKind::kShadowKv); }

  CudaServingOptions options_;
  std::unique_ptr<gguf::GgufFile> file_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<CudaModelGroup> group_;
  ModelConfig config_;           // the model's, with context_length = the served context
  int num_slots_ = 0;            // full-cache slots in the pool
  int sequences_ = 0;            // sequences in the pool
  int max_batch_ = 0;            // sequences in one step
  std::string bound_;            // what bounded a pool sized from memory
  int64_t slot_bytes_ = 0;       // device bytes of one full-cache slot
  int64_t skv_bytes_ = 0;        // device bytes of one ShadowKV sequence without values
  int64_t skv_value_bytes_ = 0;  // and of its store (values, and exact keys with exact_keys)
  // CudaServingOptions::keep_prompt_keys: the pinned host bytes of one sequence's key copy (at
  // most: sliding-window layers keep none), the limit for all copies, and which indices hold one
  // (it stays with the index, as the model keeps it).
  int64_t key_copy_bytes_ = 0;
  int64_t kept_keys_limit_ = 0;
  std::vector<bool> keys_kept_;

  std::mutex mutex_;  // the free lists (sequences end on the scheduler's thread, policies anywhere)
  std::vector<int> free_slots_;
  std::vector<int> free_sequences_;
  std::vector<float> logits_;  // [rows, vocab] of a decode step some row wants logits of
};

}  // namespace shadowkv::cuda
