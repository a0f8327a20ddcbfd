// Host-side ShadowKV-on-GPU planning, pure C++: per-sequence constants, each decode row's plan
// (where the new token goes, which chunk graduates) and the memory one sequence takes.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "kv/kv_config.h"
#include "ops/cuda/shadowkv/shadowkv_meta.h"

namespace shadowkv::cuda {

// The shape every sequence of one allocation shares.
struct SkvGeometry {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int chunk_size = 0;
  int rank = 0;
  int local_window = 0;
  int64_t capacity_tokens = 0;  // prompt plus generated tokens one sequence may reach
  int capacity_chunks = 0;      // capacity_tokens / chunk_size, rounded up to a multiple of 16
  int max_budget = 0;           // K for a prompt of capacity_tokens (budgets grow with length)
  int max_outliers = 0;         // O for that budget
  int recent_capacity = 0;      // local_window + chunk_size
  int64_t attn_capacity = 0;    // (max_outliers + max_budget) * C + recent_capacity
  // FP8 e4m3 (one fp32 scale per chunk of one KV head) for the stored values / the landmarks.
  bool fp8_values = false;
  bool fp8_landmarks = false;

  int kv_width() const { return num_kv_heads * head_dim; }
  // Device bytes of one sequence without its values, and the bytes of its values.
  int64_t DeviceBytesPerSequence() const;
  int64_t ValueBytesPerSequence() const;
  // Bytes of one sequence's landmarks (with their scales under FP8).
  int64_t LandmarkBytesPerSequence() const;
  // Where the value scales start in a sequence's value store (FP8 only): after the codes.
  int64_t ValueCodeBytesPerSequence() const;
};

// Resolves the settings (rank from the ratio, budget at capacity, outliers) for a model shape.
Result<SkvGeometry> MakeSkvGeometry(const kv::KvPolicyConfig& config, int num_layers,
                                    int num_kv_heads, int head_dim, int64_t capacity_tokens);

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

// The plan of one decode row that appends a token to a sequence of `length` tokens.
SkvRowMeta PlanSkvRow(int seq, int64_t length, int64_t exact_first0, const SkvSequenceInfo& info,
                      int chunk_size, int local_window);

}  // namespace shadowkv::cuda
