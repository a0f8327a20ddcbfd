// `shadowkv generate`: one prompt in, streamed text out, a speed and memory summary on stderr;
// on the CPU engine, or with --device cuda on the CUDA backend (full attention or ShadowKV).
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
#include "options.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "format/gguf.h"
#include "format/tokenizer.h"
#include "gpu/tp/cuda_model_group.h"
#include "kv/policies.h"
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

#ifdef SHADOWKV_HAVE_CUDA

struct Generated {
  std::vector<int32_t> tokens;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  bool stopped = false;  // at an end-of-generation token
};

// Prefill (with pre-RoPE keys and compression for ShadowKV), then decode; `emit` gets every
// new token as it is known.
template <typename Emit>
Result<Generated> Generate(cuda::CudaModelGroup& model, const GenerateOptions& o,
                           const Tokenizer& tokenizer, const std::vector<int32_t>& prompt,
                           Emit emit) {
  const bool shadowkv = kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv);
  const int64_t length = static_cast<int64_t>(prompt.size());
  const int64_t capacity = length + o.max_new_tokens;
  if (capacity > model.config().context_length) {
    return Error(ErrorCode::kOutOfRange,
                 "prompt of {} tokens plus {} new ones exceeds the "
                 "model's context of {}",
                 length, o.max_new_tokens, model.config().context_length);
  }
  Generated g;
  const auto start = Clock::now();
  SKV_RETURN_IF_ERROR(model.AllocateKvCache(1, shadowkv ? length : capacity, shadowkv));
  std::vector<float> logits(model.config().vocab_size);
  for (int64_t done = 0; done < length; done += o.prefill_chunk) {
    const int64_t count = std::min<int64_t>(o.prefill_chunk, length - done);
    cuda::CudaStepInput in;
    in.slot = 0;
    in.tokens = std::span<const int32_t>(prompt.data() + done, count);
    in.logits_out = done + count == length ? logits.data() : nullptr;
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const cuda::CudaStepInput>(&in, 1)));
  }
  if (shadowkv) {
    SKV_RETURN_IF_ERROR(model.AllocateShadowKv(o.kv, 1, capacity));
    SKV_RETURN_IF_ERROR(model.AllocateShadowKvValues(0, false));
    SKV_RETURN_IF_ERROR(model.CompressToShadowKv(0, 0));
    model.FreeKvCache();
  }
  // The first token (draw 0) from the prefill's logits on the host, the rest sampled on the GPU
  // with the same settings and the same counter-based noise (draw n for the n-th new token).
  int32_t token = SampleAt(logits, o.sampling, 0);
  g.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto decode_start = Clock::now();
  cuda::CudaSampling sampling{o.sampling.temperature, o.sampling.top_k, o.sampling.top_p,
                              o.sampling.seed};
  const std::vector<int> slots = {0};
  for (;;) {
    g.tokens.push_back(token);
    emit(token);
    if (!o.ignore_eos && tokenizer.IsEndOfGeneration(token)) {
      g.stopped = true;
      break;
    }
    if (static_cast<int>(g.tokens.size()) >= o.max_new_tokens) break;
    std::vector<int32_t> step = {token};
    sampling.draw = g.tokens.size();
    const std::span<const cuda::CudaSampling> row(&sampling, 1);
    SKV_RETURN_IF_ERROR(shadowkv ? model.ShadowKvDecodeStep(slots, step, row)
                                 : model.DecodeStep(slots, step, row));
    token = step[0];
  }
  g.decode_seconds = std::chrono::duration<double>(Clock::now() - decode_start).count();
  return g;
}

// One prompt on the CUDA backend: tokenised with the GGUF's tokenizer, prefilled in chunks, then
// decoded one token per step (graph-replayed, sampled on the GPU). ShadowKV compresses the
// prefilled prompt first.
int RunCudaGenerate(const GenerateOptions& o, const std::string& model_path,
                    const std::string& text) {
  cuda::PrepareProcessForTensorParallel(o.tensor_parallel.size);  // before any CUDA call
  if (!kv::IsPolicy(o.kv, kv::PolicyKind::kFull) &&
      !kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv)) {
    return Fail(
        fmt::format("--device cuda generates with --kv full or shadowkv, not '{}'", o.kv.policy));
  }
  if (o.sampling.top_k != 0 || o.sampling.top_p != 1.0f) {
    return Fail("--device cuda samples with --temp and --seed only (no --top-k / --top-p)");
  }
  if (Status s = o.sampling.Validate(); !s.ok()) return Fail(s.ToString());
  auto file = gguf::GgufFile::Open(model_path);
  if (!file.ok()) return Fail(file.status().ToString());
  auto tokenizer = Tokenizer::FromGguf(**file);
  if (!tokenizer.ok()) return Fail(tokenizer.status().ToString());
  auto prompt = GenerationPrompt(**file, **tokenizer, text, o.chat, o.system);
  if (!prompt.ok()) return Fail(prompt.status().ToString());
  if (prompt->empty()) return Fail("the prompt has no tokens");

  TensorParallelOptions tensor_parallel = o.tensor_parallel;
  if (Status s = ApplyTensorParallelEnvironment(&tensor_parallel); !s.ok()) {
    return Fail(s.ToString());
  }
  cuda::CudaModelOptions options;
  options.max_batch = 1;
  options.max_step_tokens = std::max(1, o.prefill_chunk);
  options.kernels = KernelOptionsFromFlags();
  auto model = cuda::CudaModelGroup::Load(model_path, options, tensor_parallel);
  if (!model.ok()) return Fail(model.status().ToString());
  if ((*tokenizer)->vocab_size() != (*model)->config().vocab_size) {
    return Fail(fmt::format("the tokenizer has {} tokens, the model {}", (*tokenizer)->vocab_size(),
                            (*model)->config().vocab_size));
  }

  StreamingDecoder decoder(**tokenizer, /*skip_special=*/true);
  auto emit = [&](int32_t token) {
    const std::string piece = decoder.Push(token);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  auto generated = Generate(**model, o, **tokenizer, *prompt, emit);
  const std::string tail = decoder.Flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!generated.ok()) return Fail(generated.status().ToString());
  if (!o.quiet) {
    const Generated& g = *generated;
    const size_t decoded = g.tokens.size() > 0 ? g.tokens.size() - 1 : 0;
    std::fprintf(
        stderr,
        "[%s, cuda, %d rank%s] prompt %zu tokens: prefill %.2f s (%.1f tokens/s); "
        "generated %zu tokens (%s): decode %.1f tokens/s\n",
        o.kv.policy.c_str(), (*model)->size(), (*model)->size() == 1 ? "" : "s", prompt->size(),
        g.prefill_seconds, prompt->size() / std::max(g.prefill_seconds, 1e-9), g.tokens.size(),
        g.stopped ? "end of text" : "token limit", decoded / std::max(g.decode_seconds, 1e-9));
  }
  return 0;
}

#else

int RunCudaGenerate(const GenerateOptions&, const std::string&, const std::string&) {
  return Fail(kBuiltWithoutCuda);
}

#endif  // SHADOWKV_HAVE_CUDA

int RunGenerate(const GenerateOptions& o) {
  auto prompt_text = ReadPromptText(o.prompt, o.prompt_file);
  if (!prompt_text.ok()) return Fail(prompt_text.status().message());
  const std::string& text = *prompt_text;
  if (o.device == Device::kCuda) return RunCudaGenerate(o, ResolveModelPath(o.model), text);
  if (Status tp = TensorParallelNeedsCuda(o.tensor_parallel); !tp.ok()) return Fail(tp.message());

  auto model_or = LoadModel(o.model);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  CpuModel& model = **model_or;
  auto policy_or = kv::MakeKvPolicy(o.kv, model.kv_geometry());
  if (!policy_or.ok()) return Fail(policy_or.status().ToString());

  auto prompt_or = GenerationPrompt(model.file(), model.tokenizer(), text, o.chat, o.system);
  if (!prompt_or.ok()) return Fail(prompt_or.status().ToString());
  const std::vector<int32_t>& prompt = *prompt_or;

  GenerationRequest request;
  request.prompt = prompt;
  request.max_new_tokens = o.max_new_tokens;
  request.sampling = o.sampling;
  request.stop_at_end_of_generation = !o.ignore_eos;
  EngineOptions engine_options;
  engine_options.prefill_chunk = o.prefill_chunk;
  Engine engine(model, **policy_or, engine_options);
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
                 "[%s] prompt %zu tokens: prefill %.2f s (%.1f tokens/s); generated %zu tokens "
                 "(%s): decode %.1f tokens/s\n",
                 std::string((*policy_or)->name()).c_str(), prompt.size(), prefill_s,
                 prompt.size() / std::max(prefill_s, 1e-9), r.tokens.size(),
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
  AddDeviceOption(*cmd, options->device,
                  "cpu, or cuda (full and shadowkv KV; --temp and --seed sampling)");
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
