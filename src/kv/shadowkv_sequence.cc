// A ShadowKV sequence's compression and upkeep: Append (and graduation of the tokens leaving the
// window), FinishPrefill and Compress (basis, landmarks, outliers, the slow tier), memory() and
// Inspect(). The step's selection is in shadowkv_selection.cc.
#include <algorithm>
#include <cstring>

#include "core/fp8.h"
#include "kv/shadowkv_sequence.h"

namespace shadowkv::kv::internal {

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
        float* key_run = scratch_.key_runs.data() + next * chunk_floats + t * g.head_dim;
        std::memcpy(key_run, keys + t * width, g.head_dim * kFloat);
        if (settings_.config.fp8_keys != 0) {  // FP8 codes hold the key less its landmark
          for (int i = 0; i < g.head_dim; ++i) key_run[i] -= landmark[i];
        }
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


}  // namespace shadowkv::kv::internal
