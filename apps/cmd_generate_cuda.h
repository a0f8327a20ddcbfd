// `shadowkv generate --device cuda`: one prompt generated on the CUDA backend (full attention
// or ShadowKV), optionally split over several GPUs (--tensor-parallel).
#pragma once

#include <cstdint>
#include <string>

#include "engine/sampler.h"
#include "kv/kv_config.h"
#include "model/tensor_parallel.h"

namespace shadowkv::app {

struct CudaGenerateOptions {
  std::string model_path;
  kv::KvPolicyConfig kv;     // policy "full" or "shadowkv"
  SamplingParams sampling;   // temperature and seed (no top-k / top-p on the GPU sampler)
  std::string text;          // the prompt
  bool chat = false;
  std::string system;
  int max_new_tokens = 128;
  int prefill_chunk = 512;
  bool ignore_eos = false;
  bool quiet = false;
  TensorParallelOptions tensor_parallel;
};

// Prints the generated text to stdout (a summary to stderr); returns the exit code.
int RunCudaGenerate(const CudaGenerateOptions& options);

}  // namespace shadowkv::app
