// ServingModel: what the scheduler and the HTTP server need of a model: its shapes, tokenizer and
// GGUF file, KV policies for it, and batched steps that return each sequence's next token (the
// model samples: on the GPU only token ids leave the device). CpuServingModel serves a CpuModel
// with any CPU KV policy; the CUDA backend has its own (gpu/serving/cuda_serving_model.h).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/sampler.h"
#include "format/gguf.h"
#include "format/tokenizer.h"
#include "kv/kv_config.h"
#include "kv/kv_policy.h"
#include "model/config.h"
#include "model/cpu_model.h"

namespace shadowkv::engine {

// One sequence's share of a step.
struct StepRow {
  kv::SequenceKv* kv = nullptr;     // the sequence's KV state (owned by the caller)
  std::span<const int32_t> tokens;  // new tokens; the first goes at position kv->num_tokens()
  bool finish_prefill = false;      // these are the prompt's last tokens: compress afterwards
  // Non-null: draw the sequence's next token after its last new token (a decode row, or a
  // prompt's last chunk). Null: a prompt chunk that is not the last.
  const SamplingParams* sampling = nullptr;
  // The sequence's count of tokens drawn before this one. A draw's randomness depends on
  // (seed, draw) only, so a request gets the same tokens alone or in any batch.
  uint64_t draw = 0;
  // Non-null: [vocab] host memory for the last new token's logits (tests and tools; a serving
  // step never asks, so that on the GPU only ids leave the device).
  float* logits_out = nullptr;
};

class ServingModel {
 public:
  virtual ~ServingModel() = default;

  // config().context_length is the longest sequence served (prompt plus new tokens).
  virtual const ModelConfig& config() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual const gguf::GgufFile& file() const = 0;
  // Where the steps run, for logs: "cpu", "cuda, 2 ranks (nccl)".
  virtual std::string device() const = 0;

  // A KV policy for these settings; kInvalidArgument or kUnsupported for settings this model
  // cannot serve. Safe from any thread. Its sequences (NewSequence) are valid only for this
  // model's Forward; NewSequence answers kResourceExhausted while the model has no room for
  // another sequence (the scheduler then waits for a running one to end).
  virtual Result<std::unique_ptr<kv::KvPolicy>> MakePolicy(
      const kv::KvPolicyConfig& config) const = 0;

  // One step over every row (distinct sequences): appends each row's tokens, writes
  // next_tokens[i] for every row i with sampling (next_tokens has one entry per row; the others
  // are left alone) and the logits a row asks for. Called from one thread at a time. On failure the
  // rows' sequences are in an unknown state.
  virtual Status Step(std::span<const StepRow> rows, std::span<int32_t> next_tokens) = 0;
};

// A CpuModel with the CPU KV policies.
class CpuServingModel : public ServingModel {
 public:
  explicit CpuServingModel(CpuModel& model) : model_(model) {}

  const ModelConfig& config() const override { return model_.config(); }
  const Tokenizer& tokenizer() const override { return model_.tokenizer(); }
  const gguf::GgufFile& file() const override { return model_.file(); }
  std::string device() const override { return "cpu"; }
  Result<std::unique_ptr<kv::KvPolicy>> MakePolicy(
      const kv::KvPolicyConfig& config) const override {
    return kv::MakeKvPolicy(config, model_.kv_geometry());
  }
  Status Step(std::span<const StepRow> rows, std::span<int32_t> next_tokens) override;

 private:
  CpuModel& model_;
  std::vector<StepInput> inputs_;
  std::vector<float> logits_;  // [rows, vocab] of sampled rows that did not ask for logits
};

}  // namespace shadowkv::engine
