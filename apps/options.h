// Command-line options shared by every subcommand (declared once, used by all frontends).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "kv/kv_config.h"
#include "model/tensor_parallel.h"

namespace shadowkv::app {

struct ModelOptions {
  std::string model_path;  // empty: the default model in the cache
  int threads = 0;
  std::string numerics = "exact";  // exact | int8 (see Numerics in model/cpu_model.h)
};

// Registers -m/--model and -t/--threads.
void AddModelOptions(CLI::App& app, ModelOptions& options);
// Registers --kv and every policy setting (--budget, --rank, ...).
void AddKvOptions(CLI::App& app, kv::KvPolicyConfig& config);
// Where --kv named one variant (shadowkv:accurate=1, shadowkv:rank=64: a policy with settings
// of its own, as bench and eval name them), `config` with that variant's settings over the flags'.
Status ResolveKvVariant(kv::KvPolicyConfig& config);
// Registers --temp, --top-k, --top-p, --seed.
void AddSamplingOptions(CLI::App& app, SamplingParams& params);

// Which backend a subcommand runs on.
enum class Device { kCpu, kCuda };
// Registers --device cpu|cuda into `device` (any other value is a usage error), with `help`.
CLI::Option* AddDeviceOption(CLI::App& app, Device& device, const std::string& help);

// Registers --tensor-parallel N and the hidden --tp-local.
void AddTensorParallelOptions(CLI::App& app, TensorParallelOptions& flags);

// Registers the CUDA kernels' tuning flags (`shadowkv bench`); defined in cuda_environment.cc,
// whose KernelOptionsFromFlags() hands what they set to the library.
void AddKernelTuningOptions(CLI::App& app);
// `--tensor-parallel` on a command's CPU path: Ok for size 1, else an error naming --device cuda.
Status TensorParallelNeedsCuda(const TensorParallelOptions& flags);

// The prompt `generate` runs: `text` as is, or as the user message of the model's chat template
// (after `system` when not empty).
Result<std::vector<int32_t>> GenerationPrompt(const gguf::GgufFile& file,
                                              const Tokenizer& tokenizer, const std::string& text,
                                              bool chat, const std::string& system);

// Loads the model the options name, reporting errors as a message for the user.
Result<std::unique_ptr<CpuModel>> LoadModel(const ModelOptions& options);

// The prompt: `text`, or the contents of `file` when one is named; an error when neither gives
// any text or the file cannot be read.
Result<std::string> ReadPromptText(const std::string& text, const std::string& file);

// The model path to open: the flag, else $SHADOWKV_MODEL, else the default model's cache path.
std::string ResolveModelPath(const ModelOptions& options);

}  // namespace shadowkv::app
