// `shadowkv bench --device cuda`: the CUDA backend's throughput table (see cmd_bench.cc for the
// CPU one, which shares the flags).
#pragma once

#include <cstdint>
#include <string>

#include "kv/kv_config.h"
#include "model/tensor_parallel.h"

namespace shadowkv::app {

struct CudaBenchOptions {
  std::string model_path;   // GGUF model (ignored with synthetic)
  std::string synthetic;    // e.g. "llama3-8b": random weights with that model's shapes
  std::string policies = "full";
  std::string contexts;     // comma-separated, k = 1024
  std::string batches;      // comma-separated counts or "auto" (the largest that fits)
  int gen_tokens = 128;     // timed decode steps
  int prefill_chunk = 4096;
  int max_batch = 64;       // upper bound for "auto" (sizes the step buffers)
  TensorParallelOptions tensor_parallel;
  bool host_values = true;  // shadowkv: also measure batches with values in pinned host memory
  int max_host_sequences = -1;  // shadowkv: at most this many of them (-1: no limit)
  // The KV flags (--budget, --rank, --fp8-values, ...); each --kv item may override them as a
  // variant ("shadowkv:fp8_values=1"). A budget of 0 takes the bench's rule (context / 64).
  kv::KvPolicyConfig kv;
  std::string json_path;
};

// Runs every (policy, context, batch) case and prints the table; returns the exit code.
int RunCudaBench(const CudaBenchOptions& options);

}  // namespace shadowkv::app
