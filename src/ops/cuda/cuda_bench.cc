// The CUDA benchmark: one prompt prefilled and copied to every slot, warm-up steps (graph
// capture), timed graph-replayed decode steps, one profiled step, and the byte floor.
#include "ops/cuda/cuda_bench.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "ops/cuda/cuda_backend.h"

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

}  // namespace

Result<int> LargestBatch(const CudaModel& model, int64_t capacity, int64_t reserve_bytes) {
  SKV_ASSIGN_OR_RETURN(DeviceInfo device, QueryDevice());
  const int64_t per_sequence = model.KvBytesPerToken() * capacity;
  const int64_t usable = device.free_bytes - reserve_bytes;
  const int64_t fits = usable > 0 ? usable / per_sequence : 0;
  return static_cast<int>(std::min<int64_t>(fits, model.options().max_batch));
}

Result<BenchResult> RunBenchCase(CudaModel& model, const BenchCase& c) {
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

  std::mt19937 rng(static_cast<uint32_t>(c.seed));
  std::uniform_int_distribution<int32_t> token_dist(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> prompt(c.context);
  for (int32_t& t : prompt) t = token_dist(rng);
  std::vector<float> logits(config.vocab_size);
  auto prefill = [&](int64_t count) -> Status {
    for (int64_t done = 0; done < count; done += c.prefill_chunk) {
      const int64_t n = std::min<int64_t>(c.prefill_chunk, count - done);
      CudaStepInput in;
      in.slot = 0;
      in.tokens = std::span<const int32_t>(prompt.data() + done, n);
      in.logits_out = done + n == count ? logits.data() : nullptr;
      SKV_RETURN_IF_ERROR(model.Forward(std::span<const CudaStepInput>(&in, 1)));
    }
    return Status::Ok();
  };
  // Warm-up (module loading, cuBLAS heuristics) on a short prefix, then the timed prompt.
  SKV_RETURN_IF_ERROR(prefill(std::min<int64_t>(c.context, c.prefill_chunk)));
  model.ResetSlot(0);
  const auto prefill_start = Clock::now();
  SKV_RETURN_IF_ERROR(prefill(c.context));
  r.prefill_seconds = Seconds(Clock::now() - prefill_start);
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
  r.floor_bytes = model.decode_weight_bytes() +
                  static_cast<int64_t>(r.batch * mean_length * model.KvBytesPerToken());
  r.floor_step_ms = 1000.0 * r.floor_bytes / kFloorBytesPerSecond;
  r.floor_tokens_per_s = r.batch / (r.floor_step_ms / 1000.0);
  model.FreeKvCache();
  return r;
}

}  // namespace shadowkv::cuda
