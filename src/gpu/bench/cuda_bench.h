// Throughput measurements of a CudaModel with the full KV cache (`shadowkv bench --device cuda`).
// Pure C++ interface.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "gpu/model/cuda_model.h"
#include "gpu/tp/cuda_model_group.h"
#include "kv/kv_config.h"

namespace shadowkv::cuda {

// The H200's device-to-device copy rate measured on the lent machine (DESIGN.md), the bandwidth
// the "floor" of a decode step is computed with.
constexpr double kFloorBytesPerSecond = 4.27e12;

struct BenchCase {
  int64_t context = 0;      // prompt tokens of every sequence
  int batch = 0;            // sequences decoded together; 0 = the largest that fits
  int decode_steps = 128;   // timed, graph-replayed steps
  int warmup_steps = 3;     // untimed steps first (the graph is captured in the first)
  int prefill_chunk = 4096;  // prompt tokens per Forward
  uint64_t seed = 1;        // prompt tokens
};

struct BenchResult {
  int64_t context = 0;
  int batch = 0;
  int max_batch = 0;  // the largest batch whose KV cache fits beside the model, from free memory
  // Whether device memory bounded max_batch (else the model's max_batch did), and the free
  // device memory it was computed from.
  bool bounded_by_memory = false;
  int64_t free_bytes = 0;
  // One sequence's prompt, prefilled chunk by chunk; the other batch - 1 slots are copies of it
  // (decode speed does not depend on the values in the cache).
  double prefill_seconds = 0;
  double prefill_tokens_per_s = 0;
  double decode_tokens_per_s = 0;  // batch tokens per graph-replayed step
  double step_ms = 0;
  StepBreakdown breakdown;        // one un-graphed step, timed op by op
  int64_t kv_bytes = 0;           // the KV cache allocated
  int64_t gpu_bytes_used = 0;     // device memory in use during decode (all processes)
  // Bytes one decode step must move (weights read once, each sequence's K and V read once, at
  // the mean length of the timed steps) and the time and rate that takes at kFloorBytesPerSecond.
  int64_t floor_bytes = 0;
  double floor_step_ms = 0;
  double floor_tokens_per_s = 0;
};

// How many sequences of `capacity` tokens fit in the device's free memory now, keeping
// `reserve_bytes` free (cuBLAS, graphs, fragmentation). At most model.options().max_batch.
// Under tensor parallelism: on every GPU, each holding its ranks' share of the cache.
Result<int> LargestBatch(CudaModelGroup& model, int64_t capacity, int64_t reserve_bytes);

// ShadowKV on the GPU: one prompt prefilled into a temporary full-cache slot (with
// pre-RoPE keys), compressed, copied to every admitted sequence, then decoded.
struct ShadowKvBenchCase {
  int64_t context = 0;
  int batch = 0;             // 0 = as many as device and host memory admit
  int decode_steps = 128;
  int warmup_steps = 3;
  int prefill_chunk = 4096;
  uint64_t seed = 1;
  // ShadowKV's settings (policy ignored). A budget of 0: the next power of two of context / 64
  // (1024 at 60K, 2048 at 122K).
  kv::KvPolicyConfig settings;
  int64_t host_reserve_bytes = 16ll << 30;  // host memory left to everything else
  bool allow_host_values = true;
  int max_host_sequences = -1;  // sequences with host values at most (-1: no limit)
};

// The rows of a ShadowKV bench batch: the device-value sequences with the host-value ones
// spread evenly among them (host sequence k at row (2k + 1)·rows / (2·hosts)), so each half of
// a split step's rows reads some values over the bus beside its own key rebuild.
std::vector<int> SpreadHostRows(const std::vector<int>& device_seqs,
                                const std::vector<int>& host_seqs);

// Per-step byte floors of DESIGN.md's equivalent-bandwidth model with the measured hit rate:
// device bytes at kFloorBytesPerSecond, host (pinned) reads at kHostReadBytesPerSecond.
struct ShadowKvFloors {
  double dense_ms = 0, scoring_ms = 0, rebuild_ms = 0, fetch_ms = 0, attention_ms = 0;
  double total_ms = 0;
};
constexpr double kHostReadBytesPerSecond = 50.7e9;  // measured: random 2 KiB runs, pinned host

struct ShadowKvBenchRun {
  int batch = 0;
  int device_value_sequences = 0;
  int host_value_sequences = 0;
  int64_t gpu_bytes_used = 0;  // during this run's allocation
  int64_t host_bytes = 0;      // pinned values of this run's allocation
  double decode_tokens_per_s = 0;
  double step_ms = 0;
  double hit_rate = 0;
  // select_drift: the (layer, KV head) decode steps that selected, of all (0 without drift).
  double selection_share = 0;
  StepBreakdown breakdown;
  ShadowKvFloors floors;
};

struct ShadowKvBenchResult {
  int64_t context = 0;
  int64_t budget_tokens = 0;
  int rank = 0;
  int outlier_chunks = 0;
  int max_batch = 0;  // the most sequences one allocation admitted
  // Whether memory (device, and pinned host for host-value sequences) bounded max_batch (else
  // the model's max_batch did), and the device memory free for the sequences.
  bool bounded_by_memory = false;
  int64_t free_bytes = 0;
  double prefill_seconds = 0;   // full-attention prefill of one prompt (pre-RoPE keys kept)
  double compress_seconds = 0;  // factorisation + landmarks + outliers + value offload
  std::array<double, 4> compress_phase_seconds{};  // CudaShadowKvStats's parts of it
  std::vector<ShadowKvBenchRun> runs;  // device values only; device + host values (if any)
  int best = 0;                        // index into runs
  int64_t gpu_bytes_used = 0;
  int64_t skv_device_bytes = 0;
  int64_t host_bytes = 0;              // pinned values
  int64_t device_bytes_per_sequence = 0;
  int64_t value_bytes_per_sequence = 0;
  std::string note;  // e.g. why fewer sequences were admitted
};

// The settings a ShadowKV bench case of `context` tokens runs with: `settings` as policy
// "shadowkv", and without a budget in tokens the budget its fraction, floor and ceiling give at
// `context`, the one a server gives a prompt of that length (512 at 32K and 1,952 at 124,928
// for the defaults; 1,500 at 12,000 and 2,048 at 32,000 and beyond for shadowkv:accurate=1).
kv::KvPolicyConfig ShadowKvBenchSettings(const kv::KvPolicyConfig& settings, int64_t context);

// Byte counts are the whole group's; floors are per GPU (the group's bytes over its GPUs).
Result<ShadowKvBenchResult> RunShadowKvBenchCase(CudaModelGroup& model,
                                                 const ShadowKvBenchCase& c);

// Frees the model's KV cache, sizes a new one for the case, prefills, decodes and measures.
// A batch that does not fit is kResourceExhausted (never a crash).
Result<BenchResult> RunBenchCase(CudaModelGroup& model, const BenchCase& bench_case);

}  // namespace shadowkv::cuda
