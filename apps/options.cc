// Shared option declarations.
#include "options.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "format/chat_template.h"

namespace shadowkv::app {

CLI::Option* AddDeviceOption(CLI::App& app, Device& device, const std::string& help) {
  // Parsed as its name so that a bad one is reported by name, not by the enum's numbers.
  return app
      .add_option_function<std::string>(
          "--device",
          [&device](const std::string& name) {
            device = name == "cuda" ? Device::kCuda : Device::kCpu;
          },
          help + " (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
}

void AddTensorParallelOptions(CLI::App& app, TensorParallelOptions& flags) {
  app.add_option("--tensor-parallel", flags.size,
                 "split the model over N GPUs of this host (attention heads and FFN units, NCCL; "
                 "CUDA only)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  // Hidden (empty group): all ranks on one GPU through the single-device communicator.
  app.add_flag("--tp-local", flags.local, "run the --tensor-parallel ranks on one GPU (diagnostic)")
      ->group("");
}

Status TensorParallelNeedsCuda(const TensorParallelOptions& flags) {
  if (flags.size == 1 && !flags.local) return Status::Ok();
  return Error(ErrorCode::kInvalidArgument,
               "--tensor-parallel needs --device cuda (the CPU backend is not split)");
}

Result<std::vector<int32_t>> GenerationPrompt(const gguf::GgufFile& file,
                                              const Tokenizer& tokenizer, const std::string& text,
                                              bool chat, const std::string& system) {
  if (!chat) return tokenizer.Encode(text, true, false);
  SKV_ASSIGN_OR_RETURN(ChatTemplate chat_template, DetectChatTemplate(file));
  std::vector<ChatMessage> messages;
  if (!system.empty()) messages.push_back({"system", system});
  messages.push_back({"user", text});
  return EncodeChat(tokenizer, chat_template, messages, true);
}

void AddModelOptions(CLI::App& app, ModelOptions& options) {
  app.add_option("-m,--model", options.model_path,
                 "GGUF model file (default: $SHADOWKV_MODEL, else the default model fetched by "
                 "scripts/fetch_model.py)");
  app.add_option("-t,--threads", options.threads, "CPU threads (0 = all cores)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--numerics", options.numerics,
                 "exact: fp32 activations and KV (the dequantised model's arithmetic); int8: "
                 "8-bit activations in matmuls and fp16 KV (faster decode)")
      ->capture_default_str();
}

void AddKvOptions(CLI::App& app, kv::KvPolicyConfig& c) {
  app.add_option("--kv", c.policy,
                 "KV policy: full | shadowkv | snapkv | quest | streaming, or one variant with "
                 "settings of its own (shadowkv:accurate=1, shadowkv:rank=64:budget=1024)")
      ->capture_default_str();
  app.add_option("--budget", c.budget_tokens,
                 "sparse policies: tokens attended per KV head (0 = from --budget-fraction)");
  app.add_option("--budget-fraction", c.budget_fraction, "budget as a fraction of the context")
      ->capture_default_str();
  app.add_option("--budget-min", c.budget_min_tokens, "smallest budget for short contexts")
      ->capture_default_str();
  app.add_option("--budget-max", c.budget_max_tokens, "largest budget for long contexts (0 = none)")
      ->capture_default_str();
  app.add_option("--chunk-size", c.chunk_size, "shadowkv: tokens per chunk")->capture_default_str();
  app.add_option("--rank", c.rank, "shadowkv: rank of the pre-RoPE key factorisation (0 = ratio)");
  app.add_option("--rank-ratio", c.rank_ratio,
                 "shadowkv: rank as a fraction of KV heads x head dim")
      ->capture_default_str();
  app.add_option("--rank-energy", c.rank_energy,
                 "shadowkv: per-layer rank holding this share of the key energy (0 = fixed rank)")
      ->capture_default_str();
  app.add_option("--rank-min", c.rank_min,
                 "shadowkv: smallest rank (of the ratio rule and of each layer's energy rule)")
      ->capture_default_str();
  app.add_option("--rank-head-ratio", c.rank_head_ratio,
                 "shadowkv: smallest rank as a share of one KV head's width (a second floor)")
      ->capture_default_str();
  app.add_option("--rank-max", c.rank_max, "shadowkv: largest per-layer rank (0 = the width)")
      ->capture_default_str();
  app.add_option("--select", c.selection,
                 "shadowkv: chunk selection: landmarks | rerank | heads | mass")
      ->capture_default_str();
  app.add_option("--rerank-factor", c.rerank_factor,
                 "shadowkv --select rerank: candidates per kept chunk")
      ->capture_default_str();
  app.add_option("--rerank-min", c.rerank_min_tokens,
                 "shadowkv --select rerank: fewest candidate tokens whatever the factor gives "
                 "(0 = none)")
      ->capture_default_str();
  app.add_option("--rerank-rank", c.rerank_rank,
                 "shadowkv --select rerank: key components candidates are scored with (0 = all)")
      ->capture_default_str();
  app.add_option("--select-mass", c.select_mass,
                 "shadowkv --select mass: share of the landmark score each KV head keeps")
      ->capture_default_str();
  app.add_option("--select-interval", c.select_interval,
                 "shadowkv: decode steps one chunk selection serves (1 = every step; the steps "
                 "between attend the chunks gathered last)")
      ->capture_default_str();
  app.add_option("--outliers", c.outlier_chunks, "shadowkv: outlier chunks per KV head (-1 = auto)")
      ->capture_default_str();
  app.add_option("--local-window", c.local_window, "shadowkv: exact tokens kept at the end")
      ->capture_default_str();
  app.add_flag("--fp8-values{1}", c.fp8_values,
               "shadowkv: store values as FP8 e4m3, one scale per chunk and KV head");
  app.add_flag("--fp8-landmarks{1}", c.fp8_landmarks,
               "shadowkv: store chunk landmarks as FP8 e4m3, one scale per landmark");
  app.add_flag("--exact-keys{1}", c.exact_keys,
               "shadowkv: keep every chunk's exact post-RoPE keys beside its values and attend "
               "to them (twice the slow tier; the rank then serves chunk selection only)");
  app.add_flag("--fp8-keys{1}", c.fp8_keys,
               "shadowkv --exact-keys: store those keys as FP8 e4m3, each less its chunk's "
               "landmark, one scale per chunk and KV head");
  app.add_option("--value-store", c.value_store_path,
                 "shadowkv: directory for a file-backed value store (default: RAM)");
  app.add_option("--snap-window", c.snap_window, "snapkv: observation window")
      ->capture_default_str();
  app.add_option("--snap-kernel", c.snap_kernel, "snapkv: pooling kernel")->capture_default_str();
  app.add_option("--snap-pooling", c.snap_pooling, "snapkv: max | avg")->capture_default_str();
  app.add_option("--page-size", c.quest_page_size, "quest: tokens per page")->capture_default_str();
  app.add_option("--dense-layers", c.quest_dense_layers, "quest: leading layers kept dense")
      ->capture_default_str();
  app.add_option("--sink-tokens", c.sink_tokens, "streaming: attention-sink tokens")
      ->capture_default_str();
  app.add_flag("--paper{1}", c.paper,
               "shadowkv: the published configuration (rank 1/6.4 of the key width, landmark "
               "selection, budget 1.56% with a 256-token floor), as shadowkv:paper=1 elsewhere; "
               "the settings it fixes cannot be given with it");
  // --paper fixes these; naming one as well is refused, as for the variant's paper=1.
  app.parse_complete_callback([&app, &c] {
    if (c.paper != 1) return;
    for (const char* fixed : {"--budget",          "--budget-fraction", "--budget-min",
                              "--budget-max",      "--chunk-size",      "--rank",
                              "--rank-ratio",      "--rank-energy",     "--rank-min",
                              "--rank-head-ratio", "--rank-max",        "--select",
                              "--rerank-factor",   "--rerank-min",      "--rerank-rank",
                              "--select-mass",     "--select-interval", "--outliers",
                              "--local-window",    "--fp8-values",      "--fp8-landmarks",
                              "--exact-keys",      "--fp8-keys"}) {
      if (app.count(fixed) > 0) {
        throw CLI::ValidationError(
            "--paper", std::string("--paper fixes ") + fixed + "; name one or the other");
      }
    }
    c = kv::WithPaperSettings(c);
  });
}

Status ResolveKvVariant(kv::KvPolicyConfig& config) {
  if (config.policy.find(':') == std::string::npos) return Status::Ok();
  SKV_ASSIGN_OR_RETURN(config, kv::ParseKvVariant(config.policy, config));
  return Status::Ok();
}

void AddSamplingOptions(CLI::App& app, SamplingParams& p) {
  app.add_option("--temp", p.temperature, "temperature (0 = greedy)")->capture_default_str();
  app.add_option("--top-k", p.top_k, "keep the k most likely tokens (0 = all)")
      ->capture_default_str();
  app.add_option("--top-p", p.top_p, "nucleus mass")->capture_default_str();
  app.add_option("--seed", p.seed, "random seed")->capture_default_str();
}

Result<std::unique_ptr<CpuModel>> LoadModel(const ModelOptions& options) {
  SKV_ASSIGN_OR_RETURN(Numerics numerics, ParseNumerics(options.numerics));
  const std::string path = ResolveModelPath(options);
  auto model = CpuModel::Load(path, options.threads, numerics);
  if (!model.ok()) {
    return Status(model.status().code(),
                  fmt::format("cannot load model '{}': {}", path, model.status().message()));
  }
  return model;
}

Result<std::string> ReadPromptText(const std::string& text, const std::string& file) {
  std::string result = text;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return Error(ErrorCode::kNotFound, "cannot read prompt file '{}'", file);
    std::stringstream buffer;
    buffer << in.rdbuf();
    result = buffer.str();
  }
  if (result.empty())
    return Error(ErrorCode::kInvalidArgument, "no prompt: give -p TEXT or -f FILE");
  return result;
}

std::string ResolveModelPath(const ModelOptions& options) {
  if (!options.model_path.empty()) return options.model_path;
  if (const char* env = std::getenv("SHADOWKV_MODEL"); env && *env) return env;
  std::string cache;
  if (const char* env = std::getenv("SHADOWKV_CACHE"); env && *env) {
    cache = env;
  } else {
    const char* home = std::getenv("HOME");
    cache = std::string(home ? home : ".") + "/.cache/shadowkv";
  }
  return cache + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace shadowkv::app
