// `shadowkv generate`: one prompt in, streamed text out, a speed and memory summary on stderr;
// through the engine loop on the CPU model, or with --device cuda on the GPU's serving model
// (full attention or ShadowKV).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "commands.h"
#include "core/status.h"
#include "cuda_environment.h"
#include "engine/engine.h"
#include "engine/serving_model.h"
#include "format/gguf.h"
#include "format/tokenizer.h"
#include "kv/policies.h"
#include "options.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "gpu/serving/cuda_serving_model.h"
#include "gpu/tp/cuda_model_group.h"
#endif

namespace shadowkv::app {

int Fail(const std::string& message) {
  std::fprintf(stderr, "shadowkv: %s\n", message.c_str());
  return 1;
}

namespace {

using Clock = std::chrono::steady_clock;

struct GenerateOptions {
  ModelOptions model;
  kv::KvPolicyConfig kv;
  SamplingParams sampling;
  std::string prompt;
  std::string prompt_file;
  std::string system;
  bool chat = false;
  int max_new_tokens = 128;
  int prefill_chunk = 512;
  bool ignore_eos = false;
  bool quiet = false;
  Device device = Device::kCpu;
  TensorParallelOptions tensor_parallel;  // cuda only
};

std::string FormatBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.1f} {}", value, units[unit]);
}

// The model `generate` runs on: the CPU model with any KV policy, or the GPU's serving model
// (split or not) with a pool of one sequence sized for this prompt. Both run the engine loop.
struct LoadedModel {
  std::unique_ptr<CpuModel> cpu;
  std::unique_ptr<engine::ServingModel> serving;
  std::unique_ptr<kv::KvPolicy> policy;
  std::vector<int32_t> prompt;
};

Result<LoadedModel> LoadForGenerate(const GenerateOptions& o, const std::string& text) {
  LoadedModel loaded;
  if (o.device == Device::kCuda) {
#ifdef SHADOWKV_HAVE_CUDA
    cuda::PrepareProcessForTensorParallel(o.tensor_parallel.size);  // before any CUDA call
    const std::string path = ResolveModelPath(o.model);
    // The prompt first: the GPU's pool is sized for it.
    SKV_ASSIGN_OR_RETURN(auto file, gguf::GgufFile::Open(path));
    SKV_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::FromGguf(*file));
    SKV_ASSIGN_OR_RETURN(loaded.prompt,
                         GenerationPrompt(*file, *tokenizer, text, o.chat, o.system));
    cuda::CudaServingOptions c;
    c.kv = o.kv;
    c.max_batch = 1;
    c.sequences = 1;
    c.prefill_chunk = o.prefill_chunk;
    c.context = static_cast<int64_t>(loaded.prompt.size()) + o.max_new_tokens;
    c.tensor_parallel = o.tensor_parallel;
    SKV_RETURN_IF_ERROR(ApplyTensorParallelEnvironment(&c.tensor_parallel));
    c.kernels = KernelOptionsFromFlags();
    SKV_ASSIGN_OR_RETURN(loaded.serving, cuda::CudaServingModel::Load(path, c));
#else
    return Error(ErrorCode::kUnsupported, "{}", kBuiltWithoutCuda);
#endif
  } else {
    SKV_RETURN_IF_ERROR(TensorParallelNeedsCuda(o.tensor_parallel));
    SKV_ASSIGN_OR_RETURN(loaded.cpu, LoadModel(o.model));
    loaded.serving = std::make_unique<engine::CpuServingModel>(*loaded.cpu);
    SKV_ASSIGN_OR_RETURN(
        loaded.prompt,
        GenerationPrompt(loaded.cpu->file(), loaded.cpu->tokenizer(), text, o.chat, o.system));
  }
  SKV_ASSIGN_OR_RETURN(loaded.policy, loaded.serving->MakePolicy(o.kv));
  return loaded;
}

int RunGenerate(GenerateOptions o) {
  // --kv also takes one variant (shadowkv:accurate=1), as serve, bench and eval do.
  if (Status s = ResolveKvVariant(o.kv); !s.ok()) return Fail(s.ToString());
  auto prompt_text = ReadPromptText(o.prompt, o.prompt_file);
  if (!prompt_text.ok()) return Fail(prompt_text.status().message());
  auto loaded = LoadForGenerate(o, *prompt_text);
  if (!loaded.ok()) return Fail(loaded.status().ToString());
  engine::ServingModel& model = *loaded->serving;
  const kv::KvPolicy& policy = *loaded->policy;
  const std::vector<int32_t>& prompt = loaded->prompt;

  GenerationRequest request;
  request.prompt = prompt;
  request.max_new_tokens = o.max_new_tokens;
  request.sampling = o.sampling;
  request.stop_at_end_of_generation = !o.ignore_eos;
  EngineOptions engine_options;
  engine_options.prefill_chunk = o.prefill_chunk;
  Engine engine(model, policy, engine_options);
  if (Status s = engine.Validate(request); !s.ok()) return Fail(s.ToString());

  const bool progress = isatty(STDERR_FILENO) && !o.quiet;
  const auto start = Clock::now();
  Clock::time_point first_token_time;
  StreamingDecoder decoder(model.tokenizer(), /*skip_special=*/true);
  bool first = true;
  auto on_prefill = [&](int, int64_t done, int64_t total) {
    if (!progress || done == total) return;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::fprintf(stderr, "\rprefill %lld/%lld tokens, %.0f tokens/s", static_cast<long long>(done),
                 static_cast<long long>(total), done / std::max(seconds, 1e-9));
  };
  auto on_token = [&](int, int32_t token) {
    if (first) {
      first_token_time = Clock::now();
      first = false;
      if (progress) std::fprintf(stderr, "\r\033[K");
    }
    const std::string piece = decoder.Push(token);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    return true;
  };
  std::vector<GenerationResult> results =
      engine.Run(std::span<const GenerationRequest>(&request, 1), on_token, on_prefill);
  const auto end = Clock::now();
  const std::string tail = decoder.Flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);  // the summary goes to stderr after the text
  const GenerationResult& r = results[0];
  if (!r.status.ok()) return Fail(r.status.ToString());

  if (!o.quiet) {
    const double prefill_s = std::chrono::duration<double>(first_token_time - start).count();
    const double decode_s = std::chrono::duration<double>(end - first_token_time).count();
    const size_t decoded = r.tokens.size() > 0 ? r.tokens.size() - 1 : 0;
    std::fprintf(stderr,
                 "[%s, %s] prompt %zu tokens: prefill %.2f s (%.1f tokens/s); generated %zu "
                 "tokens (%s): decode %.1f tokens/s\n",
                 std::string(policy.name()).c_str(), model.device().c_str(), prompt.size(),
                 prefill_s, prompt.size() / std::max(prefill_s, 1e-9), r.tokens.size(),
                 FinishReasonName(r.finish_reason), decoded / std::max(decode_s, 1e-9));
    std::fprintf(stderr, "KV memory: fast tier %s, slow tier %s",
                 FormatBytes(r.kv_memory.fast_bytes).c_str(),
                 FormatBytes(r.kv_memory.slow_bytes).c_str());
    if (r.kv_stats.chunk_selections > 0) {
      std::fprintf(stderr, "; chunk hit rate %.1f%%", 100.0 * r.kv_stats.hit_rate());
    }
    std::fprintf(stderr, "\n");
  }
  return 0;
}

}  // namespace

Command AddGenerateCommand(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a prompt");
  AddModelOptions(*cmd, options->model);
  AddKvOptions(*cmd, options->kv);
  AddSamplingOptions(*cmd, options->sampling);
  auto* prompt = cmd->add_option("-p,--prompt", options->prompt, "prompt text");
  cmd->add_option("-f,--file", options->prompt_file, "read the prompt from a file")
      ->excludes(prompt);
  cmd->add_flag("--chat", options->chat, "wrap the prompt in the model's chat template");
  cmd->add_option("--system", options->system, "system message for --chat");
  cmd->add_option("-n,--max-tokens", options->max_new_tokens, "tokens to generate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--prefill-chunk", options->prefill_chunk, "prompt tokens per forward step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--ignore-eos", options->ignore_eos, "keep generating past end-of-text tokens");
  cmd->add_flag("-q,--quiet", options->quiet, "no progress line or summary");
  AddDeviceOption(*cmd, options->device, "cpu, or cuda (full and shadowkv KV)");
  AddTensorParallelOptions(*cmd, options->tensor_parallel);
  return [options] { return RunGenerate(*options); };
}

Command AddFetchModelCommand(CLI::App& app) {
  auto name = std::make_shared<std::string>("smollm2-135m-instruct");
  CLI::App* cmd = app.add_subcommand("fetch-model", "Download and verify the default model");
  cmd->add_option("--model", *name, "model name (see scripts/fetch_model.py --list)");
  return [name] {
    for (char ch : *name) {
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '.' && ch != '_') {
        return Fail(
            fmt::format("model name '{}' has characters other than letters, digits, "
                        "'-', '.' and '_'",
                        *name));
      }
    }
    const std::string script = std::string(SHADOWKV_SOURCE_DIR) + "/scripts/fetch_model.py";
    const std::string command = fmt::format("python3 '{}' --model '{}'", script, *name);
    return std::system(command.c_str()) == 0 ? 0 : 1;
  };
}

}  // namespace shadowkv::app
