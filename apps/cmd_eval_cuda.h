// `shadowkv eval --device cuda`: the eval's answers from the CUDA backend (full attention and
// ShadowKV on the GPU; the other policies decode on the CPU from the GPU's prefill); tasks,
// prompts and scoring stay with the CPU model's tokenizer.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "eval/runner.h"
#include "model/cpu_model.h"

namespace shadowkv::app {

// Loads `model_path` onto the GPU for prompts of up to `max_tokens` (prompt + answer);
// `cpu_model` (the same file) decodes the policies that have no GPU kernels.
// kUnsupported without a CUDA build or GPU, or for a model the CUDA backend cannot run.
Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string& model_path,
                                                                 CpuModel& cpu_model,
                                                                 int64_t max_tokens,
                                                                 int prefill_chunk);

}  // namespace shadowkv::app
