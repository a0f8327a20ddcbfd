// `shadowkv serve`: the OpenAI-compatible HTTP server (see docs/SERVER.md).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <semaphore.h>
#include <signal.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "commands.h"
#include "cuda_environment.h"
#include "kv/policies.h"
#include "model/synthetic.h"
#include "options.h"
#include "server/http_server.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "gpu/serving/cuda_serving_model.h"
#include "gpu/tp/cuda_model_group.h"
#endif

namespace shadowkv::app {
namespace {

struct ServeOptions {
  ModelOptions model;
  kv::KvPolicyConfig kv;
  server::ServerConfig server;
  double fast_limit_mib = 4096;
  double slow_limit_mib = 16384;
  double max_body_kib = 1024;
  double max_header_kib = 32;
  double shutdown_grace_seconds = 10;
  Device device = Device::kCpu;
  int64_t context = 0;           // cuda: tokens per sequence (0: the model's context)
  int sequences = 0;             // cuda: sequences held at once (0: as many as fit)
  int prefill_slots = 0;         // cuda, shadowkv: full-cache slots for prompts (0: see --help)
  std::string held_turns;  // cuda, shadowkv: --held-turns (empty: exact)
  bool max_batch_given = false;  // cuda: else the scheduler's batch follows the pool
  std::string synthetic;         // cuda: random weights with a named model's shapes
  TensorParallelOptions tensor_parallel;  // cuda only
};

// The model the server runs on: the CPU model with every KV policy, or the GPU (split or not)
// with full attention or ShadowKV from a fixed pool of sequences.
struct LoadedModel {
  std::unique_ptr<CpuModel> cpu;
  std::unique_ptr<engine::ServingModel> serving;
  std::string pool;   // the GPU pool in words
  int max_batch = 0;  // the GPU pool's batch (0: the scheduler's option stands)
};

// --synthetic: a GPU-only, weight-free model; a model file beside it would be ignored.
Status CheckSynthetic(const ServeOptions& o) {
  if (o.synthetic.empty()) return Status::Ok();
  if (o.device != Device::kCuda) {
    return Error(ErrorCode::kInvalidArgument,
                 "--synthetic needs --device cuda (random weights exist only on the GPU)");
  }
  if (!o.model.model_path.empty()) {
    return Error(ErrorCode::kInvalidArgument,
                 "--synthetic makes random weights; it takes no model file (-m {})",
                 o.model.model_path);
  }
  return SyntheticModelConfig(o.synthetic).status();
}

Result<LoadedModel> LoadServingModel(const ServeOptions& o) {
  LoadedModel loaded;
  SKV_RETURN_IF_ERROR(CheckSynthetic(o));
  if (o.device == Device::kCuda) {
    if (!o.held_turns.empty() && !kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv)) {
      return Error(ErrorCode::kInvalidArgument,
                   "--held-turns chooses how held ShadowKV sequences take later turns; --kv {} "
                   "holds full-cache slots",
                   o.kv.policy);
    }
    if (o.prefill_slots > 0 && !kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv)) {
      return Error(ErrorCode::kInvalidArgument,
                   "--prefill-slots sizes ShadowKV's prompt slots; with --kv {} every sequence "
                   "is a full-cache slot (--max-seqs)",
                   o.kv.policy);
    }
#ifdef SHADOWKV_HAVE_CUDA
    cuda::PrepareProcessForTensorParallel(o.tensor_parallel.size);  // before any CUDA call
    cuda::CudaServingOptions c;
    c.kv = o.kv;
    c.max_batch = o.max_batch_given ? o.server.scheduler.max_batch : 0;
    c.prefill_chunk = o.server.scheduler.prefill_chunk;
    c.sequences = o.sequences;
    c.prefill_slots = o.prefill_slots;
    c.recompress_turns = o.held_turns != "decode";
    c.keep_prompt_keys = o.held_turns.empty() || o.held_turns == "exact";
    c.context = o.context;
    c.tensor_parallel = o.tensor_parallel;
    SKV_RETURN_IF_ERROR(ApplyTensorParallelEnvironment(&c.tensor_parallel));
    c.kernels = KernelOptionsFromFlags();
    Result<std::unique_ptr<cuda::CudaServingModel>> model_or =
        Error(ErrorCode::kInternal, "no model");
    if (o.synthetic.empty()) {
      model_or = cuda::CudaServingModel::Load(ResolveModelPath(o.model), c);
    } else {
      SKV_ASSIGN_OR_RETURN(const ModelConfig config, SyntheticModelConfig(o.synthetic));
      model_or = cuda::CudaServingModel::CreateSynthetic(config, c);
    }
    SKV_ASSIGN_OR_RETURN(auto model, std::move(model_or));
    SKV_RETURN_IF_ERROR(model->WarmUp());
    loaded.pool = model->Describe();
    loaded.max_batch = model->max_batch();
    loaded.serving = std::move(model);
    return loaded;
#else
    return Error(ErrorCode::kUnsupported, "{}", kBuiltWithoutCuda);
#endif
  }
  SKV_RETURN_IF_ERROR(TensorParallelNeedsCuda(o.tensor_parallel));
  if (o.context > 0 || o.sequences > 0 || o.prefill_slots > 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "--ctx-size, --max-seqs and --prefill-slots size the GPU's pool (--device cuda)");
  }
  if (!o.held_turns.empty()) {
    return Error(ErrorCode::kInvalidArgument,
                 "--held-turns is the GPU's (--device cuda); the CPU's ShadowKV takes a later "
                 "turn's tokens in its held sequence");
  }
  SKV_ASSIGN_OR_RETURN(loaded.cpu, LoadModel(o.model));
  loaded.serving = std::make_unique<engine::CpuServingModel>(*loaded.cpu);
  return loaded;
}

// SIGTERM/SIGINT: the handler (in whichever thread the signal lands, e.g. one that a library
// started before main) only posts the semaphore that the stop thread waits on.
sem_t stop_requested;
volatile sig_atomic_t stop_signal = 0;

void OnStopSignal(int signal_number) {
  stop_signal = signal_number;
  sem_post(&stop_requested);
}

int RunServe(ServeOptions& o) {
  sem_init(&stop_requested, 0, 0);
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client closing its socket must not kill the process
  // Every connection is a descriptor: the usual soft limit of 1024 is below --max-connections'
  // default plus the server's own files (the server uses epoll and poll, never select).
  if (rlimit files{}; getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }

  // --kv also takes one variant, as bench and eval name them (shadowkv:paper=1, shadowkv:rank=64).
  if (Status s = ResolveKvVariant(o.kv); !s.ok()) return Fail(s.ToString());
  auto loaded = LoadServingModel(o);
  if (!loaded.ok()) return Fail(loaded.status().ToString());
  engine::ServingModel& model = *loaded->serving;
  server::ServerConfig config = o.server;
  config.kv = o.kv;
  if (loaded->max_batch > 0) config.scheduler.max_batch = loaded->max_batch;
  if (o.device == Device::kCpu) {
    config.scheduler.fast_memory_limit = static_cast<int64_t>(o.fast_limit_mib * 1024 * 1024);
    config.scheduler.slow_memory_limit = static_cast<int64_t>(o.slow_limit_mib * 1024 * 1024);
  }  // on the GPU the pool made at load time is the limit
  config.http.limits.max_body_bytes = static_cast<size_t>(o.max_body_kib * 1024);
  config.http.limits.max_head_bytes = static_cast<size_t>(o.max_header_kib * 1024);
  if (!o.synthetic.empty()) config.weights_label = std::string(kSyntheticLabel);
  if (config.model_id.empty()) {
    config.model_id = o.synthetic.empty()
                          ? std::filesystem::path(ResolveModelPath(o.model)).stem().string()
                          : o.synthetic + "-synthetic";
  }
  auto server_or = server::HttpServer::Create(model, config);
  if (!server_or.ok()) return Fail(server_or.status().ToString());
  server::HttpServer& server = **server_or;
  if (Status s = server.Bind(); !s.ok()) return Fail(s.ToString());
  // Tests and scripts read the port from this line, the first (with --port 0 the system picks
  // it).
  std::printf("shadowkv serve: listening on http://%s:%d (model %s, kv %s, %s%s)\n",
              config.http.host.c_str(), server.port(), config.model_id.c_str(), o.kv.policy.c_str(),
              model.device().c_str(), config.weights_label.empty() ? "" : ", synthetic weights");
  if (!config.weights_label.empty()) {
    std::printf("shadowkv serve: *** %s ***\n", config.weights_label.c_str());
  }
  if (!loaded->pool.empty()) std::printf("shadowkv serve: GPU pool: %s\n", loaded->pool.c_str());
  std::fflush(stdout);

  std::thread signal_thread([&] {
    while (sem_wait(&stop_requested) != 0 && errno == EINTR) {
    }
    if (stop_signal == 0) return;  // woken because the listener stopped on its own
    std::fprintf(stderr, "shadowkv serve: signal %d, finishing running requests\n",
                 static_cast<int>(stop_signal));
    server.Stop(std::chrono::milliseconds(static_cast<int64_t>(o.shutdown_grace_seconds * 1000)));
  });
  const bool served = server.Serve();
  if (!served) sem_post(&stop_requested);  // wake the stop thread so that it can be joined
  signal_thread.join();
  server_or->reset();
  std::fprintf(stderr, "shadowkv serve: stopped\n");
  return served ? 0 : 1;
}

}  // namespace

Command AddServeCommand(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (docs/SERVER.md)");
  AddModelOptions(*cmd, o->model);
  AddKvOptions(*cmd, o->kv);
  server::ServerConfig& s = o->server;
  cmd->add_option("--host", s.http.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", s.http.port, "port (0 = any free port, printed at start)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--model-id", s.model_id,
                  "model name reported by /v1/models (default: file stem)");
  cmd->add_option("--max-batch", s.scheduler.max_batch,
                  "sequences running together (cuda, when not given: the pool's size, at most "
                  "1024)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-queue", s.scheduler.max_queue,
                  "requests waiting for a batch slot; more get 429")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--prefill-chunk", s.scheduler.prefill_chunk,
                  "prompt tokens per step (smaller: running streams stall less)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-fast-limit", o->fast_limit_mib,
                  "MiB of fast-tier KV for running and held sequences (0 = no limit; CPU only)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--kv-slow-limit", o->slow_limit_mib,
                  "MiB of slow-tier KV (0 = no limit; CPU only)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-held", s.scheduler.max_held_states,
                  "finished KV states kept for multi-turn reuse (0 = no reuse)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-body", o->max_body_kib, "largest request body in KiB (more: 413)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--timeout", s.request_timeout_seconds, "per-request time limit in seconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--default-max-tokens", s.default_max_tokens,
                  "chat max_tokens when a request gives none")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--http-threads", s.http.generation_threads,
                  "generation requests served at once (each open stream holds one; more: 503)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-header", o->max_header_kib,
                  "largest request line plus headers in KiB (more: 431)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--header-timeout", s.http.header_timeout_seconds,
                  "seconds for a whole request head to arrive, from its first byte (then 408)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--body-timeout", s.http.body_timeout_seconds,
                  "seconds for a whole request body to arrive, after the head (then 408)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--idle-timeout", s.http.idle_timeout_seconds,
                  "seconds a kept-alive connection may wait for its next request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--send-timeout", s.http.send_timeout_seconds,
                  "seconds each write of a response may wait on a client that does not read")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-connections", s.http.max_connections,
                  "open connections; past it idle ones are closed, else 503")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-client-connections", s.http.max_client_connections,
                  "open connections per client address; past it idle ones are closed, else 429")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--shutdown-grace", o->shutdown_grace_seconds,
                  "seconds running requests get to finish after SIGTERM")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  AddDeviceOption(*cmd, o->device,
                  "cpu (every KV policy), or cuda (full or shadowkv, from a pool of sequences "
                  "made at start: --ctx-size, --max-seqs, --prefill-slots)");
  cmd->add_option("--ctx-size", o->context,
                  "cuda: tokens per sequence, prompt plus new ones (0 = the model's context)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-seqs", o->sequences,
                  "cuda: sequences held at once, running or kept for reuse (0 = as many as the "
                  "GPU memory left after the weights and step buffers holds)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--prefill-slots", o->prefill_slots,
                  "cuda, shadowkv: full-cache slots for prompts being prefilled and prompts too "
                  "short to compress (0 = --max-seqs, or 2 when --max-seqs is 0)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--held-turns", o->held_turns,
                  "cuda, shadowkv: how a held sequence takes a later turn's new tokens: exact "
                  "(the default: back into a free prompt slot from a pinned host copy of the "
                  "prompt's exact keys, the new tokens prefilled with full attention, the whole "
                  "compressed again; the copies take as much host memory as bf16 values, up to "
                  "a quarter of the host's available memory, past which recompress), recompress "
                  "(the same from the rank-r keys), or decode (one ShadowKV decode step per "
                  "token; also where no prompt slot is free)")
      ->check(CLI::IsMember({"decode", "recompress", "exact"}));
  cmd->add_option("--synthetic", o->synthetic,
                  "cuda: random weights with a named model's shapes (" +
                      fmt::format("{}", fmt::join(SyntheticModelNames(), ", ")) +
                      ") and a synthetic vocabulary, for throughput only; no -m");
  AddTensorParallelOptions(*cmd, o->tensor_parallel);
  return [o, cmd] {
    o->max_batch_given = cmd->count("--max-batch") > 0;
    return RunServe(*o);
  };
}

}  // namespace shadowkv::app
