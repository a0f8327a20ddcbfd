// Host-side ShadowKV-on-GPU planning, pure C++: per-sequence constants, each decode row's plan
// (where the new token goes, which chunk graduates) and the memory one sequence takes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "kv/kv_config.h"
#include "model/config.h"
#include "ops/cuda/shadowkv/shadowkv_meta.h"

namespace shadowkv::cuda {

// The shape every sequence of one allocation shares. On a sliding-window model (gemma3,
// Mistral-style llama) ShadowKV applies to the global layers alone: num_layers counts them, and
// the windowed layers keep exactly the last `window_rows` tokens of each sequence in a ring
// (window_layers of them, token p at row p % window_rows).
struct SkvGeometry {
  int num_layers = 0;  // compressed layers: the model's global layers
  int window_layers = 0;
  int window_rows = 0;  // min(sliding window, capacity_tokens); 0 without windowed layers
  int num_kv_heads = 0;
  int head_dim = 0;
  int chunk_size = 0;
  // The rank the storage is laid out for: the fixed rank, or with rank_energy > 0 the cap
  // (rank_max, or the width when 0), so that A and B keep one layout for every sequence; each
  // (sequence, layer) then uses its own rank up to it (SkvRankForEnergy), and the memory counted
  // below is the cap's.
  int rank = 0;
  double rank_energy = 0.0;  // > 0: the rank of each layer from its key spectrum
  int rank_floor = 0;        // with rank_energy: rank_min rounded up to 8 (at least 8)
  int local_window = 0;
  int64_t capacity_tokens = 0;  // prompt plus generated tokens one sequence may reach
  int capacity_chunks = 0;      // capacity_tokens / chunk_size, rounded up to a multiple of 16
  int max_budget = 0;           // K for a prompt of capacity_tokens (budgets grow with length)
  // Chunk selection "rerank": the landmarks keep rerank_factor · K candidates per KV head (at
  // most max_candidates, the capacity's), whose rebuilt keys pick the K. 0: landmarks alone.
  int rerank_factor = 0;
  int rerank_min_chunks = 0;  // candidates at least (rerank_min_tokens), at most the capacity's
  int rerank_rank = 0;  // components the candidates are scored with (0: the layer's rank)
  int max_candidates = 0;
  bool select_heads = false;    // selection "heads": each query head's own ranking, round-robin
  // select_sample: chunks a selection draws at random at most (the share of max_budget), each
  // gather slot then with a log weight (SkvLayout::slot_log_weight); 0 without it.
  int max_sample = 0;
  int max_outliers = 0;         // O for that budget
  int recent_capacity = 0;      // local_window + chunk_size
  int64_t attn_capacity = 0;    // (max_outliers + max_budget) * C + recent_capacity
  // FP8 e4m3 (one fp32 scale per chunk of one KV head) for the stored values / the landmarks.
  bool fp8_values = false;
  bool fp8_landmarks = false;
  // The store keeps each chunk's exact post-RoPE keys (bf16) after its values, and a miss copies
  // them into the gather rows instead of rebuilding them from A and B; the rank-r factors then
  // serve the re-rank's scores only (kv::KvPolicyConfig::exact_keys).
  bool exact_keys = false;
  bool fp8_keys = false;  // the exact keys as FP8 e4m3 runs with their scales (fp8_keys)
  // Reuse of a selection (kv::KvPolicyConfig select_interval and select_drift). Under drift each
  // KV head of each layer keeps its last selection's step and its query heads' queries (fp32,
  // without the rotary embedding), so the geometry needs the query heads per KV head: `group`,
  // set by MakeSkvGeometryFor (1 from MakeSkvGeometry alone). select_drift turns the rule on;
  // each sequence's threshold, which its budget may tighten, is its SkvSequenceInfo's
  // (PlanSkvCompression).
  int select_interval = 1;
  double select_drift = 0.0;
  int group = 1;

  int kv_width() const { return num_kv_heads * head_dim; }
  // A KV head decides on the device, from its queries, whether it selects at a decode step.
  bool drift() const { return kv::ReselectsOnDrift(select_drift, select_interval); }
  // Bytes of one sequence's drift state ([layers, kv_heads] steps and [.., group, head_dim]
  // queries); 0 without drift().
  int64_t DriftBytesPerSequence() const;
  bool per_layer_rank() const { return rank_energy > 0.0; }
  // Device bytes of one sequence without its store (A and B at `rank`, the cap under a per-layer
  // rank; the windowed layers' rings included): the fast tier.
  int64_t DeviceBytesPerSequence() const;
  // Bytes of one sequence's windowed-layer rings (K and V, bf16).
  int64_t WindowBytesPerSequence() const;
  // One sequence's store (the slow tier, device or pinned host memory): its values (codes, then
  // scales under FP8), then with exact_keys its keys, from KeyStoreOffset(): bf16, one run per
  // chunk of one KV head in the values' order (under fp8_keys codes, then scales).
  int64_t StoreBytesPerSequence() const;
  int64_t ValueBytesPerSequence() const;  // the values' part
  int64_t KeyStoreOffset() const { return ValueBytesPerSequence(); }
  int64_t KeyBytesPerSequence() const;  // 0 without exact_keys
  // Bytes of one sequence's landmarks (with their scales under FP8).
  int64_t LandmarkBytesPerSequence() const;
  // Where the value scales start in a sequence's value store (FP8 only): after the codes.
  int64_t ValueCodeBytesPerSequence() const;
};

// Resolves the settings (rank from the ratio or the cap of a per-layer rank, budget at capacity,
// outliers) for a model shape. kUnsupported for settings the GPU does not run.
Result<SkvGeometry> MakeSkvGeometry(const kv::KvPolicyConfig& config, int num_layers,
                                    int num_kv_heads, int head_dim, int64_t capacity_tokens);

// MakeSkvGeometry for a model: its global layers compressed, its windowed layers in rings of its
// sliding window (`num_kv_heads`: the heads one device holds). kUnsupported where every layer
// slides (nothing to compress), with the CPU policy's reason.
Result<SkvGeometry> MakeSkvGeometryFor(const kv::KvPolicyConfig& config, const ModelConfig& model,
                                       int num_kv_heads, int64_t capacity_tokens);

// Each model layer's index in its part: among the global layers (ShadowKV's layout) or among
// the windowed layers (the rings); windowed[l] says which.
struct SkvLayerParts {
  std::vector<bool> windowed;  // [model layers]
  std::vector<int> index;      // [model layers]
  std::vector<int> global;     // [global layers] the model layer of each
};
SkvLayerParts SkvLayerPartsOf(const ModelConfig& model);

// The rank of one layer under rank_energy (the CPU policy's rule, kv::RankForEnergy, kept the
// same on both sides): the smallest multiple of 8 whose top eigenvalues (`eigenvalues`, largest
// first, of the layer's pre-RoPE key Gram, negative ones as 0; they may stop at the cap, as the
// GPU's solver returns them) hold `energy` of `total_energy` (the Gram's trace), clamped to
// [floor, cap] and to the spectrum's width. energy >= 1 takes the cap; a layer whose keys hold no
// energy takes the floor.
int SkvRankForEnergy(std::span<const double> eigenvalues, double total_energy, double energy,
                     int floor, int cap);

// Constants of a sequence compressed from a prompt of `prompt_tokens`, and the first position
// left exact (chunked tokens). kUnsupported where the prompt is too short for its budget.
struct SkvCompressionPlan {
  SkvSequenceInfo info;
  int64_t num_chunks = 0;
  int64_t exact_first = 0;  // num_chunks * C
};
Result<SkvCompressionPlan> PlanSkvCompression(const kv::KvPolicyConfig& config,
                                              const SkvGeometry& geometry, int64_t prompt_tokens);

// First exact position of a sequence holding `length` tokens that was compressed with its
// exact window starting at `exact_first0` (the CPU policy's graduation rule: whole chunks leave
// the window as soon as local_window + chunk_size tokens are exact).
int64_t SkvExactFirst(int64_t length, int64_t exact_first0, int chunk_size, int local_window);

// The plan of one decode row that appends a token to a sequence of `length` tokens; with
// select_interval > 1 the row selects only at decode steps (length - info.decode_origin) that
// the interval divides, and reuses its gathered chunks between (the CPU policy's rule). Under
// select_drift the caller passes 1: the drift kernel decides per KV head (LaunchSkvDrift).
SkvRowMeta PlanSkvRow(int seq, int64_t length, int64_t exact_first0, const SkvSequenceInfo& info,
                      int chunk_size, int local_window, int select_interval = 1);

}  // namespace shadowkv::cuda
