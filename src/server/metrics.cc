// Metrics: one mutex; rendering follows the Prometheus text exposition format 0.0.4.
#include "server/metrics.h"

#include <fmt/format.h>

namespace shadowkv::server {
namespace {

constexpr double kRateWindowSeconds = 10.0;

void Header(std::string* out, std::string_view name, std::string_view type, std::string_view help) {
  *out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

}  // namespace

void Histogram::Observe(double value) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (value <= bounds_[i]) {
      counts_[i]++;
      break;
    }
  }
  sum_ += value;
  count_++;
}

void Histogram::Render(std::string_view name, std::string* out) const {
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    *out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  *out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n", name, count_);
  *out += fmt::format("{}_sum {}\n{}_count {}\n", name, sum_, name, count_);
}

Metrics::Metrics()
    : time_to_first_token_({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      inter_token_latency_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}) {}

void Metrics::CountRequest(std::string_view endpoint, int http_status) {
  std::lock_guard lock(mutex_);
  requests_[{std::string(endpoint), http_status}]++;
}

void Metrics::AddPromptTokens(int64_t prompt_tokens, int64_t reused_tokens) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += prompt_tokens;
  reused_tokens_ += reused_tokens;
}

void Metrics::AddGeneratedTokens(int64_t count) {
  std::lock_guard lock(mutex_);
  generated_tokens_ += count;
  const Clock::time_point now = Clock::now();
  recent_tokens_.emplace_back(now, count);
  while (!recent_tokens_.empty() &&
         now - recent_tokens_.front().first > std::chrono::duration<double>(kRateWindowSeconds)) {
    recent_tokens_.pop_front();
  }
}

void Metrics::ObserveTimeToFirstToken(double seconds) {
  std::lock_guard lock(mutex_);
  time_to_first_token_.Observe(seconds);
}

void Metrics::ObserveInterTokenLatency(double seconds) {
  std::lock_guard lock(mutex_);
  inter_token_latency_.Observe(seconds);
}

void Metrics::AddPolicyStats(std::string_view policy, const kv::PolicyStats& stats) {
  std::lock_guard lock(mutex_);
  policy_stats_[std::string(policy)] += stats;
}

void Metrics::SetEngineGauges(const EngineGauges& gauges) {
  std::lock_guard lock(mutex_);
  gauges_ = gauges;
}

void Metrics::AddStep(const StepTimes& t) {
  std::lock_guard lock(mutex_);
  step_totals_ += t;
  ++steps_;
  if (t.prompt_tokens == 0) {
    ++decode_only_steps_;
    decode_only_model_seconds_ += t.model_seconds;
  }
}

void Metrics::AddHandlerTimes(const HandlerTimes& t) {
  std::lock_guard lock(mutex_);
  handler_totals_ += t;
}

int64_t Metrics::requests_total(std::string_view endpoint, int http_status) const {
  std::lock_guard lock(mutex_);
  auto it = requests_.find({std::string(endpoint), http_status});
  return it == requests_.end() ? 0 : it->second;
}

std::string Metrics::Render() const {
  std::lock_guard lock(mutex_);
  std::string out;
  Header(&out, "shadowkv_requests_total", "counter", "HTTP requests by endpoint and status code.");
  for (const auto& [key, count] : requests_) {
    out += fmt::format("shadowkv_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first,
                       key.second, count);
  }
  Header(&out, "shadowkv_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.");
  out += fmt::format("shadowkv_prompt_tokens_total {}\n", prompt_tokens_);
  Header(&out, "shadowkv_reused_prompt_tokens_total", "counter",
         "Prompt tokens served from a held KV state instead of prefill.");
  out += fmt::format("shadowkv_reused_prompt_tokens_total {}\n", reused_tokens_);
  Header(&out, "shadowkv_generated_tokens_total", "counter", "Generated tokens.");
  out += fmt::format("shadowkv_generated_tokens_total {}\n", generated_tokens_);
  int64_t recent = 0;
  for (const auto& [time, count] : recent_tokens_) {
    if (Clock::now() - time <= std::chrono::duration<double>(kRateWindowSeconds)) recent += count;
  }
  Header(&out, "shadowkv_generated_tokens_per_second", "gauge",
         "Generated tokens per second over the last 10 seconds.");
  out += fmt::format("shadowkv_generated_tokens_per_second {}\n", recent / kRateWindowSeconds);
  Header(&out, "shadowkv_queue_depth", "gauge", "Requests waiting for admission.");
  out += fmt::format("shadowkv_queue_depth {}\n", gauges_.queue_depth);
  Header(&out, "shadowkv_running_sequences", "gauge", "Sequences prefilling or decoding.");
  out += fmt::format("shadowkv_running_sequences {}\n", gauges_.running_sequences);
  Header(&out, "shadowkv_held_states", "gauge", "Finished sequences' KV states held for reuse.");
  out += fmt::format("shadowkv_held_states {}\n", gauges_.held_states);
  Header(&out, "shadowkv_kv_memory_bytes", "gauge", "KV cache bytes by tier and owner.");
  const auto memory_line = [&](const char* tier, const char* owner, int64_t bytes) {
    out += fmt::format("shadowkv_kv_memory_bytes{{tier=\"{}\",owner=\"{}\"}} {}\n", tier, owner,
                       bytes);
  };
  memory_line("fast", "running", gauges_.active_memory.fast_bytes);
  memory_line("slow", "running", gauges_.active_memory.slow_bytes);
  memory_line("fast", "held", gauges_.held_memory.fast_bytes);
  memory_line("slow", "held", gauges_.held_memory.slow_bytes);
  Header(&out, "shadowkv_kv_chunk_selections_total", "counter",
         "Chunks selected by sparse KV policies (finished requests).");
  for (const auto& [policy, stats] : policy_stats_) {
    out += fmt::format("shadowkv_kv_chunk_selections_total{{policy=\"{}\"}} {}\n", policy,
                       stats.chunk_selections);
  }
  Header(&out, "shadowkv_kv_chunk_hits_total", "counter",
         "Selected chunks reused from the previous step.");
  for (const auto& [policy, stats] : policy_stats_) {
    out +=
        fmt::format("shadowkv_kv_chunk_hits_total{{policy=\"{}\"}} {}\n", policy, stats.chunk_hits);
  }
  Header(&out, "shadowkv_kv_compress_seconds_total", "counter",
         "Time the engine loop spent compressing prompts (ShadowKV on the GPU).");
  for (const auto& [policy, stats] : policy_stats_) {
    out += fmt::format("shadowkv_kv_compress_seconds_total{{policy=\"{}\"}} {}\n", policy,
                       stats.compress_seconds);
  }
  Header(&out, "shadowkv_kv_hit_rate", "gauge", "Chunk hit rate (hits / selections) per policy.");
  for (const auto& [policy, stats] : policy_stats_) {
    out += fmt::format("shadowkv_kv_hit_rate{{policy=\"{}\"}} {}\n", policy, stats.hit_rate());
  }
  Header(&out, "shadowkv_time_to_first_token_seconds", "histogram",
         "From arrival to the first generated token.");
  time_to_first_token_.Render("shadowkv_time_to_first_token_seconds", &out);
  Header(&out, "shadowkv_inter_token_latency_seconds", "histogram",
         "Time between consecutive generated tokens of a request.");
  inter_token_latency_.Render("shadowkv_inter_token_latency_seconds", &out);
  Header(&out, "shadowkv_engine_steps_total", "counter",
         "Engine steps, and those without prompt tokens (decode only).");
  out += fmt::format("shadowkv_engine_steps_total{{kind=\"all\"}} {}\n", steps_);
  out +=
      fmt::format("shadowkv_engine_steps_total{{kind=\"decode_only\"}} {}\n", decode_only_steps_);
  Header(&out, "shadowkv_engine_step_rows_total", "counter", "Sequences summed over steps.");
  out += fmt::format("shadowkv_engine_step_rows_total {}\n", step_totals_.rows);
  Header(&out, "shadowkv_engine_step_seconds_total", "counter",
         "Engine loop time by phase: schedule (choosing rows), model (the step on the device, "
         "ids back), publish (tokens to requests); model_decode_only is model time of steps "
         "without prompt tokens.");
  const auto phase_line = [&](const char* phase, double seconds) {
    out +=
        fmt::format("shadowkv_engine_step_seconds_total{{phase=\"{}\"}} {:.6f}\n", phase, seconds);
  };
  phase_line("schedule", step_totals_.schedule_seconds);
  phase_line("model", step_totals_.model_seconds);
  phase_line("publish", step_totals_.publish_seconds);
  phase_line("model_decode_only", decode_only_model_seconds_);
  Header(&out, "shadowkv_handler_seconds_total", "counter",
         "Request handlers' time by phase (finished streams): handoff (engine push to handler "
         "wake-up, summed over wake-ups), detokenize (ids to text, stop sequences), write.");
  const auto handler_line = [&](const char* phase, double seconds) {
    out += fmt::format("shadowkv_handler_seconds_total{{phase=\"{}\"}} {:.6f}\n", phase, seconds);
  };
  handler_line("handoff", handler_totals_.handoff_seconds);
  handler_line("detokenize", handler_totals_.detokenize_seconds);
  handler_line("write", handler_totals_.write_seconds);
  Header(&out, "shadowkv_handler_wakeups_total", "counter",
         "Handler wake-ups that brought tokens (finished streams).");
  out += fmt::format("shadowkv_handler_wakeups_total {}\n", handler_totals_.handoffs);
  Header(&out, "shadowkv_handler_tokens_total", "counter",
         "Tokens handlers turned into text (finished streams).");
  out += fmt::format("shadowkv_handler_tokens_total {}\n", handler_totals_.tokens);
  return out;
}

}  // namespace shadowkv::server
