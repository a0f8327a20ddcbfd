// ShadowKV-on-GPU records shared by the host planner and the kernels (plain structs, no
// dependencies, so both the C++20 host code and the C++17 kernels include them).
#pragma once

#include <cstdint>

namespace shadowkv::cuda {

// Candidates per (row, KV head) a re-ranking select may keep at most (rerank_factor · K): the
// re-rank orders them by counting, so its work grows with the square of this.
constexpr int kSkvMaxRerankCandidates = 4096;

// Per-sequence constants, fixed when the sequence is compressed (mirrored on the device).
struct SkvSequenceInfo {
  int32_t outlier_chunks = 0;  // O of this sequence
  int32_t budget_chunks = 0;   // K: gather slots per KV head
  int32_t gather_base = 0;     // O * C: first gather row of the attention buffer
  int32_t recent_base = 0;     // (O + K) * C: first exact (recent) row
  // Tokens held when compressed: the decode step that appends token p is p - decode_origin
  // (the chunks are selected at the steps select_interval divides, PlanSkvRow).
  int32_t decode_origin = 0;
  // Under select_drift: the cosine below which a KV head of this sequence selects again
  // (kv::KvPolicyConfig::DriftForBudget of its budget).
  float select_drift = 0.0f;
  // Under select_sample: chunks a selection draws at random (kv::KvPolicyConfig::SampledChunks
  // of the budget) where the selectable chunks outnumber the budget, else none; 0 without it.
  int32_t sample_chunks = 0;
};

// One decode row's plan for this step (mirrored on the device).
struct SkvRowMeta {
  int32_t seq = 0;
  // Each step graduates first (every layer at once), then appends the new token.
  int32_t held_rows = 0;        // exact rows held before the step (what graduation shifts)
  int32_t graduate_chunk = -1;  // the chunk that leaves the exact window at this step, or -1
  int32_t num_chunks = 0;       // chunks formed after graduation (landmark index range)
  int32_t attn_last = 0;        // attention covers buffer rows [0, attn_last]
  int32_t attn_row = 0;         // attention-buffer row of the new token (after graduation)
  int32_t pre_row = 0;          // row of the new token's pre-RoPE key among the exact rows
  // 1: the step attends the chunks its gather slots hold from the last selecting step (no
  // scoring, select, re-rank, fetch or rebuild for this row; its miss lists are emptied).
  int32_t reuse = 0;
  int32_t position = 0;  // the new token's position (its decode step: position - decode_origin)
};

}  // namespace shadowkv::cuda
