// ShadowKV policy: compression at FinishPrefill, graduation on Append, selection in Prepare.
#include "kv/shadowkv_policy.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/fp8.h"
#include "kv/chunk_selection.h"
#include "kv/low_rank.h"
#include "kv/policies.h"
#include "kv/rope_table.h"
#include "kv/value_store.h"

namespace shadowkv::kv {
namespace {

constexpr int64_t kFloat = sizeof(float);

// Bytes the fast tier counts for `landmarks` landmark vectors of `head_dim` elements: fp32, or
// with fp8_landmarks one byte an element plus an fp32 scale per landmark (the vectors are held
// as fp32 here, holding exactly the values their FP8 form decodes to).
int64_t LandmarkBytes(const KvPolicyConfig& config, int64_t landmarks, int64_t head_dim) {
  return config.fp8_landmarks != 0 ? landmarks * (head_dim + kFloat)
                                   : landmarks * head_dim * kFloat;
}

ValueFormat ValueFormatOf(const KvPolicyConfig& config) {
  return config.fp8_values != 0 ? ValueFormat::kFp8E4m3 : ValueFormat::kFp32;
}

// The key store's format (exact_keys).
ValueFormat KeyFormatOf(const KvPolicyConfig& config) {
  return config.fp8_keys != 0 ? ValueFormat::kFp8E4m3 : ValueFormat::kFp32;
}

enum class Selection { kLandmarks, kRerank, kHeads, kMass };

Selection SelectionOf(const std::string& name) {
  if (name == "rerank") return Selection::kRerank;
  if (name == "heads") return Selection::kHeads;
  if (name == "mass") return Selection::kMass;
  return Selection::kLandmarks;
}

// Gather slots per KV head for `landmarks` landmarks and a budget of K chunks: what the most a
// step may select ("mass" may take up to its cap, the others K).
int64_t GatherSlotCount(Selection selection, int64_t budget_chunks, int64_t landmarks) {
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
Result<int64_t> BudgetChunks(const Settings& settings, int64_t context_tokens) {
  const int64_t budget = settings.config.BudgetTokens(context_tokens);
  if (budget < settings.chunk_size) {
    return Error(ErrorCode::kInvalidArgument,
                 "ShadowKV budget of {} tokens (context {}) is below one chunk of {} tokens",
                 budget, context_tokens, settings.chunk_size);
  }
  return budget / settings.chunk_size;
}

// Chunks a layer of `num_tokens` exact tokens can form while keeping local_window exact.
int64_t ChunksToForm(const Settings& settings, int64_t num_tokens) {
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
  // by the configured selection; "rerank" also leaves its candidates' keys in scratch_.
  Status SelectChunks(const LayerState& layer, const HeadState& head, int h,
                      const float* queries, int num_queries);
  // "rerank": the candidates' post-RoPE keys into scratch_.candidate_keys, copied from the
  // gather buffer where a slot holds them and rebuilt otherwise (all rebuilt, from the first
  // ScoreRank components, where that is below the layer's rank); with exact_keys the exact keys,
  // from a slot or the key store.
  Status CandidateKeys(const LayerState& layer, const HeadState& head, int h);
  // Rebuilds the post-RoPE keys of chunks scratch_.rebuild_items of head h into
  // scratch_.rebuild_targets (chunk_size * head_dim floats each), from the basis's first `rank`
  // components (at most the layer's rank).
  void RebuildKeys(const LayerState& layer, const HeadState& head, int h, int rank);
  // Components the re-rank scores candidates with at `layer` (rerank_rank, at most its rank).
  int ScoreRank(const LayerState& layer) const {
    const int rerank_rank = settings_.config.rerank_rank;
    return rerank_rank > 0 ? std::min(rerank_rank, layer.basis.rank) : layer.basis.rank;
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
  // exact_keys: run i holds the exact post-RoPE keys of the chunk whose values are run i of store_.
  std::unique_ptr<ValueStore> key_store_;
  RopeTable rope_table_;
  std::vector<LayerState> layers_;
  int64_t budget_chunks_ = 0;             // K, fixed at the first FinishPrefill
  PolicyStats stats_;                     // summed over layers
  std::vector<PolicyStats> layer_stats_;  // [num_layers]
  Scratch scratch_;
};

Status ShadowKvSequenceImpl::Append(int layer_index, const TokenBlock& block) {
  const KvGeometry& g = settings_.geometry;
  if (layer_index < 0 || layer_index >= g.num_layers) {
    return Error(ErrorCode::kInternal, "layer {} of {}", layer_index, g.num_layers);
  }
  LayerState& layer = layers_[layer_index];
  if (block.first_position != layer.num_tokens) {
    return Error(ErrorCode::kInternal, "layer {}: append at position {} but it holds {} tokens",
                 layer_index, block.first_position, layer.num_tokens);
  }
  if (layer.num_tokens + block.num_tokens > g.max_context) {
    return Error(ErrorCode::kOutOfRange, "sequence of {} tokens exceeds the context of {}",
                 layer.num_tokens + block.num_tokens, g.max_context);
  }
  if (block.num_tokens > 0 && (!block.keys_pre_rope || !block.keys || !block.values)) {
    return Error(ErrorCode::kInternal, "ShadowKV needs pre-RoPE keys, keys and values");
  }
  // A prompt too short to chunk at FinishPrefill is compressed once enough tokens precede
  // this block (all of them come before its queries, so chunking them hides nothing).
  const int64_t exact_rows = layer.num_tokens - layer.exact_first;
  if (layer.prefill_done && !layer.compressed && !KeptExact(layer_index) &&
      ChunksToForm(settings_, exact_rows) > 0) {
    SKV_RETURN_IF_ERROR(Compress(layer));
  }
  const size_t added = static_cast<size_t>(block.num_tokens) * g.kv_width();
  layer.exact_keys.insert(layer.exact_keys.end(), block.keys, block.keys + added);
  layer.exact_keys_pre.insert(layer.exact_keys_pre.end(), block.keys_pre_rope,
                              block.keys_pre_rope + added);
  layer.exact_values.insert(layer.exact_values.end(), block.values, block.values + added);
  layer.num_tokens += block.num_tokens;
  if (layer.compressed) SKV_RETURN_IF_ERROR(Graduate(layer, block.first_position));
  return Status::Ok();
}

Status ShadowKvSequenceImpl::FinishPrefill(int layer_index) {
  LayerState& layer = layers_[layer_index];
  if (layer.prefill_done) return Status::Ok();
  if (budget_chunks_ == 0) {
    SKV_ASSIGN_OR_RETURN(budget_chunks_, BudgetChunks(settings_, layer.num_tokens));
  }
  layer.prefill_done = true;
  if (!KeptExact(layer_index) && ChunksToForm(settings_, layer.num_tokens) > 0) {
    SKV_RETURN_IF_ERROR(Compress(layer));
  }
  return Status::Ok();
}

Status ShadowKvSequenceImpl::Compress(LayerState& layer) {
  const KvGeometry& g = settings_.geometry;
  const int width = g.kv_width();
  const int64_t rows = layer.num_tokens - layer.exact_first;
  const int64_t num_chunks = ChunksToForm(settings_, rows);
  const int64_t chunked = num_chunks * settings_.chunk_size;

  // 1. One basis for all KV heads (or one per group of heads) from every token held (chunked
  //    and window alike).
  const std::vector<double> gram = GramMatrix(layer.exact_keys_pre.data(), rows, width, width);
  const int groups = settings_.config.basis_groups;
  SKV_ASSIGN_OR_RETURN(layer.basis,
                       FitBlockDiagonalBasis(gram, width, groups, settings_.rank_rule));
  layer.coefficients.resize(static_cast<size_t>(chunked) * layer.basis.rank);
  ProjectOntoBasis(layer.basis, layer.exact_keys_pre.data(), chunked, width,
                   layer.coefficients.data());

  // 2-4. Landmarks, outliers and the slow tier, per KV head.
  const int64_t outliers = ResolveOutlierChunks(settings_.config.outlier_chunks,
                                                budget_chunks_ * settings_.chunk_size, num_chunks);
  std::vector<float> landmarks(static_cast<size_t>(num_chunks) * g.head_dim);
  std::vector<float> min_cosine(num_chunks);
  const int64_t chunk_floats = static_cast<int64_t>(settings_.chunk_size) * g.head_dim;
  for (int h = 0; h < g.num_kv_heads; ++h) {
    const float* keys = layer.exact_keys.data() + h * g.head_dim;
    ComputeLandmarks(keys, width, num_chunks, settings_.chunk_size, g.head_dim, landmarks.data());
    ChunkMinCosine(keys, width, landmarks.data(), num_chunks, settings_.chunk_size, g.head_dim,
                   min_cosine.data());
    HeadState& head = layer.heads[h];
    head.outlier_chunks = PickOutlierChunks(min_cosine, outliers);
    head.outlier_keys.resize(head.outlier_chunks.size() * chunk_floats);
    head.outlier_values.resize(head.outlier_chunks.size() * chunk_floats);
    for (size_t i = 0; i < head.outlier_chunks.size(); ++i) {
      for (int t = 0; t < settings_.chunk_size; ++t) {
        const int64_t row = static_cast<int64_t>(head.outlier_chunks[i]) * settings_.chunk_size + t;
        const size_t source = row * width + h * g.head_dim;
        const size_t target = (i * settings_.chunk_size + t) * g.head_dim;
        std::memcpy(&head.outlier_keys[target], &layer.exact_keys[source], g.head_dim * kFloat);
        std::memcpy(&head.outlier_values[target], &layer.exact_values[source], g.head_dim * kFloat);
      }
    }
    SKV_RETURN_IF_ERROR(AddChunks(layer, h, num_chunks, head.outlier_chunks));
  }
  rope_table_.Extend(chunked);

  // 5. Only the window stays exact; the prompt's staging memory is given back.
  DropExactRows(layer, chunked);
  for (auto* buffer : {&layer.exact_keys, &layer.exact_keys_pre, &layer.exact_values}) {
    buffer->shrink_to_fit();
  }
  layer.num_chunks = num_chunks;
  layer.compressed = true;
  layer.decode_origin = layer.num_tokens;
  for (HeadState& head : layer.heads) head.selection_step = -1;
  return Status::Ok();
}

Status ShadowKvSequenceImpl::AddChunks(LayerState& layer, int h, int64_t num_chunks,
                                       const std::vector<int32_t>& outliers) {
  const KvGeometry& g = settings_.geometry;
  const int width = g.kv_width();
  const int chunk = settings_.chunk_size;
  const int64_t chunk_floats = static_cast<int64_t>(chunk) * g.head_dim;
  HeadState& head = layer.heads[h];
  const int64_t kept = num_chunks - static_cast<int64_t>(outliers.size());
  const int64_t first_landmark = head.num_landmarks();
  head.landmarks.resize((first_landmark + kept) * g.head_dim);
  scratch_.runs.resize(kept * chunk_floats);
  if (key_store_) scratch_.key_runs.resize(kept * chunk_floats);
  int64_t next = 0;
  size_t outlier = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (outlier < outliers.size() && outliers[outlier] == c) {
      ++outlier;
      continue;
    }
    const float* keys = layer.exact_keys.data() + c * chunk * width + h * g.head_dim;
    float* landmark = head.landmarks.data() + (first_landmark + next) * g.head_dim;
    ComputeLandmarks(keys, width, 1, chunk, g.head_dim, landmark);
    if (settings_.config.fp8_landmarks != 0) RoundTripFp8Run(landmark, g.head_dim);
    const float* values = layer.exact_values.data() + c * chunk * width + h * g.head_dim;
    for (int t = 0; t < chunk; ++t) {
      std::memcpy(scratch_.runs.data() + next * chunk_floats + t * g.head_dim, values + t * width,
                  g.head_dim * kFloat);
      if (key_store_) {
        std::memcpy(scratch_.key_runs.data() + next * chunk_floats + t * g.head_dim,
                    keys + t * width, g.head_dim * kFloat);
      }
    }
    head.landmark_chunks.push_back(static_cast<int32_t>(layer.num_chunks + c));
    ++next;
  }
  SKV_ASSIGN_OR_RETURN(const int64_t first_run, store_->Append(scratch_.runs.data(), kept));
  if (key_store_) {
    SKV_ASSIGN_OR_RETURN(const int64_t first_key_run,
                         key_store_->Append(scratch_.key_runs.data(), kept));
    if (first_key_run != first_run) {
      return Error(ErrorCode::kInternal, "key store at run {}, value store at {}", first_key_run,
                   first_run);
    }
  }
  for (int64_t i = 0; i < kept; ++i) head.value_runs.push_back(first_run + i);

  const int64_t slots = GatherSlotCount(settings_.selection, budget_chunks_, head.num_landmarks());
  head.slots.Resize(static_cast<int32_t>(slots), head.num_landmarks());
  head.gather_keys.resize(slots * chunk_floats);
  head.gather_values.resize(slots * chunk_floats);
  return Status::Ok();
}

Status ShadowKvSequenceImpl::Graduate(LayerState& layer, int64_t block_first_position) {
  const int chunk = settings_.chunk_size;
  const int64_t rows = layer.num_tokens - layer.exact_first;
  // Whole chunks beyond the window, and only tokens before the block just appended: its own
  // queries must still see it causally.
  const int64_t num_chunks =
      std::min(ChunksToForm(settings_, rows), (block_first_position - layer.exact_first) / chunk);
  if (num_chunks <= 0) return Status::Ok();
  const int64_t graduating = num_chunks * chunk;
  const size_t old_size = layer.coefficients.size();
  layer.coefficients.resize(old_size + graduating * layer.basis.rank);
  ProjectOntoBasis(layer.basis, layer.exact_keys_pre.data(), graduating,
                   settings_.geometry.kv_width(), layer.coefficients.data() + old_size);
  static const std::vector<int32_t> kNoOutliers;
  for (int h = 0; h < settings_.geometry.num_kv_heads; ++h) {
    SKV_RETURN_IF_ERROR(AddChunks(layer, h, num_chunks, kNoOutliers));
  }
  layer.num_chunks += num_chunks;
  rope_table_.Extend(layer.num_chunks * chunk);
  DropExactRows(layer, graduating);
  return Status::Ok();
}

void ShadowKvSequenceImpl::DropExactRows(LayerState& layer, int64_t rows) {
  const size_t floats = static_cast<size_t>(rows) * settings_.geometry.kv_width();
  for (auto* buffer : {&layer.exact_keys, &layer.exact_keys_pre, &layer.exact_values}) {
    buffer->erase(buffer->begin(), buffer->begin() + floats);
  }
  layer.exact_first += rows;
}

Status ShadowKvSequenceImpl::Prepare(int layer_index, const float* queries, int num_queries,
                                     AttentionInput* out) {
  const KvGeometry& g = settings_.geometry;
  const int width = g.kv_width();
  const int chunk = settings_.chunk_size;
  LayerState& layer = layers_[layer_index];
  const auto exact_rows = static_cast<int32_t>(layer.num_tokens - layer.exact_first);
  out->Reset(g.num_kv_heads);
  PolicyStats step;
  step.prepare_calls = 1;
  step.context_tokens = layer.num_tokens;
  int64_t attended = 0;  // summed over KV heads
  // A single query selects at its decode step 0, select_interval, 2 * select_interval, ...
  const int interval = settings_.config.select_interval;
  const int64_t decode_step = layer.num_tokens - 1 - layer.decode_origin;
  const bool drift_rule = settings_.config.select_drift > 0.0 && interval > 1 && num_queries == 1;
  const bool periodic = num_queries != 1 || interval <= 1 || decode_step % interval == 0;
  if (drift_rule) rope_table_.Extend(layer.num_tokens);
  for (int h = 0; h < g.num_kv_heads; ++h) {
    HeadState& head = layer.heads[h];
    auto& segments = out->heads[h];
    const bool selects = drift_rule ? SelectsOnDrift(layer, head, h, queries, decode_step)
                                    : periodic;
    if (!drift_rule) head.selection_step = -1;
    if (layer.compressed) {
      if (!head.outlier_chunks.empty()) {
        const auto rows = static_cast<int32_t>(head.outlier_chunks.size() * chunk);
        segments.push_back(
            {head.outlier_keys.data(), head.outlier_values.data(), rows, g.head_dim, false, 0});
        attended += rows;
      }
      if (head.num_landmarks() > 0 && budget_chunks_ > 0) {
        step.head_steps += 1;
        if (selects) {
          step.head_selections += 1;
          SKV_RETURN_IF_ERROR(SelectChunks(layer, head, h, queries, num_queries));
          const int64_t hits = head.slots.Assign(scratch_.selected, &scratch_.misses);
          SKV_RETURN_IF_ERROR(FillMisses(layer, head, h, &step));
          step.chunk_selections += static_cast<int64_t>(scratch_.selected.size());
          step.chunk_hits += hits;
        }
        // One segment per run of occupied slots (the chunks of this or the last selecting step;
        // Assign empties the others): all of them, except where "mass" selects fewer chunks than
        // it has slots.
        const int64_t chunk_floats = static_cast<int64_t>(chunk) * g.head_dim;
        for (int32_t s = 0; s < head.slots.num_slots();) {
          if (head.slots.item_in_slot(s) < 0) {
            ++s;
            continue;
          }
          int32_t end = s;
          while (end < head.slots.num_slots() && head.slots.item_in_slot(end) >= 0) ++end;
          segments.push_back({head.gather_keys.data() + s * chunk_floats,
                              head.gather_values.data() + s * chunk_floats, (end - s) * chunk,
                              g.head_dim, false, 0});
          attended += (end - s) * chunk;
          s = end;
        }
      }
    }
    if (exact_rows > 0) {
      segments.push_back({layer.exact_keys.data() + h * g.head_dim,
                          layer.exact_values.data() + h * g.head_dim, exact_rows, width, true,
                          layer.exact_first});
      attended += exact_rows;
    }
  }
  step.attended_tokens = attended / g.num_kv_heads;
  stats_ += step;
  layer_stats_[layer_index] += step;
  return Status::Ok();
}

bool ShadowKvSequenceImpl::SelectsOnDrift(const LayerState& layer, HeadState& head, int h,
                                          const float* queries, int64_t decode_step) {
  const KvGeometry& g = settings_.geometry;
  const int group = g.group_size(), d = g.head_dim;
  const float* group_queries = queries + static_cast<int64_t>(h) * group * d;
  const int64_t position = layer.num_tokens - 1;
  std::vector<float>& unrotated = scratch_.unrotated;
  unrotated.resize(static_cast<size_t>(group) * d);
  for (int q = 0; q < group; ++q) {
    rope_table_.Unrotate(group_queries + q * d, position, unrotated.data() + q * d);
  }
  bool selects = head.selection_step < 0 ||
                 decode_step - head.selection_step >= settings_.config.select_interval;
  for (int q = 0; q < group && !selects; ++q) {
    const float* a = unrotated.data() + q * d;
    const float* b = head.selection_queries.data() + q * d;
    double dot = 0.0, aa = 0.0, bb = 0.0;
    for (int i = 0; i < d; ++i) {
      dot += static_cast<double>(a[i]) * b[i];
      aa += static_cast<double>(a[i]) * a[i];
      bb += static_cast<double>(b[i]) * b[i];
    }
    const double cosine = aa > 0.0 && bb > 0.0 ? dot / std::sqrt(aa * bb) : 1.0;
    selects = cosine < settings_.config.select_drift;
  }
  if (selects) {
    head.selection_queries = unrotated;
    head.selection_step = decode_step;
  }
  return selects;
}

Status ShadowKvSequenceImpl::SelectChunks(const LayerState& layer, const HeadState& head, int h,
                                          const float* queries, int num_queries) {
  const KvGeometry& g = settings_.geometry;
  const float* group_queries = queries + static_cast<int64_t>(h) * g.group_size() * g.head_dim;
  const int64_t items = head.num_landmarks();
  const int64_t k = std::min(budget_chunks_, items);
  auto& s = scratch_;
  if (settings_.selection == Selection::kHeads) {
    s.head_scores.resize(static_cast<size_t>(g.group_size()) * items);
    ScoreLandmarksPerHead(group_queries, num_queries, g.q_width(), g.group_size(),
                          head.landmarks.data(), items, g.head_dim, &s.score, s.head_scores.data());
    SelectRoundRobinOverHeads(s.head_scores, g.group_size(), items, k, &s.order, &s.selected);
    return Status::Ok();
  }
  s.scores.resize(items);
  ScoreLandmarks(group_queries, num_queries, g.q_width(), g.group_size(), head.landmarks.data(),
                 items, g.head_dim, &s.score, s.scores.data());
  switch (settings_.selection) {
    case Selection::kMass:
      SelectByMass(s.scores, settings_.config.select_mass,
                   MassSelectionBounds(budget_chunks_, items), &s.order, &s.selected);
      return Status::Ok();
    case Selection::kRerank: {
      const int64_t wanted = std::min<int64_t>(
          static_cast<int64_t>(settings_.config.rerank_factor) * budget_chunks_, items);
      SelectTopK(s.scores, wanted, &s.top_values, &s.candidates);
      SKV_RETURN_IF_ERROR(CandidateKeys(layer, head, h));
      const auto count = static_cast<int64_t>(s.candidates.size());
      s.exact_scores.resize(count);
      ScoreChunksExact(group_queries, num_queries, g.q_width(), g.group_size(),
                       s.candidate_keys.data(), count, settings_.chunk_size, g.head_dim, &s.score,
                       s.exact_scores.data());
      SelectTopK(s.exact_scores, k, &s.top_values, &s.positions);
      s.selected.clear();
      for (int32_t position : s.positions) s.selected.push_back(s.candidates[position]);
      return Status::Ok();
    }
    default:
      if (settings_.config.select_successors != 0) {
        SelectTopKWithSuccessors(s.scores, head.landmark_chunks, k, &s.shifted, &s.top_values,
                                 &s.selected);
      } else {
        SelectTopK(s.scores, k, &s.top_values, &s.selected);
      }
  }
  return Status::Ok();
}

Status ShadowKvSequenceImpl::CandidateKeys(const LayerState& layer, const HeadState& head, int h) {
  const int64_t chunk_floats =
      static_cast<int64_t>(settings_.chunk_size) * settings_.geometry.head_dim;
  auto& s = scratch_;
  s.candidate_keys.resize(s.candidates.size() * chunk_floats);
  s.rebuild_items.clear();
  s.rebuild_targets.clear();
  const int rank = ScoreRank(layer);
  // A slot holds the keys the scores read where they use every component, or are the exact keys
  // (exact_keys, which refuses rerank_rank: then rank is the layer's).
  const bool reuse_slots = rank == layer.basis.rank;
  for (size_t i = 0; i < s.candidates.size(); ++i) {
    float* target = s.candidate_keys.data() + i * chunk_floats;
    const int32_t slot = reuse_slots ? head.slots.slot_of_item(s.candidates[i]) : -1;
    if (slot >= 0) {
      std::memcpy(target, head.gather_keys.data() + slot * chunk_floats, chunk_floats * kFloat);
    } else if (key_store_) {
      SKV_RETURN_IF_ERROR(key_store_->Read(head.value_runs[s.candidates[i]], target));
    } else {
      s.rebuild_items.push_back(s.candidates[i]);
      s.rebuild_targets.push_back(target);
    }
  }
  RebuildKeys(layer, head, h, rank);
  return Status::Ok();
}

void ShadowKvSequenceImpl::RebuildKeys(const LayerState& layer, const HeadState& head, int h,
                                       int rank) {
  const auto& items = scratch_.rebuild_items;
  if (items.empty()) return;
  const KvGeometry& g = settings_.geometry;
  const int chunk = settings_.chunk_size;
  const int stride = layer.basis.rank;
  const int64_t chunk_floats = static_cast<int64_t>(chunk) * g.head_dim;
  const auto count = static_cast<int64_t>(items.size());
  // Gather the chunks' A rows (their first `rank` columns) so one GEMM rebuilds all their keys
  // for this head.
  scratch_.miss_coefficients.resize(count * chunk * rank);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t first_row = static_cast<int64_t>(head.landmark_chunks[items[i]]) * chunk;
    const float* rows = layer.coefficients.data() + first_row * stride;
    float* target = scratch_.miss_coefficients.data() + i * chunk * rank;
    if (rank == stride) {  // every column: the chunk's rows are one run
      std::memcpy(target, rows, chunk * rank * kFloat);
      continue;
    }
    for (int t = 0; t < chunk; ++t)
      std::memcpy(target + t * rank, rows + t * stride, rank * kFloat);
  }
  scratch_.rebuilt.resize(count * chunk_floats);
  RebuildColumns(layer.basis, rank, scratch_.miss_coefficients.data(), count * chunk,
                 h * g.head_dim, g.head_dim, scratch_.rebuilt.data(), g.head_dim);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t first_position = static_cast<int64_t>(head.landmark_chunks[items[i]]) * chunk;
    const float* rebuilt = scratch_.rebuilt.data() + i * chunk_floats;
    float* keys = scratch_.rebuild_targets[i];
    for (int t = 0; t < chunk; ++t) {
      rope_table_.Rotate(rebuilt + t * g.head_dim, first_position + t, keys + t * g.head_dim);
    }
  }
}

Status ShadowKvSequenceImpl::FillMisses(const LayerState& layer, HeadState& head, int h,
                                        PolicyStats* stats) {
  auto& s = scratch_;
  if (s.misses.empty()) return Status::Ok();
  const int64_t chunk_floats =
      static_cast<int64_t>(settings_.chunk_size) * settings_.geometry.head_dim;
  const bool from_candidates =
      settings_.selection == Selection::kRerank && ScoreRank(layer) == layer.basis.rank;
  s.rebuild_items.clear();
  s.rebuild_targets.clear();
  for (const auto [slot, item] : s.misses) {
    float* keys = head.gather_keys.data() + slot * chunk_floats;
    if (from_candidates) {
      // Every kept chunk was a candidate, and its keys (rebuilt or exact) are already made.
      const auto at = std::lower_bound(s.candidates.begin(), s.candidates.end(), item);
      std::memcpy(keys, s.candidate_keys.data() + (at - s.candidates.begin()) * chunk_floats,
                  chunk_floats * kFloat);
    } else if (key_store_) {
      SKV_RETURN_IF_ERROR(key_store_->Read(head.value_runs[item], keys));
    } else {
      s.rebuild_items.push_back(item);
      s.rebuild_targets.push_back(keys);
    }
    SKV_RETURN_IF_ERROR(
        store_->Read(head.value_runs[item], head.gather_values.data() + slot * chunk_floats));
  }
  RebuildKeys(layer, head, h, layer.basis.rank);
  const int64_t run_bytes = store_->run_bytes() + (key_store_ ? key_store_->run_bytes() : 0);
  stats->bytes_fetched += static_cast<int64_t>(s.misses.size()) * run_bytes;
  return Status::Ok();
}

MemoryUsage ShadowKvSequenceImpl::memory() const {
  int64_t floats = 0;
  int64_t landmark_bytes = 0;
  for (const LayerState& layer : layers_) {
    floats += static_cast<int64_t>(layer.exact_keys.size() + layer.exact_keys_pre.size() +
                                   layer.exact_values.size() + layer.coefficients.size() +
                                   layer.basis.basis.size());
    for (const HeadState& head : layer.heads) {
      floats += static_cast<int64_t>(head.outlier_keys.size() + head.outlier_values.size() +
                                     head.gather_keys.size() + head.gather_values.size());
      landmark_bytes +=
          LandmarkBytes(settings_.config, head.num_landmarks(), settings_.geometry.head_dim);
    }
  }
  return {floats * kFloat + landmark_bytes + rope_table_.bytes(),
          store_->bytes() + (key_store_ ? key_store_->bytes() : 0)};
}

ShadowKvLayerInfo ShadowKvSequenceImpl::Inspect(int layer_index) const {
  const LayerState& layer = layers_[layer_index];
  ShadowKvLayerInfo info;
  info.compressed = layer.compressed;
  info.rank = layer.basis.rank;
  info.num_chunks = layer.num_chunks;
  info.exact_tokens = layer.num_tokens - layer.exact_first;
  info.exact_first_position = layer.exact_first;
  info.budget_chunks = budget_chunks_;
  info.eigenvalues = layer.basis.eigenvalues;
  info.total_energy = layer.basis.total_energy;
  info.discarded_energy = layer.compressed ? layer.basis.discarded_energy() : 0.0;
  for (const HeadState& head : layer.heads) {
    info.outlier_chunks.push_back(head.outlier_chunks);
    info.landmark_chunks.push_back(head.landmark_chunks);
    auto& gathered = info.gathered_chunks.emplace_back();
    for (int32_t s = 0; s < head.slots.num_slots(); ++s) {
      const int32_t item = head.slots.item_in_slot(s);
      gathered.push_back(item < 0 ? -1 : head.landmark_chunks[item]);
    }
  }
  return info;
}

class ShadowKvPolicy final : public KvPolicy {
 public:
  explicit ShadowKvPolicy(const Settings& settings)
      : KvPolicy(settings.config, settings.geometry), settings_(settings) {}
  std::string_view name() const override { return "shadowkv"; }

  Result<std::unique_ptr<SequenceKv>> NewSequence() const override {
    const int64_t run_floats = static_cast<int64_t>(settings_.chunk_size) * geometry_.head_dim;
    SKV_ASSIGN_OR_RETURN(
        auto store,
        ValueStore::Create(run_floats, config_.value_store_path, ValueFormatOf(config_)));
    std::unique_ptr<ValueStore> key_store;
    if (config_.exact_keys != 0) {
      SKV_ASSIGN_OR_RETURN(key_store, ValueStore::Create(run_floats, config_.value_store_path,
                                                         KeyFormatOf(config_)));
    }
    return std::unique_ptr<SequenceKv>(std::make_unique<ShadowKvSequenceImpl>(
        settings_, std::move(store), std::move(key_store)));
  }

  // The sizes memory() reports right after FinishPrefill of a `num_tokens` prompt. With
  // rank_energy a layer's rank is known only once its keys are: this assumes every layer (and
  // group) at the cap (rank_max, or the basis width), an upper bound of what memory() reports.
  MemoryUsage EstimateMemory(int64_t num_tokens) const override {
    const KvGeometry& g = geometry_;
    const int64_t width = g.kv_width();
    const int64_t chunk = settings_.chunk_size;
    const int64_t num_chunks = ChunksToForm(settings_, num_tokens);
    const int64_t exact = num_tokens - num_chunks * chunk;
    int64_t layer_floats = 3 * exact * width;
    int64_t layer_landmark_bytes = 0;
    int64_t slow_bytes = 0;
    int64_t rope_floats = 0;
    if (num_chunks > 0) {
      auto budget = BudgetChunks(settings_, num_tokens);
      const int64_t budget_chunks = budget.ok() ? *budget : 0;
      const int64_t outliers =
          ResolveOutlierChunks(config_.outlier_chunks, budget_chunks * chunk, num_chunks);
      const int64_t landmarks = num_chunks - outliers;
      const int64_t gathered = GatherSlotCount(settings_.selection, budget_chunks, landmarks);
      layer_floats += num_chunks * chunk * settings_.rank + settings_.rank * width +
                      g.num_kv_heads * 2 * (outliers + gathered) * chunk * g.head_dim;
      layer_landmark_bytes = LandmarkBytes(config_, g.num_kv_heads * landmarks, g.head_dim);
      int64_t run_bytes = ValueStore::RunBytes(chunk * g.head_dim, ValueFormatOf(config_));
      if (config_.exact_keys != 0) {
        run_bytes += ValueStore::RunBytes(chunk * g.head_dim, KeyFormatOf(config_));
      }
      slow_bytes = g.num_kv_heads * landmarks * run_bytes;
      rope_floats = num_chunks * chunk * (g.rope.rotary_dim / 2 * 2);
    }
    return {
        (layer_floats * g.num_layers + rope_floats) * kFloat + layer_landmark_bytes * g.num_layers,
        slow_bytes * g.num_layers};
  }

 private:
  Settings settings_;
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeShadowKvPolicy(const KvPolicyConfig& requested,
                                                     const KvGeometry& geometry) {
  SKV_RETURN_IF_ERROR(requested.Validate());
  // A config made in code (not parsed) with paper=1 gets the same forced settings.
  const KvPolicyConfig config = WithPaperSettings(requested);
  if (geometry.num_layers <= 0 || geometry.head_dim <= 0 || geometry.num_kv_heads <= 0 ||
      geometry.num_query_heads % geometry.num_kv_heads != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "ShadowKV needs a model shape ({} layers, {} query heads over {} KV heads, head "
                 "dim {})",
                 geometry.num_layers, geometry.num_query_heads, geometry.num_kv_heads,
                 geometry.head_dim);
  }
  if (geometry.rope.rotary_dim < 0 || geometry.rope.rotary_dim > geometry.head_dim ||
      geometry.rope.rotary_dim % 2 != 0) {
    return Error(ErrorCode::kInvalidArgument, "rotary dim {} does not fit head dim {}",
                 geometry.rope.rotary_dim, geometry.head_dim);
  }
  if (config.select_successors != 0 && config.selection != "landmarks") {
    return Error(ErrorCode::kInvalidArgument,
                 "ShadowKV: successors=1 works with select=landmarks only, not '{}'",
                 config.selection);
  }
  Settings settings;
  settings.config = config;
  settings.geometry = geometry;
  settings.chunk_size = config.chunk_size;
  settings.local_window = config.local_window;
  settings.selection = SelectionOf(config.selection);
  const int groups = config.basis_groups;
  if (groups < 1 || geometry.num_kv_heads % groups != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "ShadowKV basis groups {} do not divide the model's {} KV heads", groups,
                 geometry.num_kv_heads);
  }
  const int group_width = geometry.kv_width() / groups;
  if (config.rank_energy > 0.0) {
    if (config.rank_max > group_width) {
      return Error(ErrorCode::kInvalidArgument,
                   "ShadowKV: rank cap {} exceeds the basis width {} (num_kv_heads * head_dim / "
                   "basis_groups)",
                   config.rank_max, group_width);
    }
    settings.rank_rule = {0, config.rank_energy, RankFloor(config, geometry.head_dim),
                          config.rank_max};
    settings.rank = (config.rank_max > 0 ? config.rank_max : group_width) * groups;
  } else {
    auto rank = ResolveRank(RankPerGroup(config.rank, groups), config.rank_ratio,
                            RankFloor(config, geometry.head_dim), group_width);
    if (!rank.ok()) {
      return Error(ErrorCode::kInvalidArgument, "ShadowKV: {}", rank.status().message());
    }
    settings.rank_rule.rank = *rank;
    settings.rank = *rank * groups;
  }
  if (config.budget_tokens > 0 && config.budget_tokens < config.chunk_size) {
    return Error(ErrorCode::kInvalidArgument,
                 "ShadowKV budget of {} tokens is below one chunk of {} tokens",
                 config.budget_tokens, config.chunk_size);
  }
  if (!config.value_store_path.empty() && !std::filesystem::is_directory(config.value_store_path)) {
    return Error(ErrorCode::kInvalidArgument, "value store path '{}' is not a directory",
                 config.value_store_path);
  }
  return std::unique_ptr<KvPolicy>(std::make_unique<ShadowKvPolicy>(settings));
}

}  // namespace shadowkv::kv
