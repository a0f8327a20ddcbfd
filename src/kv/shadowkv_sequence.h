// The state of one ShadowKV sequence and the class that keeps it, shared by the files that
// implement it: shadowkv_sequence.cc (compression at FinishPrefill, graduation on Append, memory
// and Inspect), shadowkv_selection.cc (Prepare: the step's chunk selection and gather) and
// shadowkv_policy.cc (the policy that resolves the settings and makes sequences). Internal to
// src/kv: everything outside reaches a sequence through ShadowKvSequence (shadowkv_policy.h).
// One sequence is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kv/chunk_selection.h"
#include "kv/kv_config.h"
#include "kv/low_rank.h"
#include "kv/rope_table.h"
#include "kv/shadowkv_policy.h"
#include "kv/value_store.h"

namespace shadowkv::kv::internal {

constexpr int64_t kFloat = sizeof(float);

// Bytes the fast tier counts for `landmarks` landmark vectors of `head_dim` elements: fp32, or
// with fp8_landmarks one byte an element plus an fp32 scale per landmark (the vectors are held
// as fp32 here, holding exactly the values their FP8 form decodes to).
inline int64_t LandmarkBytes(const KvPolicyConfig& config, int64_t landmarks, int64_t head_dim) {
  return config.fp8_landmarks != 0 ? landmarks * (head_dim + kFloat)
                                   : landmarks * head_dim * kFloat;
}

enum class Selection { kLandmarks, kRerank, kHeads, kMass };

// Gather slots per KV head for `landmarks` landmarks and a budget of K chunks: what the most a
// step may select ("mass" may take up to its cap, the others K).
inline int64_t GatherSlotCount(Selection selection, int64_t budget_chunks, int64_t landmarks) {
  if (selection == Selection::kMass) return MassSelectionBounds(budget_chunks, landmarks).cap;
  return std::min(budget_chunks, landmarks);
}

// The settings a sequence needs, resolved once by the policy.
struct Settings {
  KvPolicyConfig config;
  KvGeometry geometry;
  int chunk_size = 0;
  int local_window = 0;
  int rank = 0;        // the fixed rank over all groups; with an energy rule, its cap
  RankRule rank_rule;  // per basis group
  Selection selection = Selection::kLandmarks;
};

// K chunks per KV head for a context of `context_tokens`: the budget rounded down to chunks.
inline Result<int64_t> BudgetChunks(const Settings& settings, int64_t context_tokens) {
  const int64_t budget = settings.config.BudgetTokens(context_tokens);
  if (budget < settings.chunk_size) {
    return Error(ErrorCode::kInvalidArgument,
                 "ShadowKV budget of {} tokens (context {}) is below one chunk of {} tokens",
                 budget, context_tokens, settings.chunk_size);
  }
  return budget / settings.chunk_size;
}

// Chunks a layer of `num_tokens` exact tokens can form while keeping local_window exact.
inline int64_t ChunksToForm(const Settings& settings, int64_t num_tokens) {
  const int64_t spare = num_tokens - settings.local_window;
  return spare >= settings.chunk_size ? spare / settings.chunk_size : 0;
}

struct HeadState {
  std::vector<int32_t> landmark_chunks;  // [L] chunk of each landmark
  std::vector<int64_t> value_runs;       // [L] value-store run of each landmark
  std::vector<float> landmarks;          // [L, head_dim] mean post-RoPE key of the chunk
                                         // (rounded through FP8 with fp8_landmarks)
  std::vector<int32_t> outlier_chunks;   // [O]
  std::vector<float> outlier_keys;       // [O * chunk_size, head_dim] exact post-RoPE
  std::vector<float> outlier_values;     // [O * chunk_size, head_dim]
  GatherSlots slots;                     // landmark index held by each gather slot
  std::vector<float> gather_keys;        // [slots * chunk_size, head_dim] rebuilt post-RoPE
  std::vector<float> gather_values;      // [slots * chunk_size, head_dim]
  // select_drift: the group's queries of the last single-query selection, rotated back to
  // position 0 ([group_size, head_dim]), and its decode step (-1: none since the compression).
  std::vector<float> selection_queries;
  int64_t selection_step = -1;
  // select_sample: the landmark items of the last selection drawn at random (increasing), and
  // the log weight their rows are attended with.
  std::vector<int32_t> sampled;
  float sample_log_weight = 0.0f;

  int64_t num_landmarks() const { return static_cast<int64_t>(landmark_chunks.size()); }
};

struct LayerState {
  int64_t num_tokens = 0;
  bool prefill_done = false;
  bool compressed = false;
  // Exact rows hold positions [exact_first, num_tokens): the whole prompt before compression,
  // the recent window after.
  int64_t exact_first = 0;
  std::vector<float> exact_keys;      // [rows, kv_width] post-RoPE
  std::vector<float> exact_keys_pre;  // [rows, kv_width] pre-RoPE
  std::vector<float> exact_values;    // [rows, kv_width]
  int64_t num_chunks = 0;
  // Tokens held when the layer was compressed: a single query at position p is decode step
  // p - decode_origin, which selects when select_interval divides it.
  int64_t decode_origin = 0;
  LowRankBasis basis;
  std::vector<float> coefficients;  // A: [num_chunks * chunk_size, rank]
  std::vector<HeadState> heads;     // [num_kv_heads]
};

// Reusable buffers of Prepare and the compression steps (one sequence, one thread at a time).
struct Scratch {
  ScoreScratch score;
  std::vector<float> scores;
  std::vector<float> top_values;
  std::vector<float> shifted;
  std::vector<int32_t> selected;
  std::vector<GatherSlots::Fill> misses;
  std::vector<float> head_scores;        // [group_size, landmarks] (selection "heads")
  std::vector<int32_t> order;            // ranking scratch of the selections
  std::vector<int32_t> candidates;       // "rerank": landmark items, increasing
  std::vector<float> candidate_keys;     // "rerank": [candidates * chunk_size, head_dim]
  std::vector<float> exact_scores;       // "rerank": [candidates]
  std::vector<int32_t> positions;        // "rerank": kept candidates (positions in candidates)
  std::vector<int32_t> rebuild_items;    // chunks whose keys RebuildKeys makes
  std::vector<float*> rebuild_targets;   // where each goes
  std::vector<float> miss_coefficients;  // [rebuilt chunks * chunk_size, rank]
  std::vector<float> rebuilt;            // [rebuilt chunks * chunk_size, head_dim]
  std::vector<float> runs;               // value runs being packed for the store
  std::vector<float> key_runs;           // exact_keys: key runs being packed for the key store
  std::vector<float> unrotated;          // select_drift: [group_size, head_dim]
  std::vector<int32_t> unranked;         // select_sample: the items it draws from
};

class ShadowKvSequenceImpl final : public ShadowKvSequence {
 public:
  // key_store: the exact keys' runs (exact_keys), or null.
  ShadowKvSequenceImpl(const Settings& settings, std::unique_ptr<ValueStore> store,
                       std::unique_ptr<ValueStore> key_store)
      : settings_(settings),
        store_(std::move(store)),
        key_store_(std::move(key_store)),
        rope_table_(settings.geometry.rope, settings.geometry.head_dim),
        layers_(settings.geometry.num_layers),
        layer_stats_(settings.geometry.num_layers) {
    for (auto& layer : layers_) layer.heads.resize(settings.geometry.num_kv_heads);
  }

  Status Append(int layer_index, const TokenBlock& block) override;
  // Layers the settings keep exact (exact_layers): never compressed.
  bool KeptExact(int layer_index) const { return layer_index < settings_.config.exact_layers; }
  Status Prepare(int layer_index, const float* queries, int num_queries,
                 AttentionInput* out) override;
  Status FinishPrefill(int layer_index) override;
  int64_t num_tokens() const override { return layers_.back().num_tokens; }
  MemoryUsage memory() const override;
  const PolicyStats& stats() const override { return stats_; }
  std::vector<PolicyStats> layer_stats() const override { return layer_stats_; }
  ShadowKvLayerInfo Inspect(int layer_index) const override;

 private:
  Status Compress(LayerState& layer);
  Status Graduate(LayerState& layer, int64_t block_first_position);
  // Turns the first num_chunks * chunk_size exact rows of `layer` into chunks of head `h`
  // (landmarks, value runs), skipping the chunks listed in `outliers` (sorted).
  Status AddChunks(LayerState& layer, int h, int64_t num_chunks,
                   const std::vector<int32_t>& outliers);
  void DropExactRows(LayerState& layer, int64_t rows);
  // Chooses head h's chunks for this step into scratch_.selected (landmark items, increasing)
  // by the configured selection; "rerank" also leaves its candidates' keys in scratch_. With
  // select_sample it ranks the budget less DrawnChunks(head), which DrawSample adds.
  Status SelectChunks(const LayerState& layer, const HeadState& head, int h,
                      const float* queries, int num_queries);
  // select_sample: the chunks a selection of `head` draws (none where every chunk fits the
  // budget).
  int64_t DrawnChunks(const HeadState& head) const;
  // Draws DrawnChunks(head) of head's items not in scratch_.selected (uniformly, without
  // replacement, from `seed`) into head.sampled with their log weight, and merges them into
  // scratch_.selected; head.sampled is emptied where nothing is drawn.
  void DrawSample(HeadState& head, uint64_t seed);
  // "rerank": the candidates' post-RoPE keys into scratch_.candidate_keys, copied from the
  // gather buffer where a slot holds them and rebuilt otherwise (all rebuilt, from the first
  // ScoreRank components, where that is below the layer's rank); with exact_keys the exact keys,
  // from a slot or the key store, or with rerank_rank too all rebuilt from the factors.
  Status CandidateKeys(const LayerState& layer, const HeadState& head, int h);
  // Rebuilds the post-RoPE keys of chunks scratch_.rebuild_items of head h into
  // scratch_.rebuild_targets (chunk_size * head_dim floats each), from the basis's first `rank`
  // components (at most the layer's rank).
  void RebuildKeys(const LayerState& layer, const HeadState& head, int h, int rank);
  // Chunk `item`'s exact keys from the key store (exact_keys) into `keys` (chunk_size * head_dim
  // floats); FP8 runs (fp8_keys) hold each key less the chunk's landmark, added back here.
  Status ReadExactKeys(const HeadState& head, int32_t item, float* keys) const;
  // Components the re-rank scores candidates with at `layer` (rerank_rank, at most its rank).
  int ScoreRank(const LayerState& layer) const {
    const int rerank_rank = settings_.config.rerank_rank;
    return rerank_rank > 0 ? std::min(rerank_rank, layer.basis.rank) : layer.basis.rank;
  }
  // Whether the re-rank scores its candidates with the keys the attention reads, so that a
  // slot's keys serve as a candidate's and a kept candidate's keys fill its slot: the stored
  // exact keys (exact_keys without rerank_rank), or, without exact keys, keys rebuilt from every
  // component the layer keeps.
  bool ScoresAttendedKeys(const LayerState& layer) const {
    if (key_store_) return settings_.config.RerankReadsStore();
    return ScoreRank(layer) == layer.basis.rank;
  }
  // Fills the gather slots of scratch_.misses (keys rebuilt, or read from the key store with
  // exact_keys, or with "rerank" copied from its candidates' keys where those are the ones
  // attended: at the full rank or exact; values from the slow tier); counts the bytes read into
  // `stats`.
  Status FillMisses(const LayerState& layer, HeadState& head, int h, PolicyStats* stats);
  // select_drift: whether KV head h of a single query at `decode_step` selects (the interval
  // has run out, or a query head drifted from its last selection's); records the selection.
  bool SelectsOnDrift(const LayerState& layer, HeadState& head, int h, const float* queries,
                      int64_t decode_step);

  Settings settings_;
  std::unique_ptr<ValueStore> store_;
  // exact_keys: run i holds the exact post-RoPE keys of the chunk whose values are run i of store_
  // (with fp8_keys, each key less that chunk's landmark).
  std::unique_ptr<ValueStore> key_store_;
  RopeTable rope_table_;
  std::vector<LayerState> layers_;
  int64_t budget_chunks_ = 0;             // K, fixed at the first FinishPrefill
  PolicyStats stats_;                     // summed over layers
  std::vector<PolicyStats> layer_stats_;  // [num_layers]
  Scratch scratch_;
};

}  // namespace shadowkv::kv::internal
