// `shadowkv bench --device cuda`: prefill and decode throughput of the CUDA backend per (KV
// policy, context, batch), with the decode step's breakdown, GPU memory, the largest batch that
// fits and the byte floor. Synthetic-weight runs say so in every output.
#include "cmd_bench_cuda.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/status.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "model/synthetic.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/cuda_bench.h"
#include "ops/cuda/cuda_model.h"
#endif

namespace shadowkv::app {

#ifndef SHADOWKV_HAVE_CUDA

int RunCudaBench(const CudaBenchOptions&) {
  return Fail("this shadowkv was built without CUDA (configure with -DSHADOWKV_CUDA=ON)");
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
  auto device = cuda::QueryDevice();
  if (!device.ok()) return Fail(device.status().ToString());

  cuda::CudaModelOptions options;
  options.max_batch = o.max_batch;
  options.max_step_tokens = std::max(o.prefill_chunk, o.max_batch);
  Result<std::unique_ptr<cuda::CudaModel>> model_or = Status(ErrorCode::kInternal, "unset");
  const bool synthetic = !o.synthetic.empty();
  if (synthetic) {
    auto config = SyntheticModelConfig(o.synthetic);
    if (!config.ok()) return Fail(config.status().ToString());
    model_or = cuda::CudaModel::CreateSynthetic(*config, 1, options);
  } else {
    model_or = cuda::CudaModel::Load(o.model_path, options);
  }
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  cuda::CudaModel& model = **model_or;

  const std::string label = synthetic ? std::string(kSyntheticLabel) : std::string();
  if (synthetic) std::printf("*** %s ***\n", label.c_str());
  std::printf("model: %s\n", model.config().Summary().c_str());
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
  std::printf("%-7s %7s %5s %5s %11s %11s %8s %8s %8s %8s %8s %8s %11s %6s\n", "policy",
              "context", "batch", "max", "prefill t/s", "decode t/s", "step ms", "gemm ms",
              "attn ms", "other ms", "GPU GiB", "floor ms", "floor t/s", "%floor");
  std::fflush(stdout);

  nlohmann::json rows = nlohmann::json::array();
  bool failed = false;
  for (const std::string& policy : policies) {
    for (int64_t context : *contexts) {
      for (int64_t batch : *batches) {
        nlohmann::json row = {{"policy", policy}, {"context", context},
                              {"batch_requested", batch == 0 ? nlohmann::json("auto")
                                                             : nlohmann::json(batch)}};
        Result<cuda::BenchResult> result =
            policy == "full"
                ? cuda::RunBenchCase(model, cuda::BenchCase{context, static_cast<int>(batch),
                                                            o.gen_tokens, 3, o.prefill_chunk, 1})
                : Result<cuda::BenchResult>(Error(ErrorCode::kUnsupported,
                                                  "KV policy '{}' is not on the CUDA backend yet "
                                                  "(only 'full')",
                                                  policy));
        if (!result.ok()) {
          failed = true;
          std::printf("%-7s %7lld %5s  -- %s\n", policy.c_str(), static_cast<long long>(context),
                      batch == 0 ? "auto" : std::to_string(batch).c_str(),
                      result.status().ToString().c_str());
          row["error"] = result.status().ToString();
          rows.push_back(row);
          std::fflush(stdout);
          continue;
        }
        const cuda::BenchResult& r = *result;
        std::printf("%-7s %7lld %5d %5d %11.1f %11.1f %8.2f %8.2f %8.2f %8.2f %8.1f %8.2f %11.1f "
                    "%5.0f%%\n",
                    policy.c_str(), static_cast<long long>(context), r.batch, r.max_batch,
                    r.prefill_tokens_per_s, r.decode_tokens_per_s, r.step_ms, r.breakdown.gemm_ms,
                    r.breakdown.attention_ms, r.breakdown.other_ms, r.gpu_bytes_used / kGiB,
                    r.floor_step_ms, r.floor_tokens_per_s,
                    100.0 * r.decode_tokens_per_s / r.floor_tokens_per_s);
        std::fflush(stdout);
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
                    {"kv_bytes", r.kv_bytes},
                    {"gpu_bytes_used", r.gpu_bytes_used},
                    {"floor_bytes_per_step", r.floor_bytes},
                    {"floor_step_ms", r.floor_step_ms},
                    {"floor_tokens_per_s", r.floor_tokens_per_s}});
        rows.push_back(row);
      }
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
        {"weight_bytes", model.weight_bytes()},
        {"decode_steps", o.gen_tokens},
        {"prefill_chunk", o.prefill_chunk},
        {"prefill_note", "one sequence prefilled; the other batch slots are copies of it"},
        {"floor_bytes_per_second", cuda::kFloorBytesPerSecond},
        {"results", rows}};
    std::ofstream(o.json_path) << report.dump(2) << "\n";
  }
  return failed ? 1 : 0;
}

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
