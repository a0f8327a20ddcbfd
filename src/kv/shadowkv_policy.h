// The ShadowKV KV policy (docs/DESIGN.md): low-rank pre-RoPE keys, offloaded values, top-k chunks.
//
// Per layer a sequence keeps, once compressed at FinishPrefill:
//   fast tier: A [chunked tokens, rank] and B [rank, kv_width] (K_pre ≈ A·B), one landmark per
//              chunk and KV head, the outlier chunks' exact K/V, a gather buffer of K chunks per
//              KV head, and the exact recent window (post-RoPE K, pre-RoPE K, V);
//   slow tier: the values of every non-outlier chunk (ValueStore, RAM or file), and with
//              exact_keys their exact post-RoPE keys (a second ValueStore of the same run ids).
// Each Prepare scores the landmarks with the new queries, selects K chunks per KV head, reuses
// those still in the gather buffer and rebuilds the others (keys from A·B, RoPE'd at their own
// positions; values from the slow tier). Tokens leaving the recent window in whole chunks are
// projected onto the same basis ("graduated"), so generation never drops tokens.
//
// With rank_energy > 0 each layer's basis takes its own rank from its key spectrum at compression
// (RankForEnergy, low_rank.h); A, the rebuild and memory() follow that rank, and EstimateMemory
// assumes the cap. `selection` (chunk_selection.h) replaces the landmark top-K: "rerank" makes
// its candidates' keys in a scratch buffer (copied from a gather slot that holds the chunk,
// rebuilt otherwise), keeps the best K by exact score and copies the misses' keys from that
// scratch, so values are read for the kept K only and nothing is rebuilt twice; "heads" takes
// chunks round-robin over the group's query heads; "mass" takes between max(1, K/4) and 2K chunks
// (the gather buffer has 2K slots) and attends one segment per run of occupied slots.
//
// With exact_keys the gather slots take the missed chunks' keys from the key store instead of
// rebuilding them: the chunks attended have exact keys, and A·B is read by the re-rank's scores
// (and landmark-free selections) alone, so the rank sizes selection only.
//
// FP8 (core/fp8.h), off by default: with fp8_values the slow tier holds each value run (one chunk
// of one KV head) as e4m3 codes with one fp32 scale and gathers it dequantised; the outlier
// chunks and the exact window keep fp32 values; fp8_keys does the same for the key store of
// exact_keys, coding each key less its chunk's landmark (decoding adds the landmark back), so
// the rounding falls on what the keys of a chunk do not share. With fp8_landmarks each landmark
// is rounded through e4m3 (one scale per landmark) as it is made, at compression and at
// graduation, and scoring reads the rounded vectors; outliers are still picked from the exact
// chunk means. memory() and EstimateMemory count the
// FP8 forms: a run chunk * head_dim + 4 bytes, a landmark head_dim + 4.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/kv_policy.h"

namespace shadowkv::kv {

// One layer of a ShadowKV sequence as it stands (for tests and `inspect`).
struct ShadowKvLayerInfo {
  bool compressed = false;  // factorised (FinishPrefill with at least one chunk, or later)
  int rank = 0;
  int64_t num_chunks = 0;            // chunked tokens: [0, num_chunks * chunk_size)
  int64_t exact_tokens = 0;          // rows of the exact buffer (recent window)
  int64_t exact_first_position = 0;  // position of its first row
  int64_t budget_chunks = 0;         // K per KV head (before capping by the landmarks)
  std::vector<double> eigenvalues;   // [rank] top eigenvalues of K_preᵀK_pre, largest first
  double total_energy = 0.0;         // ‖K_pre‖²_F over the prompt
  double discarded_energy = 0.0;     // ‖K_pre − A·B‖²_F over the prompt
  std::vector<std::vector<int32_t>> outlier_chunks;   // [kv_head] chunk indices, increasing
  std::vector<std::vector<int32_t>> landmark_chunks;  // [kv_head] chunk of each landmark
  std::vector<std::vector<int32_t>> gathered_chunks;  // [kv_head][slot] chunk held, -1 if none
};

// A SequenceKv that can also describe its state.
class ShadowKvSequence : public SequenceKv {
 public:
  virtual ShadowKvLayerInfo Inspect(int layer) const = 0;
};

}  // namespace shadowkv::kv
