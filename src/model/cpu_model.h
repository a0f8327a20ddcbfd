// CpuModel: a loaded model and its CPU forward pass over a batch of sequences.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/thread_pool.h"
#include "format/gguf.h"
#include "format/tokenizer.h"
#include "kv/kv_policy.h"
#include "model/config.h"
#include "model/weights.h"

namespace shadowkv {

// One sequence's share of a forward step: new tokens at consecutive positions.
struct StepInput {
  kv::SequenceKv* kv = nullptr;     // the sequence's KV state (owned by the caller)
  std::span<const int32_t> tokens;  // new tokens; position of tokens[0] is kv->num_tokens()
  bool finish_prefill = false;      // these are the last prompt tokens: compress afterwards
  // Logits wanted: none, the last token's ([vocab]), or every token's ([tokens, vocab]).
  enum class Logits { kNone, kLast, kAll } logits = Logits::kLast;
  float* logits_out = nullptr;
};

// How the linear layers and the KV cache round numbers.
enum class Numerics {
  // fp32 activations times exactly dequantised weights, fp32 KV: the arithmetic of the
  // dequantised model (what a reference implementation computes in fp32).
  kExact,
  // Activations rounded to 8 bits per 32-block for integer dot products, fp16 KV: the
  // arithmetic class of ggml's CPU backend; decode mat-vecs are several times faster.
  kInt8,
};
const char* NumericsName(Numerics numerics);
Result<Numerics> ParseNumerics(const std::string& name);

// The attention shapes the KV policies need, from a model's config.
kv::KvGeometry KvGeometryOf(const ModelConfig& config);

class CpuModel {
 public:
  // Opens the GGUF file, reads config, tokenizer and weights. num_threads 0 = all cores.
  static Result<std::unique_ptr<CpuModel>> Load(const std::string& path, int num_threads = 0,
                                                Numerics numerics = Numerics::kExact);
  Numerics numerics() const { return numerics_; }

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const gguf::GgufFile& file() const { return *file_; }
  const ModelWeights& weights() const { return weights_; }
  kv::KvGeometry kv_geometry() const;
  ThreadPool& pool() { return *pool_; }

  // Runs the new tokens of every input through the model. Inputs with one token are decode rows
  // (quantised mat-vec kernels: a sequence gets the same result alone or batched); inputs with
  // several tokens are prefill chunks (exact fp32 GEMMs). Errors (context overflow, bad token
  // ids) leave the KV state of the failing sequence unusable and are reported for the step.
  Status Forward(std::span<const StepInput> inputs);

 private:
  CpuModel() = default;
  struct Rows;  // row bookkeeping of one step
  void Linear(const LinearWeight& w, const float* x, float* y, const Rows& rows);

  std::unique_ptr<gguf::GgufFile> file_;
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  ModelWeights weights_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Rope> rope_;
  std::unique_ptr<Rope> rope_windowed_;  // sliding layers' rotation, where any layer slides
  Numerics numerics_ = Numerics::kExact;
  std::vector<float> rounded_;  // scratch: rounded activations of prefill rows
};

}  // namespace shadowkv
