// The CUDA benchmark: one prompt prefilled and copied to every slot, warm-up steps (graph
// capture), timed graph-replayed decode steps, one profiled step, and the byte floor.
#include "gpu/bench/cuda_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/host_memory.h"
#include "kv/chunk_selection.h"
#include "ops/cuda/common/cuda_backend.h"

namespace shadowkv::cuda {
namespace {

constexpr int64_t kReserveBytes = 1ll << 30;
constexpr int kProfiledSteps = 2;  // the first warms the un-graphed path up; the second counts

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

int32_t ArgmaxOf(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Prefills slot 0 with `context` random tokens (from `seed`) in chunks of `chunk`, after a
// warm-up on a short prefix (module loading, cuBLAS heuristics); returns the timed seconds.
// The last token's logits go to `logits`.
Result<double> TimedPrefill(CudaModelGroup& model, uint64_t seed, int64_t context, int64_t chunk,
                            std::vector<float>* logits) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_int_distribution<int32_t> token_dist(
      0, static_cast<int32_t>(model.config().vocab_size - 1));
  std::vector<int32_t> prompt(context);
  for (int32_t& t : prompt) t = token_dist(rng);
  auto prefill = [&](int64_t count) -> Status {
    for (int64_t done = 0; done < count; done += chunk) {
      const int64_t n = std::min<int64_t>(chunk, count - done);
      CudaStepInput in;
      in.slot = 0;
      in.tokens = std::span<const int32_t>(prompt.data() + done, n);
      in.logits_out = done + n == count ? logits->data() : nullptr;
      SKV_RETURN_IF_ERROR(model.Forward(std::span<const CudaStepInput>(&in, 1)));
    }
    return Status::Ok();
  };
  SKV_RETURN_IF_ERROR(prefill(std::min(context, chunk)));
  model.ResetSlot(0);
  const auto start = std::chrono::steady_clock::now();
  SKV_RETURN_IF_ERROR(prefill(context));
  return Seconds(std::chrono::steady_clock::now() - start);
}

}  // namespace

Result<int> LargestBatch(CudaModelGroup& model, int64_t capacity, int64_t reserve_bytes) {
  SKV_ASSIGN_OR_RETURN(const int64_t free_bytes, model.FreeDeviceBytes());
  const int64_t per_sequence = model.KvBytesPerToken() * capacity / model.num_devices();
  const int64_t usable = free_bytes - reserve_bytes;
  const int64_t fits = usable > 0 ? usable / per_sequence : 0;
  return static_cast<int>(std::min<int64_t>(fits, model.options().max_batch));
}

Result<BenchResult> RunBenchCase(CudaModelGroup& model, const BenchCase& c) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& config = model.config();
  if (c.context < 1 || c.decode_steps < 1 || c.prefill_chunk < 1 || c.batch < 0) {
    return Error(ErrorCode::kInvalidArgument, "bench case: context {}, batch {}, {} steps",
                 c.context, c.batch, c.decode_steps);
  }
  const int64_t capacity = c.context + c.warmup_steps + c.decode_steps + kProfiledSteps;
  if (capacity > config.context_length) {
    return Error(ErrorCode::kOutOfRange, "context {} plus {} decode steps exceeds the model's {}",
                 c.context, capacity - c.context, config.context_length);
  }
  model.FreeKvCache();
  BenchResult r;
  r.context = c.context;
  SKV_ASSIGN_OR_RETURN(r.max_batch, LargestBatch(model, capacity, kReserveBytes));
  SKV_ASSIGN_OR_RETURN(r.free_bytes, model.FreeDeviceBytes());
  r.bounded_by_memory = r.max_batch < model.options().max_batch;
  r.batch = c.batch == 0 ? r.max_batch : c.batch;
  if (r.batch < 1 || r.batch > r.max_batch) {
    return Error(ErrorCode::kResourceExhausted,
                 "batch {} at context {} does not fit: at most {} sequences of {:.2f} GiB of KV "
                 "fit in the free GPU memory",
                 r.batch, c.context, r.max_batch,
                 static_cast<double>(model.KvBytesPerToken() * capacity) / (1 << 30));
  }
  // The estimate can miss by fragmentation: an automatic batch shrinks until it fits.
  Status allocated = model.AllocateKvCache(r.batch, capacity);
  while (!allocated.ok() && allocated.code() == ErrorCode::kResourceExhausted && c.batch == 0 &&
         r.batch > 1) {
    --r.batch;
    allocated = model.AllocateKvCache(r.batch, capacity);
  }
  SKV_RETURN_IF_ERROR(allocated);
  r.kv_bytes = model.KvBytesPerToken() * capacity * r.batch;

  std::vector<float> logits(config.vocab_size);
  SKV_ASSIGN_OR_RETURN(r.prefill_seconds,
                       TimedPrefill(model, c.seed, c.context, c.prefill_chunk, &logits));
  r.prefill_tokens_per_s = c.context / r.prefill_seconds;
  for (int slot = 1; slot < r.batch; ++slot) SKV_RETURN_IF_ERROR(model.CopySlot(0, slot));

  std::vector<int> slots(r.batch);
  for (int i = 0; i < r.batch; ++i) slots[i] = i;
  std::vector<int32_t> tokens(r.batch, ArgmaxOf(logits));
  for (int step = 0; step < c.warmup_steps; ++step) {
    SKV_RETURN_IF_ERROR(model.DecodeStep(slots, tokens, CudaSampling{}));
  }
  const auto decode_start = Clock::now();
  for (int step = 0; step < c.decode_steps; ++step) {
    SKV_RETURN_IF_ERROR(model.DecodeStep(slots, tokens, CudaSampling{}));
  }
  const double decode_seconds = Seconds(Clock::now() - decode_start);
  r.step_ms = 1000.0 * decode_seconds / c.decode_steps;
  r.decode_tokens_per_s = static_cast<double>(r.batch) * c.decode_steps / decode_seconds;
  SKV_ASSIGN_OR_RETURN(DeviceInfo device, QueryDevice());
  r.gpu_bytes_used = device.total_bytes - device.free_bytes;
  for (int i = 0; i < kProfiledSteps; ++i) {
    SKV_ASSIGN_OR_RETURN(r.breakdown, model.ProfileDecodeStep(slots, tokens));
  }

  const double mean_length = c.context + c.warmup_steps + 0.5 * c.decode_steps;
  // Per GPU: each reads its ranks' weights and KV (the replicated LM head once per rank).
  r.floor_bytes = (model.decode_weight_bytes() +
                   static_cast<int64_t>(r.batch * mean_length * model.KvBytesPerToken())) /
                  model.num_devices();
  r.floor_step_ms = 1000.0 * r.floor_bytes / kFloorBytesPerSecond;
  r.floor_tokens_per_s = r.batch / (r.floor_step_ms / 1000.0);
  model.FreeKvCache();
  return r;
}

std::vector<int> SpreadHostRows(const std::vector<int>& device_seqs,
                                const std::vector<int>& host_seqs) {
  const size_t rows = device_seqs.size() + host_seqs.size(), hosts = host_seqs.size();
  std::vector<int> order;
  order.reserve(rows);
  size_t next_host = 0, next_device = 0;
  for (size_t row = 0; row < rows; ++row) {
    if (next_host < hosts && row == (2 * next_host + 1) * rows / (2 * hosts)) {
      order.push_back(host_seqs[next_host++]);
    } else {
      order.push_back(device_seqs[next_device++]);
    }
  }
  return order;
}

kv::KvPolicyConfig ShadowKvBenchSettings(const kv::KvPolicyConfig& settings, int64_t context) {
  kv::KvPolicyConfig kv_config = settings;
  kv_config.policy = "shadowkv";
  if (kv_config.budget_tokens <= 0) {
    kv_config.budget_tokens = std::max<int64_t>(1, settings.BudgetTokens(context));
  }
  return kv_config;
}

Result<ShadowKvBenchResult> RunShadowKvBenchCase(CudaModelGroup& model,
                                                 const ShadowKvBenchCase& c) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& config = model.config();
  if (c.context < 1 || c.decode_steps < 1 || c.prefill_chunk < 1 || c.batch < 0) {
    return Error(ErrorCode::kInvalidArgument, "bench case: context {}, batch {}, {} steps",
                 c.context, c.batch, c.decode_steps);
  }
  // Each run starts from the freshly compressed prompt. Its profile averages one step of each
  // phase of the graduation cycle (a chunk graduates every chunk_size steps), after a warm-up.
  const int profiled_steps = 1 + std::max(1, c.settings.chunk_size);
  // The warm-up spans a graduation, so both step graphs (with and without one) exist before
  // the timed steps.
  const int warmup_steps = std::max(c.warmup_steps, c.settings.chunk_size + 1);
  const int64_t capacity = c.context + warmup_steps + c.decode_steps + profiled_steps;
  if (capacity > config.context_length) {
    return Error(ErrorCode::kOutOfRange, "context {} plus {} decode steps exceeds the model's {}",
                 c.context, capacity - c.context, config.context_length);
  }
  const kv::KvPolicyConfig kv_config = ShadowKvBenchSettings(c.settings, c.context);
  model.FreeShadowKv();
  model.FreeKvCache();
  ShadowKvBenchResult r;
  r.context = c.context;
  r.budget_tokens = kv_config.budget_tokens;

  // The prompt, prefilled into a one-slot full cache that also keeps pre-RoPE keys.
  SKV_RETURN_IF_ERROR(model.AllocateKvCache(1, c.context, true));
  std::vector<float> logits(config.vocab_size);
  SKV_ASSIGN_OR_RETURN(r.prefill_seconds,
                       TimedPrefill(model, c.seed, c.context, c.prefill_chunk, &logits));

  // How many sequences. Allocations measured one after the other: values in device memory only
  // (as many as fit alone); that batch topped up with sequences whose values are in pinned host
  // memory, one more at a time while their metadata fits beside it and the throughput grows;
  // and the largest batch with host values (their metadata takes device room, so fewer
  // device-value sequences). Sequence 0 is saved to host memory after compression and restored
  // into every later allocation.
  SKV_ASSIGN_OR_RETURN(auto per_sequence, model.ShadowKvBytesPerSequence(kv_config, capacity));
  const auto [meta_bytes, value_bytes] = per_sequence;
  r.device_bytes_per_sequence = meta_bytes;
  r.value_bytes_per_sequence = value_bytes;
  // Device room per GPU, and what one sequence takes of it (its ranks' share).
  const int64_t devices = model.num_devices();
  SKV_ASSIGN_OR_RETURN(const int64_t free_bytes, model.FreeDeviceBytes());
  const int64_t staging = 3 * model.KvBytesPerToken() / 2 * c.context / devices;
  const int64_t device_room = free_bytes + staging - 2 * kReserveBytes;
  // As in serving, a store the re-rank reads at every selection stays in device memory.
  const bool host_stores = c.allow_host_values && !kv_config.RerankReadsStore();
  const int64_t host_room =
      host_stores ? std::max<int64_t>(0, HostAvailableBytes() - c.host_reserve_bytes) : 0;
  const int64_t max_batch = model.options().max_batch;
  const int64_t meta_share = meta_bytes / devices, value_share = value_bytes / devices;
  const int64_t device_alone =
      std::min<int64_t>(device_room / (meta_share + value_share), max_batch);
  // Host-value sequences host memory admits (it is shared by all ranks), within the limit.
  const int64_t host_admits =
      std::min<int64_t>(host_room / value_bytes, c.max_host_sequences >= 0
                                                     ? c.max_host_sequences
                                                     : std::numeric_limits<int64_t>::max());
  int64_t host_count = host_admits;
  int64_t device_count = (device_room - host_count * meta_share) / (meta_share + value_share);
  if (device_count < 1) {
    device_count = std::max<int64_t>(0, device_room / (meta_share + value_share));
    host_count = std::max<int64_t>(0, (device_room - device_count * (meta_share + value_share)) /
                                          meta_share);
    host_count = std::min<int64_t>(host_count, host_admits);
  }
  int64_t mixed_total = std::min<int64_t>(device_count + host_count, max_batch);
  // Host-value sequences whose metadata fits beside the device-alone batch.
  const int64_t top_up =
      device_alone < 1
          ? 0
          : std::max<int64_t>(0, std::min({(device_room - device_alone * (meta_share + value_share)) /
                                               meta_share,
                                           host_admits, max_batch - device_alone}));
  struct Plan {
    int64_t total = 0, on_device = 0;
    bool top_up = false;  // skipped once a smaller top-up measured no faster
  };
  std::vector<Plan> plans;
  if (c.batch > 0) {
    const int64_t admits = std::max(device_alone, mixed_total);
    if (c.batch > admits) {
      return Error(ErrorCode::kResourceExhausted,
                   "batch {} does not fit: device and host memory admit {} ShadowKV sequences "
                   "of context {}", c.batch, admits, c.context);
    }
    plans.push_back(c.batch <= device_alone ? Plan{c.batch, c.batch}
                                            : Plan{c.batch, std::min<int64_t>(device_count, c.batch)});
  } else {
    if (device_alone >= 1) plans.push_back({device_alone, device_alone});
    for (int64_t extra = 1; extra <= top_up; ++extra) {
      plans.push_back({device_alone + extra, device_alone, true});
    }
    if (host_count > 0 && device_count >= 1 && mixed_total > device_alone + top_up) {
      plans.push_back({mixed_total, std::min(device_count, mixed_total)});
    }
  }
  if (plans.empty() || plans[0].on_device < 1) {
    return Error(ErrorCode::kResourceExhausted, "no ShadowKV sequence of context {} fits",
                 c.context);
  }
  const int32_t first_token = ArgmaxOf(logits);
  CudaShadowKvGroupSnapshot snapshot;
  // The prompt is compressed while its full cache is still held. When the first plan's
  // sequences (and the first one's values) do not fit beside that cache, as for a 70B shape at
  // 244K on two GPUs, the prompt is compressed alone first (its values in pinned host memory if
  // the device lacks even that room), saved, and every plan restores it.
  const int64_t beside_prefill = free_bytes - kReserveBytes;
  const bool compress_alone = plans[0].total * meta_share + value_share > beside_prefill;
  // Compresses the prefilled prompt into sequence 0 (values allocated), then frees its full cache.
  auto compress = [&]() -> Status {
    SKV_RETURN_IF_ERROR(model.CompressToShadowKv(0, 0));
    const CudaShadowKvStats stats = model.shadowkv_stats();
    r.compress_seconds = stats.compress_seconds;
    r.compress_phase_seconds = stats.compress_phase_seconds;
    model.FreeKvCache();
    return Status::Ok();
  };
  if (compress_alone) {
    SKV_RETURN_IF_ERROR(model.AllocateShadowKv(kv_config, 1, capacity));
    SKV_RETURN_IF_ERROR(
        model.AllocateShadowKvValues(0, /*on_host=*/meta_share + value_share > beside_prefill));
    SKV_RETURN_IF_ERROR(compress());
    SKV_ASSIGN_OR_RETURN(snapshot, model.SaveShadowKvSequence(0));
    model.FreeShadowKv();
  }
  // One allocation's run; a failure of the second (mixed) one leaves the first's result.
  auto measure = [&](size_t plan_index) -> Status {
    const Plan plan = plans[plan_index];
    SKV_RETURN_IF_ERROR(model.AllocateShadowKv(kv_config, static_cast<int>(plan.total), capacity));
    SKV_RETURN_IF_ERROR(model.AllocateShadowKvValues(0, false));
    if (plan_index == 0 && !compress_alone) {
      SKV_RETURN_IF_ERROR(compress());
      if (plans.size() > 1) {
        SKV_ASSIGN_OR_RETURN(snapshot, model.SaveShadowKvSequence(0));
      }
    } else {
      SKV_RETURN_IF_ERROR(model.RestoreShadowKvSequence(snapshot, 0));
      // Its host memory goes to the pinned values of the last plan.
      if (plan_index + 1 == plans.size()) snapshot = CudaShadowKvGroupSnapshot{};
    }
    int admitted = 1, on_device = 1;
    std::vector<int> device_seqs = {0}, host_seqs;
    for (int seq = 1; seq < plan.total; ++seq) {
      bool on_host = seq >= plan.on_device;
      Status allocated = model.AllocateShadowKvValues(seq, on_host);
      if (!allocated.ok() && !on_host && host_stores && plan.on_device < plan.total) {
        on_host = true;  // the device estimate missed: try the host
        allocated = model.AllocateShadowKvValues(seq, true);
      }
      if (!allocated.ok()) {
        if (allocated.code() != ErrorCode::kResourceExhausted) return allocated;
        r.note = fmt::format("{} of {} planned sequences admitted: {}", admitted, plan.total,
                             allocated.message());
        break;
      }
      SKV_RETURN_IF_ERROR(model.CopyShadowKvSequence(0, seq));
      ++admitted;
      if (!on_host) ++on_device;
      (on_host ? host_seqs : device_seqs).push_back(seq);
    }
    r.max_batch = std::max(r.max_batch, admitted);
    const CudaShadowKvStats stats = model.shadowkv_stats();
    r.rank = stats.rank;
    r.skv_device_bytes = std::max(r.skv_device_bytes, stats.device_bytes);
    r.host_bytes = std::max(r.host_bytes, stats.host_bytes);

    const int batch = admitted;
    ShadowKvBenchRun run;
    run.batch = batch;
    run.device_value_sequences = on_device;
    run.host_value_sequences = batch - on_device;
    run.host_bytes = stats.host_bytes;
    const std::vector<int> seqs = SpreadHostRows(device_seqs, host_seqs);
    std::vector<int32_t> tokens(batch, first_token);
    for (int step = 0; step < warmup_steps; ++step) {
      SKV_RETURN_IF_ERROR(model.ShadowKvDecodeStep(seqs, tokens, CudaSampling{}));
    }
    model.ResetShadowKvCounters();
    const auto decode_start = Clock::now();
    for (int step = 0; step < c.decode_steps; ++step) {
      SKV_RETURN_IF_ERROR(model.ShadowKvDecodeStep(seqs, tokens, CudaSampling{}));
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - decode_start).count();
    const CudaShadowKvStats counted = model.shadowkv_stats();
    run.hit_rate = counted.chunks_selected > 0
                       ? static_cast<double>(counted.chunk_hits) / counted.chunks_selected
                       : 0.0;
    run.selection_share = counted.head_steps > 0 ? static_cast<double>(counted.head_selections) /
                                                       static_cast<double>(counted.head_steps)
                                                 : 0.0;
    run.step_ms = 1000.0 * seconds / c.decode_steps;
    run.decode_tokens_per_s = static_cast<double>(batch) * c.decode_steps / seconds;
    SKV_ASSIGN_OR_RETURN(DeviceInfo now, QueryDevice());
    run.gpu_bytes_used = now.total_bytes - now.free_bytes;
    r.gpu_bytes_used = std::max(r.gpu_bytes_used, run.gpu_bytes_used);
    SKV_RETURN_IF_ERROR(model.ProfileShadowKvDecodeStep(seqs, tokens).status());  // warm-up
    const int cycle = profiled_steps - 1;
    for (int i = 0; i < cycle; ++i) {
      SKV_ASSIGN_OR_RETURN(const StepBreakdown step, model.ProfileShadowKvDecodeStep(seqs, tokens));
      run.breakdown.Add(step, 1.0 / cycle);
    }

    // Floors (DESIGN.md): bytes each part must move at least, per step, per GPU (a rank's heads
    // rebuild from its own rank-r/N factors), over the compressed (global) layers.
    const double layers = static_cast<double>(config.num_layers) -
                          std::count(config.layer_windowed.begin(), config.layer_windowed.end(), true);
    const double d = config.head_dim;
    const double heads = static_cast<double>(config.num_kv_heads) / devices;
    const double chunk = kv_config.chunk_size, rank = static_cast<double>(r.rank) / model.size();
    const double budget = static_cast<double>(r.budget_tokens) / chunk;
    const double outliers = static_cast<double>(kv::ResolveOutlierChunks(
        kv_config.outlier_chunks, r.budget_tokens, static_cast<int64_t>(c.context) / chunk));
    r.outlier_chunks = static_cast<int>(outliers);
    const double mean_length = c.context + warmup_steps + 0.5 * c.decode_steps;
    const double chunks = mean_length / chunk;
    const double misses = (1.0 - run.hit_rate) * budget;
    const double per_layer_rows = batch * layers * heads;
    const double device_rate = kFloorBytesPerSecond / 1000.0;  // bytes per ms
    run.floors.dense_ms = static_cast<double>(model.decode_weight_bytes()) / devices / device_rate;
    // FP8: a landmark or a stored run is one byte per element plus its 4-byte scale.
    const double landmark_bytes = kv_config.fp8_landmarks ? d + 4 : d * 2;
    // Exact keys: a miss reads its keys' bf16 run beside its values and rebuilds nothing.
    const bool exact_keys = kv_config.exact_keys != 0;
    const double key_run_bytes = kv_config.fp8_keys ? chunk * d + 4 : chunk * d * 2;
    const double run_bytes = (kv_config.fp8_values ? chunk * d + 4 : chunk * d * 2) +
                             (exact_keys ? key_run_bytes : 0);
    const double written_bytes = chunk * d * 2 * (exact_keys ? 2 : 1);
    // `bytes` read per layer and KV head from every sequence's store, where the store lives.
    const auto store_read_ms = [&](double bytes) {
      return layers * heads * bytes *
             (run.device_value_sequences / device_rate +
              run.host_value_sequences / (kHostReadBytesPerSecond / 1000.0));
    };
    // The re-rank reads each candidate chunk's keys once per KV head (rerank_factor · K, at
    // least the floor's): its A rows (their first rerank_rank columns where set), or with exact
    // keys and no rerank_rank its stored run, from wherever the sequence's store lives.
    const double candidates =
        kv_config.selection == "rerank"
            ? std::min(std::max(kv_config.rerank_factor * budget,
                                static_cast<double>(kv_config.RerankFloorChunks(kv_config.chunk_size))),
                       chunks)
            : 0.0;
    const double score_rank =
        kv_config.rerank_rank > 0 ? std::min<double>(kv_config.rerank_rank, rank) : rank;
    const double candidate_ms =
        kv_config.RerankReadsStore()
            ? store_read_ms(candidates * key_run_bytes)
            : per_layer_rows * candidates * chunk * score_rank * 2 / device_rate;
    run.floors.scoring_ms = per_layer_rows * chunks * landmark_bytes / device_rate + candidate_ms;
    run.floors.rebuild_ms =
        exact_keys ? 0.0 : per_layer_rows * misses * chunk * (rank + d) * 2 / device_rate;
    // A fetched run is read from the store and written to the gather rows as bf16.
    run.floors.fetch_ms =
        store_read_ms(misses * run_bytes) +
        layers * heads * misses * run.device_value_sequences * written_bytes / device_rate;
    run.floors.attention_ms =
        per_layer_rows * ((outliers + budget) * chunk + kv_config.local_window + chunk / 2) * d *
        4 / device_rate;
    run.floors.total_ms = run.floors.dense_ms + run.floors.scoring_ms + run.floors.rebuild_ms +
                          run.floors.fetch_ms + run.floors.attention_ms;
    r.runs.push_back(run);
    return Status::Ok();
  };
  bool top_ups_done = false;  // a top-up measured no faster than the batch before it
  for (size_t plan_index = 0; plan_index < plans.size(); ++plan_index) {
    const Plan& plan = plans[plan_index];
    if (plan.top_up && top_ups_done) continue;
    const double before = r.runs.empty() ? 0.0 : r.runs.back().decode_tokens_per_s;
    const Status measured = measure(plan_index);
    model.FreeShadowKv();
    if (!measured.ok()) {
      if (plan_index == 0) return measured;
      r.note = fmt::format("the device + host allocation ({} sequences, {} with host values) was "
                           "not measured: {}",
                           plan.total, plan.total - plan.on_device, measured.ToString());
      if (!plan.top_up) break;
      top_ups_done = true;  // the largest mixed batch may still be measured
      continue;
    }
    if (plan.top_up && r.runs.back().decode_tokens_per_s <= before) top_ups_done = true;
  }
  for (size_t i = 1; i < r.runs.size(); ++i) {
    if (r.runs[i].decode_tokens_per_s > r.runs[r.best].decode_tokens_per_s) r.best = static_cast<int>(i);
  }
  r.free_bytes = device_room + 2 * kReserveBytes;
  r.bounded_by_memory = std::max(device_alone, mixed_total) < max_batch;
  return r;
}

}  // namespace shadowkv::cuda
