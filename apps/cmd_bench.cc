// `shadowkv bench`: prefill and decode throughput per KV policy, context length and batch, on
// the CPU model or, with --device cuda, on the CUDA backend (real or synthetic weights).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <vector>

#include "commands.h"
#include "core/status.h"
#include "cuda_environment.h"
#include "engine/loop_bench.h"
#include "engine/sampler.h"
#include "engine/serving_model.h"
#include "kv/kv_config.h"
#include "model/cpu_model.h"
#include "options.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "gpu/bench/cuda_bench.h"
#include "gpu/model/cuda_model.h"
#include "gpu/serving/cuda_serving_model.h"
#include "gpu/serving/pool_memory.h"
#include "gpu/tp/cuda_model_group.h"
#include "model/synthetic.h"
#include "ops/cuda/common/cuda_backend.h"
#endif

namespace shadowkv::app {
namespace {

struct BenchOptions {
  ModelOptions model;
  kv::KvPolicyConfig kv;
  std::string policies = "full";
  std::string contexts = "512";
  std::string batches = "1";
  int gen_tokens = 128;
  int prefill_chunk = 512;
  int repeat = 1;
  std::string json_path;
  Device device = Device::kCpu;
  std::string synthetic;        // cuda only: random weights with a named model's shapes
  int max_batch = 0;            // cuda only: the largest batch "auto" may pick (0: memory's)
  bool host_values = true;      // cuda shadowkv: also values in pinned host memory
  bool engine_loop = true;      // cuda: each case also through the engine loop
  int max_host_sequences = -1;  // cuda shadowkv: at most this many sequences with host values
  TensorParallelOptions tensor_parallel;  // cuda only
};

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

Result<std::vector<int64_t>> ParseCounts(const std::string& text, const char* what) {
  std::vector<int64_t> values;
  for (const std::string& item : SplitList(text)) {
    int64_t value = 0;
    std::string digits = item;
    int64_t scale = 1;
    if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) {
      scale = 1024;
      digits.pop_back();
    }
    try {
      size_t used = 0;
      value = std::stoll(digits, &used) * scale;
      if (used != digits.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      return Error(ErrorCode::kInvalidArgument, "{} '{}' is not a number", what, item);
    }
    if (value <= 0)
      return Error(ErrorCode::kInvalidArgument, "{} {} must be positive", what, value);
    values.push_back(value);
  }
  if (values.empty()) return Error(ErrorCode::kInvalidArgument, "no {} given", what);
  return values;
}

int RunBench(const BenchOptions& o) {
  auto contexts = ParseCounts(o.contexts, "context length");
  if (!contexts.ok()) return Fail(contexts.status().ToString());
  auto batches = ParseCounts(o.batches, "batch size");
  if (!batches.ok()) return Fail(batches.status().ToString());
  const std::vector<std::string> policies = SplitList(o.policies);
  if (policies.empty()) return Fail("no KV policy given");
  auto model_or = LoadModel(o.model);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  CpuModel& model = **model_or;
  engine::CpuServingModel serving(model);

  std::fprintf(stderr, "model: %s\nthreads: %d, weights %.1f MiB\n",
               model.config().Summary().c_str(), model.pool().num_threads(),
               model.weights().ByteSize() / 1048576.0);
  std::fprintf(stderr,
               "decode through the engine loop (as served, without HTTP): one shared prompt "
               "prefilled once, each request from its copy where the policy's states fork; "
               "decode tok/s while every request decodes\n");
  std::printf("%-10s %8s %6s %14s %14s %10s %10s %12s %12s %8s\n", "policy", "context", "batch",
              "prefill tok/s", "decode tok/s", "step ms", "model ms", "KV fast", "KV slow",
              "hit %");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::string& name : policies) {
    // A name or a variant of one ("shadowkv:fp8_values=1"), over the KV flags.
    auto config = kv::ParseKvVariant(name, o.kv);
    if (!config.ok()) return Fail(config.status().ToString());
    auto policy = serving.MakePolicy(*config);
    if (!policy.ok()) return Fail(policy.status().ToString());
    for (int64_t context : *contexts) {
      if (context + o.gen_tokens > model.config().context_length) {
        return Fail(fmt::format("context {} + {} generated tokens exceeds the model's context {}",
                                context, o.gen_tokens, model.config().context_length));
      }
      for (int64_t batch : *batches) {
        engine::LoopBenchResult best;
        for (int r = 0; r < o.repeat; ++r) {
          engine::LoopBenchCase c;
          c.context = context;
          c.batch = static_cast<int>(batch);
          c.gen_tokens = o.gen_tokens;
          c.prefill_chunk = o.prefill_chunk;
          auto m = engine::RunLoopBench(serving, **policy, c);
          if (!m.ok()) return Fail(m.status().ToString());
          if (m->steady_tokens_per_s > best.steady_tokens_per_s) best = *m;
        }
        const double prefill_tokens_per_s = (context - 1) / std::max(best.prefill_seconds, 1e-9);
        std::printf("%-10s %8lld %6lld %14.1f %14.1f %10.2f %10.2f %11.1fM %11.1fM %8.1f\n",
                    name.c_str(), static_cast<long long>(context), static_cast<long long>(batch),
                    prefill_tokens_per_s, best.steady_tokens_per_s, best.step_ms, best.model_ms,
                    best.memory.fast_bytes / 1048576.0, best.memory.slow_bytes / 1048576.0,
                    100.0 * best.hit_rate);
        std::fflush(stdout);
        rows.push_back({{"policy", name},
                        {"context", context},
                        {"batch", batch},
                        {"prefill_tokens_per_s", prefill_tokens_per_s},
                        {"decode_tokens_per_s", best.steady_tokens_per_s},
                        {"decode_itl_p50_ms", best.steady_itl_p50_ms},
                        {"whole_run_tokens_per_s", best.whole_tokens_per_s},
                        {"prompt_shared_by_copies", best.forked},
                        {"step_ms", best.step_ms},
                        {"model_ms", best.model_ms},
                        {"schedule_ms", best.schedule_ms},
                        {"publish_ms", best.publish_ms},
                        {"kv_fast_bytes", best.memory.fast_bytes},
                        {"kv_slow_bytes", best.memory.slow_bytes},
                        {"hit_rate", best.hit_rate},
                        {"selection_share", best.selection_share}});
      }
    }
  }
  if (!o.json_path.empty()) {
    nlohmann::json report = {{"model", model.config().Summary()},
                             {"threads", model.pool().num_threads()},
                             {"loop", "engine (Scheduler), as served without HTTP"},
                             {"gen_tokens", o.gen_tokens},
                             {"prefill_chunk", o.prefill_chunk},
                             {"results", rows}};
    std::ofstream(o.json_path) << report.dump(2) << "\n";
  }
  return 0;
}

#ifdef SHADOWKV_HAVE_CUDA

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// A count ("4096", "60k"), or 0 for "auto" when allowed.
Result<int64_t> ParseCudaCount(const std::string& item, const char* what, bool auto_allowed) {
  if (auto_allowed && item == "auto") return int64_t{0};
  std::string digits = item;
  int64_t scale = 1;
  if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) {
    scale = 1024;
    digits.pop_back();
  }
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(digits, &used) * scale;
  } catch (const std::exception&) {
    used = 0;
  }
  if (digits.empty() || used != digits.size() || value <= 0) {
    return Error(ErrorCode::kInvalidArgument, "{} '{}' is not a positive number{}", what, item,
                 auto_allowed ? " or 'auto'" : "");
  }
  return value;
}

Result<std::vector<int64_t>> ParseCudaCounts(const std::string& text, const char* what,
                                             bool auto_allowed) {
  std::vector<int64_t> values;
  for (const std::string& item : SplitList(text)) {
    SKV_ASSIGN_OR_RETURN(int64_t value, ParseCudaCount(item, what, auto_allowed));
    values.push_back(value);
  }
  if (values.empty()) return Error(ErrorCode::kInvalidArgument, "no {} given", what);
  return values;
}

// Decode steps a bench case runs beyond --gen (warm-up and profiled steps), rounded up.
constexpr int64_t kSyntheticContextMargin = 256;

bool IsShadowKvItem(const std::string& policy) {
  return policy == "shadowkv" || policy.rfind("shadowkv:", 0) == 0;
}

// The batch the step buffers are sized for: --max-batch, else the most sequences of any
// policy that could fit at the shortest context (BatchBoundBeforeLoad), and at least the
// largest batch asked for.
Result<int> StepBatchOf(const BenchOptions& o, const ModelConfig& config,
                        const std::vector<int64_t>& contexts, const std::vector<int64_t>& batches,
                        const std::vector<std::string>& policies,
                        const TensorParallelOptions& tensor_parallel) {
  if (o.max_batch > 0) return o.max_batch;
  const int64_t shortest = *std::min_element(contexts.begin(), contexts.end());
  const int64_t capacity = shortest + o.gen_tokens + kSyntheticContextMargin;
  int64_t bound = *std::max_element(batches.begin(), batches.end());
  for (const std::string& policy : policies) {
    kv::KvPolicyConfig settings;
    if (IsShadowKvItem(policy)) {
      // An item that does not parse is reported by its own case.
      auto variant = kv::ParseKvVariant(policy, o.kv);
      if (!variant.ok()) continue;
      settings = cuda::ShadowKvBenchSettings(*variant, shortest);
    }
    SKV_ASSIGN_OR_RETURN(
        const int64_t least,
        cuda::LeastSequenceBytes(config, capacity, IsShadowKvItem(policy) ? &settings : nullptr,
                                 o.host_values, tensor_parallel));
    SKV_ASSIGN_OR_RETURN(const int fits, cuda::BatchBoundBeforeLoad(least));
    bound = std::max<int64_t>(bound, fits);
  }
  return static_cast<int>(std::min<int64_t>(bound, cuda::kMaxStepBatch));
}

// What bounded a case's largest batch, in words and as a JSON tag.
std::pair<std::string, std::string> BoundOf(const BenchOptions& o, int max_batch, bool by_memory,
                                            int64_t free_bytes, int64_t total_bytes,
                                            int step_batch) {
  if (by_memory) {
    return {cuda::MemoryBoundText(max_batch, "sequences", free_bytes, total_bytes), "memory"};
  }
  if (o.max_batch > 0)
    return {fmt::format("{} sequences: bounded by --max-batch", max_batch), "--max-batch"};
  return {fmt::format("{} sequences: bounded by the step buffers' batch of {} (sized before the "
                      "load, at most {})",
                      max_batch, step_batch, cuda::kMaxStepBatch),
          "step buffers"};
}

// The CUDA backend's prefill and decode throughput per (KV policy, context, batch), with the
// decode step's breakdown, GPU memory, the largest batch that fits and the byte floor.
// Synthetic-weight runs say so in every output. `model_path` is empty with --synthetic.
int RunCudaBench(const BenchOptions& o, const std::string& model_path) {
  auto contexts = ParseCudaCounts(o.contexts, "context length", false);
  if (!contexts.ok()) return Fail(contexts.status().ToString());
  auto batches = ParseCudaCounts(o.batches, "batch size", true);
  if (!batches.ok()) return Fail(batches.status().ToString());
  const std::vector<std::string> policies = SplitList(o.policies);
  if (policies.empty()) return Fail("no KV policy given");
  if (o.gen_tokens < 100) {
    std::fprintf(stderr, "note: %d decode steps; the report asks for at least 100\n", o.gen_tokens);
  }
  cuda::PrepareProcessForTensorParallel(o.tensor_parallel.size);  // before any CUDA call
  auto device = cuda::QueryDevice();
  if (!device.ok()) return Fail(device.status().ToString());

  TensorParallelOptions tensor_parallel = o.tensor_parallel;
  if (Status s = ApplyTensorParallelEnvironment(&tensor_parallel); !s.ok()) {
    return Fail(s.ToString());
  }
  const bool synthetic = !o.synthetic.empty();
  Result<ModelConfig> config = Status(ErrorCode::kInternal, "unset");
  if (synthetic) {
    config = SyntheticModelConfig(o.synthetic);
  } else if (auto file = gguf::GgufFile::Open(model_path); file.ok()) {
    config = ModelConfig::FromGguf(**file);
  } else {
    config = file.status();
  }
  if (!config.ok()) return Fail(config.status().ToString());
  auto step_batch = StepBatchOf(o, *config, *contexts, *batches, policies, tensor_parallel);
  if (!step_batch.ok()) return Fail(step_batch.status().ToString());
  // One serving model: its group runs the step-level cases directly, and the engine-loop case
  // of each remakes the serving pool for its policy, batch and context.
  cuda::CudaServingOptions serving_options;
  serving_options.max_batch = *step_batch;
  serving_options.prefill_chunk = o.prefill_chunk;
  serving_options.sequences = 1;  // a small first pool; every case makes its own
  serving_options.context = std::min<int64_t>(o.prefill_chunk, config->context_length);
  serving_options.tensor_parallel = tensor_parallel;
  serving_options.kernels = KernelOptionsFromFlags();
  Result<std::unique_ptr<cuda::CudaServingModel>> serving_or =
      Status(ErrorCode::kInternal, "unset");
  if (synthetic) {
    // Random weights were never trained to a context length, and RoPE rotates any position:
    // the named model's limit gives way to the longest context asked for (e.g. Llama-3-8B's
    // shapes at 244K), with room for the decode steps.
    const int64_t longest = *std::max_element(contexts->begin(), contexts->end());
    const int64_t needed = longest + o.gen_tokens + kSyntheticContextMargin;
    if (needed > config->context_length) {
      std::fprintf(stderr, "note: synthetic weights: context limit %lld raised to %lld\n",
                   static_cast<long long>(config->context_length), static_cast<long long>(needed));
      config->context_length = needed;
    }
    serving_or = cuda::CudaServingModel::CreateSynthetic(*config, serving_options);
  } else {
    serving_or = cuda::CudaServingModel::Load(model_path, serving_options);
  }
  if (!serving_or.ok()) return Fail(serving_or.status().ToString());
  cuda::CudaServingModel& serving = **serving_or;
  cuda::CudaModelGroup& model = serving.group();
  // The same case through the engine loop (the server's, without HTTP): decode while every
  // request decodes. A pool that does not fit the case's batch beside its prompt slot is tried
  // with fewer sequences.
  auto engine_loop = [&](const kv::KvPolicyConfig& kv, int64_t context,
                         int batch) -> Result<engine::LoopBenchResult> {
    const bool shadowkv = kv::IsPolicy(kv, kv::PolicyKind::kShadowKv);
    Status made = Status::Ok();
    for (int tries = 0; tries < 4 && batch > 0; ++tries, --batch) {
      made = serving.RemakePool(kv, batch, shadowkv ? 1 : 0, context + o.gen_tokens + 1);
      if (made.code() != ErrorCode::kResourceExhausted) break;
    }
    SKV_RETURN_IF_ERROR(made);
    // Every copy of the shared prompt needs its values in device memory: a batch whose values
    // do not all fit beside the pool's prompt slot runs with as many as do.
    for (int tries = 0; shadowkv && tries < 3; ++tries) {
      SKV_ASSIGN_OR_RETURN(const int fit, serving.SequencesWithDeviceValues());
      if (fit >= batch || fit < 1) break;
      batch = fit;
      SKV_RETURN_IF_ERROR(serving.RemakePool(kv, batch, 1, context + o.gen_tokens + 1));
    }
    SKV_ASSIGN_OR_RETURN(auto policy, serving.MakePolicy(kv));
    engine::LoopBenchCase c;
    c.context = context;
    c.batch = batch;
    c.gen_tokens = o.gen_tokens;
    c.prefill_chunk = o.prefill_chunk;
    auto result = engine::RunLoopBench(serving, *policy, c);
    // The next case's step-level run sizes its own cache from free memory.
    SKV_RETURN_IF_ERROR(serving.RemakePool(kv::KvPolicyConfig{}, 1, 0,
                                           std::min<int64_t>(o.prefill_chunk, context)));
    return result;
  };
  auto print_loop = [&](const std::string& policy, int64_t context, int step_batch_used,
                        double step_tokens_per_s, const Result<engine::LoopBenchResult>& loop,
                        nlohmann::json* row) {
    if (!loop.ok()) {
      std::printf("         engine loop: -- %s\n", loop.status().ToString().c_str());
      (*row)["engine_loop_error"] = loop.status().ToString();
      return;
    }
    const engine::LoopBenchResult& l = loop.value();
    std::printf(
        "%-8s %7lld %5d  engine loop: %.1f tok/s decode (%.0f%% of the step loop's %.1f at "
        "batch %d), ITL p50 %.2f ms; per decode step %.2f ms (model %.2f, schedule %.3f, "
        "publish %.3f)%s\n",
        policy.c_str(), static_cast<long long>(context), l.batch, l.steady_tokens_per_s,
        100.0 * l.steady_tokens_per_s / std::max(step_tokens_per_s, 1e-9), step_tokens_per_s,
        step_batch_used, l.steady_itl_p50_ms, l.step_ms, l.model_ms, l.schedule_ms, l.publish_ms,
        l.forked ? "" : "; the prompt was not shared by copies");
    std::fflush(stdout);
    (*row)["engine_loop"] = {
        {"batch", l.batch},
        {"decode_tokens_per_s", l.steady_tokens_per_s},
        {"itl_p50_ms", l.steady_itl_p50_ms},
        {"whole_run_tokens_per_s", l.whole_tokens_per_s},
        {"prompt_shared_by_copies", l.forked},
        {"shared_prefill_seconds", l.prefill_seconds},
        {"step_ms", l.step_ms},
        {"model_ms", l.model_ms},
        {"schedule_ms", l.schedule_ms},
        {"publish_ms", l.publish_ms},
        {"hit_rate", l.hit_rate},
        {"selection_share", l.selection_share},
        {"of_step_loop", l.steady_tokens_per_s / std::max(step_tokens_per_s, 1e-9)}};
  };

  const std::string label = synthetic ? std::string(kSyntheticLabel) : std::string();
  if (synthetic) std::printf("*** %s ***\n", label.c_str());
  std::printf("model: %s\n", model.config().Summary().c_str());
  if (model.size() > 1) {
    std::printf(
        "tensor parallel: %d ranks on %d GPU%s (%s communicator); sizes below are the "
        "ranks' totals, floors per GPU\n",
        model.size(), model.num_devices(), model.num_devices() == 1 ? "" : "s",
        model.communicator().c_str());
  }
  std::printf("device: %s (sm_%d%d, %d SMs), %.1f GiB total, %.1f GiB free before the model\n",
              device->name.c_str(), device->compute_major, device->compute_minor,
              device->multiprocessors, device->total_bytes / kGiB, device->free_bytes / kGiB);
  std::printf(
      "weights %.2f GiB (bf16, %s), step buffers %.2f GiB; KV cache bf16, %.1f KiB per "
      "token\n",
      model.weight_bytes() / kGiB, synthetic ? "synthetic random" : "from GGUF",
      model.activation_bytes() / kGiB, model.KvBytesPerToken() / 1024.0);
  std::printf(
      "prefill: one sequence in chunks of %d, the other slots are copies of it; decode: "
      "%d graph-replayed steps; floor: bytes per step / %.2f TB/s\n",
      o.prefill_chunk, o.gen_tokens, cuda::kFloorBytesPerSecond / 1e12);
  std::printf("%-8s %7s %5s %5s %11s %11s %8s %8s %8s %8s %8s %8s %11s %6s\n", "policy", "context",
              "batch", "max", "prefill t/s", "decode t/s", "step ms", "gemm ms", "attn ms",
              "other ms", "GPU GiB", "floor ms", "floor t/s", "%floor");
  std::fflush(stdout);

  nlohmann::json rows = nlohmann::json::array();
  bool failed = false;
  // Best decode tok/s of each (policy, context), for the ratio summary.
  std::map<std::pair<std::string, int64_t>, double> best;
  std::vector<std::string> shadowkv_lines;
  for (const std::string& policy : policies) {
    for (int64_t context : *contexts) {
      for (int64_t batch : *batches) {
        nlohmann::json row = {
            {"policy", policy},
            {"context", context},
            {"batch_requested", batch == 0 ? nlohmann::json("auto") : nlohmann::json(batch)}};
        auto report_error = [&](const Status& status) {
          failed = true;
          std::printf("%-8s %7lld %5s  -- %s\n", policy.c_str(), static_cast<long long>(context),
                      batch == 0 ? "auto" : std::to_string(batch).c_str(),
                      status.ToString().c_str());
          row["error"] = status.ToString();
          rows.push_back(row);
          std::fflush(stdout);
        };
        if (IsShadowKvItem(policy)) {
          // The KV flags, then the item's own settings ("shadowkv:fp8_values=1:fp8_landmarks=1",
          // "shadowkv:budget=1024"); without a budget the bench's rule.
          auto variant = kv::ParseKvVariant(policy, o.kv);
          if (!variant.ok()) {
            report_error(variant.status());
            continue;
          }
          cuda::ShadowKvBenchCase bench_case;
          bench_case.settings = *variant;
          bench_case.context = context;
          bench_case.batch = static_cast<int>(batch);
          bench_case.decode_steps = o.gen_tokens;
          bench_case.prefill_chunk = o.prefill_chunk;
          bench_case.allow_host_values = o.host_values;
          bench_case.max_host_sequences = o.max_host_sequences;
          auto result = cuda::RunShadowKvBenchCase(model, bench_case);
          if (!result.ok()) {
            report_error(result.status());
            continue;
          }
          const cuda::ShadowKvBenchResult& r = *result;
          nlohmann::json runs = nlohmann::json::array();
          for (size_t i = 0; i < r.runs.size(); ++i) {
            const cuda::ShadowKvBenchRun& run = r.runs[i];
            const cuda::StepBreakdown& b = run.breakdown;
            std::printf(
                "%-8s %7lld %5d %5d %11.1f %11.1f %8.2f %8.2f %8.2f %8.2f %8.1f %8.2f "
                "%11.1f %5.0f%%%s\n",
                policy.c_str(), static_cast<long long>(context), run.batch, run.batch,
                context / r.prefill_seconds, run.decode_tokens_per_s, run.step_ms, b.gemm_ms,
                b.attention_ms, b.other_ms, run.gpu_bytes_used / kGiB, run.floors.total_ms,
                run.batch / (run.floors.total_ms / 1000.0),
                100.0 * run.floors.total_ms / run.step_ms,
                static_cast<int>(i) == r.best ? "  (best)" : "");
            if (model.size() > 1) {
              std::printf("         all-reduces: %.2f ms of the profiled step\n", b.allreduce_ms);
            }
            shadowkv_lines.push_back(fmt::format(
                "{:>7} {:>5} {:>4}/{:<4} {:>6.1f}% | {:>6.2f} {:>6.2f} | {:>6.2f} {:>6.2f} | "
                "{:>6.2f} {:>6.2f} | {:>6.2f} {:>6.2f} | {:>6.2f} {:>6.2f} | {:>6.2f} | {:>7.2f} "
                "{:>7.2f}",
                context, run.batch, run.device_value_sequences, run.host_value_sequences,
                100.0 * run.hit_rate, b.scoring_ms, run.floors.scoring_ms, b.rebuild_ms,
                run.floors.rebuild_ms, b.fetch_ms, run.floors.fetch_ms, b.attention_ms,
                run.floors.attention_ms, b.gemm_ms + b.other_ms, run.floors.dense_ms, b.graduate_ms,
                b.total_ms, run.floors.total_ms));
            runs.push_back({{"batch", run.batch},
                            {"device_value_sequences", run.device_value_sequences},
                            {"host_value_sequences", run.host_value_sequences},
                            {"decode_tokens_per_s", run.decode_tokens_per_s},
                            {"step_ms", run.step_ms},
                            {"hit_rate", run.hit_rate},
                            {"selection_share", run.selection_share},
                            {"gpu_bytes_used", run.gpu_bytes_used},
                            {"host_value_bytes", run.host_bytes},
                            {"profiled_step_ms", b.total_ms},
                            {"scoring_ms", b.scoring_ms},
                            {"rebuild_ms", b.rebuild_ms},
                            {"fetch_ms", b.fetch_ms},
                            {"attention_ms", b.attention_ms},
                            {"graduate_ms", b.graduate_ms},
                            {"gemm_ms", b.gemm_ms},
                            {"other_ms", b.other_ms},
                            {"allreduce_ms", b.allreduce_ms},
                            {"floor_scoring_ms", run.floors.scoring_ms},
                            {"floor_rebuild_ms", run.floors.rebuild_ms},
                            {"floor_fetch_ms", run.floors.fetch_ms},
                            {"floor_attention_ms", run.floors.attention_ms},
                            {"floor_dense_ms", run.floors.dense_ms},
                            {"floor_step_ms", run.floors.total_ms}});
          }
          if (!r.note.empty()) std::printf("         note: %s\n", r.note.c_str());
          const auto [bound_text, bound_tag] =
              BoundOf(o, r.max_batch, r.bounded_by_memory, r.free_bytes, device->total_bytes,
                      model.options().max_batch);
          std::printf("         %s%s\n", bound_text.c_str(),
                      r.bounded_by_memory ? " (and pinned host memory)" : "");
          std::fflush(stdout);
          const cuda::ShadowKvBenchRun& top = r.runs[r.best];
          auto& entry = best[{policy, context}];
          entry = std::max(entry, top.decode_tokens_per_s);
          row.update({{"batch", top.batch},
                      {"max_batch", r.max_batch},
                      {"budget_tokens", r.budget_tokens},
                      {"rank", r.rank},
                      {"outlier_chunks", r.outlier_chunks},
                      {"prefill_seconds", r.prefill_seconds},
                      {"prefill_tokens_per_s", context / r.prefill_seconds},
                      {"compress_seconds", r.compress_seconds},
                      {"compress_fraction_of_prefill", r.compress_seconds / r.prefill_seconds},
                      {"compress_phase_seconds",
                       {{"gram", r.compress_phase_seconds[0]},
                        {"eigenvectors", r.compress_phase_seconds[1]},
                        {"projection_landmarks", r.compress_phase_seconds[2]},
                        {"outliers_copies", r.compress_phase_seconds[3]}}},
                      {"decode_tokens_per_s", top.decode_tokens_per_s},
                      {"step_ms", top.step_ms},
                      {"hit_rate", top.hit_rate},
                      {"values", fmt::format("{} sequences in device memory, {} in pinned host "
                                             "memory",
                                             top.device_value_sequences, top.host_value_sequences)},
                      {"gpu_bytes_used", r.gpu_bytes_used},
                      {"shadowkv_device_bytes", r.skv_device_bytes},
                      {"host_value_bytes", r.host_bytes},
                      {"device_bytes_per_sequence", r.device_bytes_per_sequence},
                      {"value_bytes_per_sequence", r.value_bytes_per_sequence},
                      {"note", r.note},
                      {"max_batch_bounded_by", bound_tag},
                      {"runs", runs}});
          shadowkv_lines.push_back(fmt::format(
              "{:>7}: budget {} tokens, rank {}, {} outlier chunks; prefill {:.2f} s, ShadowKV "
              "compression {:.1f} ms ({:.1f}% of the prefill: Gram {:.1f}, eigenvectors {:.1f}, "
              "projection and landmarks {:.1f}, outliers and copies {:.1f}); per sequence {:.2f} "
              "GiB on the GPU + {:.2f} GiB of values{}; GPU in use {:.1f} GiB, pinned host "
              "values {:.1f} GiB",
              context, r.budget_tokens, r.rank, r.outlier_chunks, r.prefill_seconds,
              1e3 * r.compress_seconds, 100.0 * r.compress_seconds / r.prefill_seconds,
              1e3 * r.compress_phase_seconds[0], 1e3 * r.compress_phase_seconds[1],
              1e3 * r.compress_phase_seconds[2], 1e3 * r.compress_phase_seconds[3],
              r.device_bytes_per_sequence / kGiB, r.value_bytes_per_sequence / kGiB,
              variant->exact_keys != 0 ? " and exact keys" : "", r.gpu_bytes_used / kGiB,
              r.host_bytes / kGiB));
          if (o.engine_loop) {
            print_loop(policy, context, top.batch, top.decode_tokens_per_s,
                       engine_loop(*variant, context, top.batch), &row);
          }
          rows.push_back(row);
          continue;
        }
        if (policy != "full") {
          report_error(Error(ErrorCode::kUnsupported,
                             "KV policy '{}' is not on the CUDA backend (full, shadowkv)", policy));
          continue;
        }
        Result<cuda::BenchResult> result = cuda::RunBenchCase(
            model,
            cuda::BenchCase{context, static_cast<int>(batch), o.gen_tokens, 3, o.prefill_chunk, 1});
        if (!result.ok()) {
          report_error(result.status());
          continue;
        }
        const cuda::BenchResult& r = *result;
        std::printf(
            "%-8s %7lld %5d %5d %11.1f %11.1f %8.2f %8.2f %8.2f %8.2f %8.1f %8.2f %11.1f "
            "%5.0f%%\n",
            policy.c_str(), static_cast<long long>(context), r.batch, r.max_batch,
            r.prefill_tokens_per_s, r.decode_tokens_per_s, r.step_ms, r.breakdown.gemm_ms,
            r.breakdown.attention_ms, r.breakdown.other_ms, r.gpu_bytes_used / kGiB,
            r.floor_step_ms, r.floor_tokens_per_s,
            100.0 * r.decode_tokens_per_s / r.floor_tokens_per_s);
        if (model.size() > 1) {
          std::printf("         all-reduces: %.2f ms of the profiled step\n",
                      r.breakdown.allreduce_ms);
        }
        const auto [bound_text, bound_tag] =
            BoundOf(o, r.max_batch, r.bounded_by_memory, r.free_bytes, device->total_bytes,
                    model.options().max_batch);
        std::printf("         %s\n", bound_text.c_str());
        std::fflush(stdout);
        auto& entry = best[{policy, context}];
        entry = std::max(entry, r.decode_tokens_per_s);
        row.update({{"batch", r.batch},
                    {"max_batch", r.max_batch},
                    {"max_batch_bounded_by", bound_tag},
                    {"prefill_seconds", r.prefill_seconds},
                    {"prefill_tokens_per_s", r.prefill_tokens_per_s},
                    {"decode_tokens_per_s", r.decode_tokens_per_s},
                    {"step_ms", r.step_ms},
                    {"profiled_step_ms", r.breakdown.total_ms},
                    {"gemm_ms", r.breakdown.gemm_ms},
                    {"attention_ms", r.breakdown.attention_ms},
                    {"other_ms", r.breakdown.other_ms},
                    {"allreduce_ms", r.breakdown.allreduce_ms},
                    {"kv_bytes", r.kv_bytes},
                    {"gpu_bytes_used", r.gpu_bytes_used},
                    {"floor_bytes_per_step", r.floor_bytes},
                    {"floor_step_ms", r.floor_step_ms},
                    {"floor_tokens_per_s", r.floor_tokens_per_s}});
        if (o.engine_loop) {
          print_loop(policy, context, r.batch, r.decode_tokens_per_s,
                     engine_loop(kv::KvPolicyConfig{}, context, r.batch), &row);
        }
        rows.push_back(row);
      }
    }
  }
  if (!shadowkv_lines.empty()) {
    std::printf(
        "\nShadowKV decode step (un-graphed, the mean of one graduation cycle of steps), "
        "measured ms | floor ms (DESIGN.md bytes at %.2f TB/s device, %.1f GB/s host "
        "reads, measured hit rate):\n",
        cuda::kFloorBytesPerSecond / 1e12, cuda::kHostReadBytesPerSecond / 1e9);
    std::printf(
        "context batch dev/host   hits | score+topk    | key rebuild   | value fetch   | "
        "attention     | dense (GEMM+other) | grad.  | step (profiled, floor)\n");
    for (const std::string& line : shadowkv_lines) std::printf("%s\n", line.c_str());
  }
  nlohmann::json ratios = nlohmann::json::array();
  for (int64_t context : *contexts) {
    auto full = best.find({"full", context});
    if (full == best.end() || full->second <= 0) continue;
    for (const std::string& policy : policies) {
      if (policy == "full") continue;
      auto sparse = best.find({policy, context});
      if (sparse == best.end()) continue;
      std::printf(
          "context %lld: %s %.1f tok/s vs full %.1f tok/s = %.2fx (each at its best "
          "batch, same run)\n",
          static_cast<long long>(context), policy.c_str(), sparse->second, full->second,
          sparse->second / full->second);
      ratios.push_back({{"context", context},
                        {"policy", policy},
                        {"shadowkv_tokens_per_s", sparse->second},
                        {"full_tokens_per_s", full->second},
                        {"ratio", sparse->second / full->second}});
    }
  }
  if (synthetic) std::printf("*** %s ***\n", label.c_str());
  if (!o.json_path.empty()) {
    nlohmann::json report = {
        {"device", "cuda"},
        {"gpu", device->name},
        {"weights", synthetic ? "synthetic-random" : "gguf"},
        {"label", label},
        {"model", model.config().Summary()},
        {"tensor_parallel", model.size()},
        {"tensor_parallel_devices", model.num_devices()},
        {"communicator", model.communicator()},
        {"weight_bytes", model.weight_bytes()},
        {"decode_steps", o.gen_tokens},
        {"prefill_chunk", o.prefill_chunk},
        {"prefill_note", "one sequence prefilled; the other batch slots are copies of it"},
        {"floor_bytes_per_second", cuda::kFloorBytesPerSecond},
        {"results", rows},
        {"shadowkv_vs_full", ratios}};
    std::ofstream(o.json_path) << report.dump(2) << "\n";
  }
  return failed ? 1 : 0;
}

#else

int RunCudaBench(const BenchOptions&, const std::string&) { return Fail(kBuiltWithoutCuda); }

#endif  // SHADOWKV_HAVE_CUDA

// --device cuda: the same flags, run by RunCudaBench ("auto" batches allowed there).
void AddCudaBenchOptions(CLI::App& cmd, BenchOptions& o) {
  AddDeviceOption(cmd, o.device, "cpu | cuda (cuda with --synthetic)");
  cmd.add_option("--synthetic", o.synthetic,
                 "cuda: random weights with a named model's shapes (e.g. llama3-8b), "
                 "throughput only; implies --device cuda");
  cmd.add_option("--max-batch", o.max_batch,
                 "cuda: the largest batch --batch auto may pick (0 = as many as fit in device "
                 "memory, at most 1024)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd.add_flag("--host-values,!--no-host-values", o.host_values,
               "cuda shadowkv: --batch auto also measures larger batches whose extra sequences "
               "keep their values in pinned host memory (and their exact keys, where the re-rank "
               "does not read them at every selection)")
      ->capture_default_str();
  cmd.add_flag("--engine-loop,!--no-engine-loop", o.engine_loop,
               "cuda: each case also decodes through the engine loop (the server's loop without "
               "HTTP: one shared prompt prefilled once, copied to the batch)")
      ->capture_default_str();
  cmd.add_option("--max-host-sequences", o.max_host_sequences,
                 "cuda shadowkv: at most this many sequences with values in pinned host memory "
                 "(-1: as many as host memory admits)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1 << 20));
  AddTensorParallelOptions(cmd, o.tensor_parallel);
  AddKernelTuningOptions(cmd);
}

int RunBenchOnDevice(const BenchOptions& o) {
  if (o.device == Device::kCuda) {
    return RunCudaBench(o, o.synthetic.empty() ? ResolveModelPath(o.model) : std::string());
  }
  if (!o.synthetic.empty()) return Fail("--synthetic needs --device cuda");
  if (Status tp = TensorParallelNeedsCuda(o.tensor_parallel); !tp.ok()) return Fail(tp.message());
  return RunBench(o);
}

}  // namespace

Command AddBenchCommand(CLI::App& app) {
  auto options = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand("bench", "Measure prefill and decode throughput");
  AddModelOptions(*cmd, options->model);
  AddKvOptions(*cmd, options->kv);
  cmd->get_option("--kv")->description("KV policies to compare, comma-separated");
  // --kv here takes a list: keep it in `policies` and let the config take each name in turn.
  cmd->remove_option(cmd->get_option("--kv"));
  cmd->add_option("--kv", options->policies,
                  "KV policies or variants (e.g. shadowkv:fp8_values=1), comma-separated")
      ->capture_default_str();
  cmd->add_option("--context", options->contexts, "prompt lengths, comma-separated (k = 1024)")
      ->capture_default_str();
  cmd->add_option("--batch", options->batches,
                  "decode batch sizes, comma-separated (cuda: default auto, each policy's best)")
      ->capture_default_str();
  cmd->add_option("--gen", options->gen_tokens, "decode steps per measurement")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--prefill-chunk", options->prefill_chunk, "prompt tokens per forward step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--repeat", options->repeat, "repetitions (best is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--json", options->json_path, "also write the results as JSON here");
  AddCudaBenchOptions(*cmd, *options);
  return [options, cmd] {
    // Random weights exist only on the GPU, and there each policy runs at its best batch
    // unless told otherwise: `bench --synthetic llama3-8b --kv full,shadowkv` needs no more.
    if (!options->synthetic.empty() && cmd->count("--device") == 0) options->device = Device::kCuda;
    if (options->device == Device::kCuda && cmd->count("--batch") == 0) options->batches = "auto";
    return RunBenchOnDevice(*options);
  };
}

}  // namespace shadowkv::app
