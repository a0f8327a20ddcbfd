// `shadowkv bench --device cuda`: prefill and decode throughput of the CUDA backend per (KV
// policy, context, batch), with the decode step's breakdown, GPU memory, the largest batch that
// fits and the byte floor. Synthetic-weight runs say so in every output.
#include "cmd_bench_cuda.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "cuda_environment.h"
#include "core/status.h"
#include "kv/kv_config.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "gpu/bench/cuda_bench.h"
#include "gpu/model/cuda_model.h"
#include "gpu/tp/cuda_model_group.h"
#include "model/synthetic.h"
#include "ops/cuda/common/cuda_backend.h"
#endif

namespace shadowkv::app {

#ifndef SHADOWKV_HAVE_CUDA

int RunCudaBench(const CudaBenchOptions&) {
  return Fail(kBuiltWithoutCuda);
}

#else

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::vector<std::string> Items(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// A count ("4096", "60k"), or 0 for "auto" when allowed.
Result<int64_t> ParseCount(const std::string& item, const char* what, bool auto_allowed) {
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

Result<std::vector<int64_t>> ParseCounts(const std::string& text, const char* what,
                                         bool auto_allowed) {
  std::vector<int64_t> values;
  for (const std::string& item : Items(text)) {
    SKV_ASSIGN_OR_RETURN(int64_t value, ParseCount(item, what, auto_allowed));
    values.push_back(value);
  }
  if (values.empty()) return Error(ErrorCode::kInvalidArgument, "no {} given", what);
  return values;
}

}  // namespace

// Decode steps a bench case runs beyond --gen (warm-up and profiled steps), rounded up.
constexpr int64_t kSyntheticContextMargin = 256;

int RunCudaBench(const CudaBenchOptions& o) {
  auto contexts = ParseCounts(o.contexts, "context length", false);
  if (!contexts.ok()) return Fail(contexts.status().ToString());
  auto batches = ParseCounts(o.batches, "batch size", true);
  if (!batches.ok()) return Fail(batches.status().ToString());
  const std::vector<std::string> policies = Items(o.policies);
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
  auto kernels = KernelOptionsFromEnvironment();
  if (!kernels.ok()) return Fail(kernels.status().ToString());
  cuda::CudaModelOptions options;
  options.max_batch = o.max_batch;
  options.max_step_tokens = std::max(o.prefill_chunk, o.max_batch);
  options.kernels = *kernels;
  Result<std::unique_ptr<cuda::CudaModelGroup>> model_or = Status(ErrorCode::kInternal, "unset");
  const bool synthetic = !o.synthetic.empty();
  if (synthetic) {
    auto config = SyntheticModelConfig(o.synthetic);
    if (!config.ok()) return Fail(config.status().ToString());
    // Random weights were never trained to a context length, and RoPE rotates any position:
    // the named model's limit gives way to the longest context asked for (e.g. Llama-3-8B's
    // shapes at 244K), with room for the decode steps.
    const int64_t longest = *std::max_element(contexts->begin(), contexts->end());
    const int64_t needed = longest + o.gen_tokens + kSyntheticContextMargin;
    if (needed > config->context_length) {
      std::fprintf(stderr, "note: synthetic weights: context limit %lld raised to %lld\n",
                   static_cast<long long>(config->context_length),
                   static_cast<long long>(needed));
      config->context_length = needed;
    }
    model_or = cuda::CudaModelGroup::CreateSynthetic(*config, 1, options, tensor_parallel);
  } else {
    model_or = cuda::CudaModelGroup::Load(o.model_path, options, tensor_parallel);
  }
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  cuda::CudaModelGroup& model = **model_or;

  const std::string label = synthetic ? std::string(kSyntheticLabel) : std::string();
  if (synthetic) std::printf("*** %s ***\n", label.c_str());
  std::printf("model: %s\n", model.config().Summary().c_str());
  if (model.size() > 1) {
    std::printf("tensor parallel: %d ranks on %d GPU%s (%s communicator); sizes below are the "
                "ranks' totals, floors per GPU\n",
                model.size(), model.num_devices(), model.num_devices() == 1 ? "" : "s",
                model.communicator().c_str());
  }
  std::printf("device: %s (sm_%d%d, %d SMs), %.1f GiB total, %.1f GiB free before the model\n",
              device->name.c_str(), device->compute_major, device->compute_minor,
              device->multiprocessors, device->total_bytes / kGiB, device->free_bytes / kGiB);
  std::printf("weights %.2f GiB (bf16, %s), step buffers %.2f GiB; KV cache bf16, %.1f KiB per "
              "token\n",
              model.weight_bytes() / kGiB, synthetic ? "synthetic random" : "from GGUF",
              model.activation_bytes() / kGiB, model.KvBytesPerToken() / 1024.0);
  std::printf("prefill: one sequence in chunks of %d, the other slots are copies of it; decode: "
              "%d graph-replayed steps; floor: bytes per step / %.2f TB/s\n",
              o.prefill_chunk, o.gen_tokens, cuda::kFloorBytesPerSecond / 1e12);
  std::printf("%-8s %7s %5s %5s %11s %11s %8s %8s %8s %8s %8s %8s %11s %6s\n", "policy",
              "context", "batch", "max", "prefill t/s", "decode t/s", "step ms", "gemm ms",
              "attn ms", "other ms", "GPU GiB", "floor ms", "floor t/s", "%floor");
  std::fflush(stdout);

  nlohmann::json rows = nlohmann::json::array();
  bool failed = false;
  // Best decode tok/s of each (policy, context), for the ratio summary.
  std::map<std::pair<std::string, int64_t>, double> best;
  std::vector<std::string> shadowkv_lines;
  for (const std::string& policy : policies) {
    for (int64_t context : *contexts) {
      for (int64_t batch : *batches) {
        nlohmann::json row = {{"policy", policy}, {"context", context},
                              {"batch_requested", batch == 0 ? nlohmann::json("auto")
                                                             : nlohmann::json(batch)}};
        auto report_error = [&](const Status& status) {
          failed = true;
          std::printf("%-8s %7lld %5s  -- %s\n", policy.c_str(), static_cast<long long>(context),
                      batch == 0 ? "auto" : std::to_string(batch).c_str(),
                      status.ToString().c_str());
          row["error"] = status.ToString();
          rows.push_back(row);
          std::fflush(stdout);
        };
        if (policy == "shadowkv" || policy.rfind("shadowkv:", 0) == 0) {
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
            std::printf("%-8s %7lld %5d %5d %11.1f %11.1f %8.2f %8.2f %8.2f %8.2f %8.1f %8.2f "
                        "%11.1f %5.0f%%%s\n",
                        policy.c_str(), static_cast<long long>(context), run.batch, run.batch,
                        context / r.prefill_seconds, run.decode_tokens_per_s, run.step_ms,
                        b.gemm_ms, b.attention_ms, b.other_ms, run.gpu_bytes_used / kGiB,
                        run.floors.total_ms, run.batch / (run.floors.total_ms / 1000.0),
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
                run.floors.attention_ms, b.gemm_ms + b.other_ms, run.floors.dense_ms,
                b.graduate_ms, b.total_ms, run.floors.total_ms));
            runs.push_back({{"batch", run.batch},
                            {"device_value_sequences", run.device_value_sequences},
                            {"host_value_sequences", run.host_value_sequences},
                            {"decode_tokens_per_s", run.decode_tokens_per_s},
                            {"step_ms", run.step_ms},
                            {"hit_rate", run.hit_rate},
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
                      {"decode_tokens_per_s", top.decode_tokens_per_s},
                      {"step_ms", top.step_ms},
                      {"hit_rate", top.hit_rate},
                      {"values", fmt::format("{} sequences in device memory, {} in pinned host "
                                             "memory", top.device_value_sequences,
                                             top.host_value_sequences)},
                      {"gpu_bytes_used", r.gpu_bytes_used},
                      {"shadowkv_device_bytes", r.skv_device_bytes},
                      {"host_value_bytes", r.host_bytes},
                      {"device_bytes_per_sequence", r.device_bytes_per_sequence},
                      {"value_bytes_per_sequence", r.value_bytes_per_sequence},
                      {"note", r.note},
                      {"runs", runs}});
          shadowkv_lines.push_back(fmt::format(
              "{:>7}: budget {} tokens, rank {}, {} outlier chunks; prefill {:.2f} s, ShadowKV "
              "compression {:.2f} s ({:.1f}% of the prefill); per sequence {:.2f} GiB on the GPU "
              "+ {:.2f} GiB of values; GPU in use {:.1f} GiB, pinned host values {:.1f} GiB",
              context, r.budget_tokens, r.rank, r.outlier_chunks, r.prefill_seconds,
              r.compress_seconds, 100.0 * r.compress_seconds / r.prefill_seconds,
              r.device_bytes_per_sequence / kGiB, r.value_bytes_per_sequence / kGiB,
              r.gpu_bytes_used / kGiB, r.host_bytes / kGiB));
          rows.push_back(row);
          continue;
        }
        if (policy != "full") {
          report_error(Error(ErrorCode::kUnsupported,
                             "KV policy '{}' is not on the CUDA backend (full, shadowkv)", policy));
          continue;
        }
        Result<cuda::BenchResult> result = cuda::RunBenchCase(
            model, cuda::BenchCase{context, static_cast<int>(batch), o.gen_tokens, 3,
                                   o.prefill_chunk, 1});
        if (!result.ok()) {
          report_error(result.status());
          continue;
        }
        const cuda::BenchResult& r = *result;
        std::printf("%-8s %7lld %5d %5d %11.1f %11.1f %8.2f %8.2f %8.2f %8.2f %8.1f %8.2f %11.1f "
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
        std::fflush(stdout);
        auto& entry = best[{policy, context}];
        entry = std::max(entry, r.decode_tokens_per_s);
        row.update({{"batch", r.batch},
                    {"max_batch", r.max_batch},
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
        rows.push_back(row);
      }
    }
  }
  if (!shadowkv_lines.empty()) {
    std::printf("\nShadowKV decode step (un-graphed, the mean of one graduation cycle of steps), "
                "measured ms | floor ms (DESIGN.md bytes at %.2f TB/s device, %.1f GB/s host "
                "reads, measured hit rate):\n",
                cuda::kFloorBytesPerSecond / 1e12, cuda::kHostReadBytesPerSecond / 1e9);
    std::printf("context batch dev/host   hits | score+topk    | key rebuild   | value fetch   | "
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
      std::printf("context %lld: %s %.1f tok/s vs full %.1f tok/s = %.2fx (each at its best "
                  "batch, same run)\n",
                  static_cast<long long>(context), policy.c_str(), sparse->second, full->second,
                  sparse->second / full->second);
      ratios.push_back({{"context", context}, {"policy", policy},
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

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
