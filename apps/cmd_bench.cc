// `shadowkv bench`: prefill and decode throughput per KV policy, context length and batch.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cmd_bench_cuda.h"
#include "commands.h"
#include "engine/sampler.h"
#include "model/cpu_model.h"
#include "options.h"

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
  std::string synthetic;       // cuda only: random weights with a named model's shapes
  int max_batch = 64;          // cuda only: the largest batch "auto" may pick
  bool host_values = true;     // cuda shadowkv: also values in pinned host memory
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
    if (value <= 0) return Error(ErrorCode::kInvalidArgument, "{} {} must be positive", what, value);
    values.push_back(value);
  }
  if (values.empty()) return Error(ErrorCode::kInvalidArgument, "no {} given", what);
  return values;
}

struct Measurement {
  double prefill_tokens_per_s = 0;
  double decode_tokens_per_s = 0;
  double step_ms = 0;
  kv::MemoryUsage memory;
  double hit_rate = 0;
};

// Prefills `batch` random prompts of `context` tokens one by one, then decodes them together.
Result<Measurement> Measure(CpuModel& model, const kv::KvPolicy& policy, int64_t context, int batch,
                            const BenchOptions& o) {
  using Clock = std::chrono::steady_clock;
  const int vocab = static_cast<int>(model.config().vocab_size);
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> token_dist(100, vocab - 1);
  std::vector<std::unique_ptr<kv::SequenceKv>> sequences;
  std::vector<float> logits(static_cast<size_t>(batch) * vocab);
  std::vector<int32_t> next(batch);
  double prefill_s = 0;
  for (int b = 0; b < batch; ++b) {
    SKV_ASSIGN_OR_RETURN(auto kv, policy.NewSequence());
    std::vector<int32_t> prompt(context);
    for (auto& t : prompt) t = token_dist(rng);
    const auto start = Clock::now();
    for (int64_t done = 0; done < context; done += o.prefill_chunk) {
      const int64_t count = std::min<int64_t>(o.prefill_chunk, context - done);
      StepInput in;
      in.kv = kv.get();
      in.tokens = std::span<const int32_t>(prompt.data() + done, count);
      in.finish_prefill = done + count == context;
      in.logits = in.finish_prefill ? StepInput::Logits::kLast : StepInput::Logits::kNone;
      in.logits_out = logits.data() + static_cast<size_t>(b) * vocab;
      SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
    }
    prefill_s += std::chrono::duration<double>(Clock::now() - start).count();
    next[b] = Argmax(std::span<const float>(logits.data() + static_cast<size_t>(b) * vocab, vocab));
    sequences.push_back(std::move(kv));
  }
  const auto start = Clock::now();
  std::vector<StepInput> inputs(batch);
  for (int step = 0; step < o.gen_tokens; ++step) {
    for (int b = 0; b < batch; ++b) {
      inputs[b].kv = sequences[b].get();
      inputs[b].tokens = std::span<const int32_t>(&next[b], 1);
      inputs[b].logits = StepInput::Logits::kLast;
      inputs[b].logits_out = logits.data() + static_cast<size_t>(b) * vocab;
    }
    SKV_RETURN_IF_ERROR(model.Forward(inputs));
    for (int b = 0; b < batch; ++b) {
      next[b] = Argmax(std::span<const float>(logits.data() + static_cast<size_t>(b) * vocab, vocab));
    }
  }
  const double decode_s = std::chrono::duration<double>(Clock::now() - start).count();
  Measurement m;
  m.prefill_tokens_per_s = batch * context / prefill_s;
  m.decode_tokens_per_s = batch * o.gen_tokens / decode_s;
  m.step_ms = 1000.0 * decode_s / o.gen_tokens;
  kv::PolicyStats stats;
  for (const auto& s : sequences) {
    m.memory += s->memory();
    stats += s->stats();
  }
  m.hit_rate = stats.hit_rate();
  return m;
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

  std::fprintf(stderr, "model: %s\nthreads: %d, weights %.1f MiB\n", model.config().Summary().c_str(),
               model.pool().num_threads(), model.weights().ByteSize() / 1048576.0);
  std::printf("%-10s %8s %6s %14s %14s %10s %12s %12s %8s\n", "policy", "context", "batch",
              "prefill tok/s", "decode tok/s", "step ms", "KV fast", "KV slow", "hit %");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::string& name : policies) {
    // A name or a variant of one ("shadowkv:fp8_values=1"), over the KV flags.
    auto config = kv::ParseKvVariant(name, o.kv);
    if (!config.ok()) return Fail(config.status().ToString());
    auto policy = kv::MakeKvPolicy(*config, model.kv_geometry());
    if (!policy.ok()) return Fail(policy.status().ToString());
    for (int64_t context : *contexts) {
      if (context + o.gen_tokens > model.config().context_length) {
        return Fail(fmt::format("context {} + {} generated tokens exceeds the model's context {}",
                                context, o.gen_tokens, model.config().context_length));
      }
      for (int64_t batch : *batches) {
        Measurement best;
        for (int r = 0; r < o.repeat; ++r) {
          auto m = Measure(model, **policy, context, static_cast<int>(batch), o);
          if (!m.ok()) return Fail(m.status().ToString());
          if (m->decode_tokens_per_s > best.decode_tokens_per_s) best = *m;
        }
        std::printf("%-10s %8lld %6lld %14.1f %14.1f %10.2f %11.1fM %11.1fM %8.1f\n", name.c_str(),
                    static_cast<long long>(context), static_cast<long long>(batch),
                    best.prefill_tokens_per_s, best.decode_tokens_per_s, best.step_ms,
                    best.memory.fast_bytes / 1048576.0, best.memory.slow_bytes / 1048576.0,
                    100.0 * best.hit_rate);
        std::fflush(stdout);
        rows.push_back({{"policy", name}, {"context", context}, {"batch", batch},
                        {"prefill_tokens_per_s", best.prefill_tokens_per_s},
                        {"decode_tokens_per_s", best.decode_tokens_per_s},
                        {"step_ms", best.step_ms}, {"kv_fast_bytes", best.memory.fast_bytes},
                        {"kv_slow_bytes", best.memory.slow_bytes}, {"hit_rate", best.hit_rate}});
      }
    }
  }
  if (!o.json_path.empty()) {
    nlohmann::json report = {{"model", model.config().Summary()},
                             {"threads", model.pool().num_threads()},
                             {"gen_tokens", o.gen_tokens},
                             {"prefill_chunk", o.prefill_chunk},
                             {"results", rows}};
    std::ofstream(o.json_path) << report.dump(2) << "\n";
  }
  return 0;
}

// --device cuda: the same flags, run by cmd_bench_cuda.cc ("auto" batches allowed there).
void AddCudaBenchOptions(CLI::App& cmd, BenchOptions& o) {
  AddDeviceOption(cmd, o.device, "cpu | cuda (cuda with --synthetic)");
  cmd.add_option("--synthetic", o.synthetic,
                 "cuda: random weights with a named model's shapes (e.g. llama3-8b), "
                 "throughput only; implies --device cuda");
  cmd.add_option("--max-batch", o.max_batch, "cuda: the largest batch --batch auto may pick")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_flag("--host-values,!--no-host-values", o.host_values,
               "cuda shadowkv: --batch auto also measures larger batches whose extra sequences "
               "keep their values in pinned host memory")
      ->capture_default_str();
  cmd.add_option("--max-host-sequences", o.max_host_sequences,
                 "cuda shadowkv: at most this many sequences with values in pinned host memory "
                 "(-1: as many as host memory admits)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1 << 20));
  AddTensorParallelOptions(cmd, o.tensor_parallel);
  AddKernelTuningOptions(cmd);
}

int RunCudaBenchFrom(const BenchOptions& o) {
  CudaBenchOptions c;
  c.model_path = o.synthetic.empty() ? ResolveModelPath(o.model) : std::string();
  c.synthetic = o.synthetic;
  c.policies = o.policies;
  c.contexts = o.contexts;
  c.batches = o.batches;
  c.gen_tokens = o.gen_tokens;
  c.prefill_chunk = o.prefill_chunk;
  c.max_batch = o.max_batch;
  c.json_path = o.json_path;
  c.tensor_parallel = o.tensor_parallel;
  c.host_values = o.host_values;
  c.max_host_sequences = o.max_host_sequences;
  c.kv = o.kv;
  return RunCudaBench(c);
}

int RunBenchOnDevice(const BenchOptions& o) {
  if (o.device == Device::kCuda) return RunCudaBenchFrom(o);
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
      ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--prefill-chunk", options->prefill_chunk, "prompt tokens per forward step")
      ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--repeat", options->repeat, "repetitions (best is reported)")
      ->capture_default_str()->check(CLI::PositiveNumber);
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
