// `shadowkv eval --device cuda`: the answer backend on the GPU (eval_cuda_backend.cc). Full
// attention and ShadowKV answer on the GPU from one prefill per sample; SnapKV, Quest and
// StreamingLLM (and ShadowKV where its kernels do not take the model's heads) take the GPU's
// prompt keys and values and decode on the CPU; conversations (multi-turn NIAH) hold one
// policy's sequence at a time on the GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "eval/runner.h"
#include "model/cpu_model.h"

namespace shadowkv::app {

// Loads `model_path` onto the GPU for prompts of up to `max_tokens` (prompt + answer);
// `cpu_model` (the same file) decodes the policies that have no GPU kernels. `fidelity` gives
// full attention a second slot to answer in; `recompress_followups` and `keep_keys` choose how
// a conversation's later turn reaches a held ShadowKV sequence (`eval --held-turns`).
// kUnsupported without a CUDA build or GPU, or for a model the CUDA backend cannot run.
Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string& model_path,
                                                                 CpuModel& cpu_model,
                                                                 int64_t max_tokens,
                                                                 int prefill_chunk, bool fidelity,
                                                                 bool recompress_followups,
                                                                 bool keep_keys);

}  // namespace shadowkv::app
