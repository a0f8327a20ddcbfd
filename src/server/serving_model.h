// ServingModel: what the scheduler and the HTTP server need of a model: its shapes, tokenizer and
// GGUF file, KV policies for it, and batched forward steps. CpuServingModel serves a CpuModel
// with any CPU KV policy; the CUDA backend has its own (gpu/serving/cuda_serving_model.h).
#pragma once

#include <memory>
#include <span>
#include <string>

#include "core/status.h"
#include "format/gguf.h"
#include "format/tokenizer.h"
#include "kv/kv_config.h"
#include "kv/kv_policy.h"
#include "model/config.h"
#include "model/cpu_model.h"

namespace shadowkv::server {

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

  // One step over every input (distinct sequences), as CpuModel::Forward. Called from one
  // thread at a time.
  virtual Status Forward(std::span<const StepInput> inputs) = 0;
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
  Status Forward(std::span<const StepInput> inputs) override { return model_.Forward(inputs); }

 private:
  CpuModel& model_;
};

}  // namespace shadowkv::server
