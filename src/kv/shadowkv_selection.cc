// A ShadowKV sequence's decode step: Prepare selects each KV head's chunks (landmark scores, the
// re-rank of their candidates by exact scores, per-head or cumulative-mass selections, a share
// drawn at random and weighted (select_sample), select_interval and select_drift reuse) and fills
// the gather slots it misses from the basis or the key store and the value store.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kv/shadowkv_sequence.h"

namespace shadowkv::kv::internal {

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
  const bool drift_rule = settings_.config.ReselectsOnDrift() && num_queries == 1;
  const bool periodic = num_queries != 1 || interval <= 1 || decode_step % interval == 0;
  if (drift_rule) rope_table_.Extend(layer.num_tokens);
  for (int h = 0; h < g.num_kv_heads; ++h) {
    HeadState& head = layer.heads[h];
    auto& segments = out->heads[h];
    const bool selects =
        drift_rule ? SelectsOnDrift(layer, head, h, queries, decode_step) : periodic;
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
          const uint64_t seed = (static_cast<uint64_t>(layer_index) << 48) ^
                                (static_cast<uint64_t>(h) << 40) ^
                                static_cast<uint64_t>(layer.num_tokens);
          SKV_RETURN_IF_ERROR(SelectChunks(layer, head, h, queries, num_queries));
          DrawSample(head, seed);
          const int64_t hits = head.slots.Assign(scratch_.selected, &scratch_.misses);
          SKV_RETURN_IF_ERROR(FillMisses(layer, head, h, &step));
          step.chunk_selections += static_cast<int64_t>(scratch_.selected.size());
          step.chunk_hits += hits;
        }
        // One segment per run of occupied slots (the chunks of this or the last selecting step;
        // Assign empties the others): all of them, except where "mass" selects fewer chunks than
        // it has slots. A run holds ranked chunks only or sampled chunks only, the latter
        // attended with the sample's log weight.
        const int64_t chunk_floats = static_cast<int64_t>(chunk) * g.head_dim;
        auto sampled = [&](int32_t slot) {
          return std::binary_search(head.sampled.begin(), head.sampled.end(),
                                    head.slots.item_in_slot(slot));
        };
        for (int32_t s = 0; s < head.slots.num_slots();) {
          if (head.slots.item_in_slot(s) < 0) {
            ++s;
            continue;
          }
          const bool run_sampled = sampled(s);
          int32_t end = s;
          while (end < head.slots.num_slots() && head.slots.item_in_slot(end) >= 0 &&
                 sampled(end) == run_sampled) {
            ++end;
          }
          segments.push_back({head.gather_keys.data() + s * chunk_floats,
                              head.gather_values.data() + s * chunk_floats, (end - s) * chunk,
                              g.head_dim, false, 0, run_sampled ? head.sample_log_weight : 0.0f});
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
    selects = cosine < settings_.config.DriftForBudget(budget_chunks_ * settings_.chunk_size);
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
  // With select_sample (landmarks or rerank only) the ranking keeps the budget less the chunks
  // DrawSample adds.
  const int64_t k = std::min(budget_chunks_, items) - DrawnChunks(head);
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
          settings_.config.RerankCandidates(budget_chunks_, settings_.chunk_size), items);
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

int64_t ShadowKvSequenceImpl::DrawnChunks(const HeadState& head) const {
  return head.num_landmarks() > budget_chunks_ ? settings_.config.SampledChunks(budget_chunks_)
                                               : 0;
}

void ShadowKvSequenceImpl::DrawSample(HeadState& head, uint64_t seed) {
  auto& s = scratch_;
  head.sampled.clear();
  head.sample_log_weight = 0.0f;
  const int64_t count = DrawnChunks(head);
  if (count == 0) return;
  const int64_t items = head.num_landmarks();
  // The items not ranked among the best (s.selected is increasing).
  s.unranked.clear();
  size_t next = 0;
  for (int32_t item = 0; item < items; ++item) {
    if (next < s.selected.size() && s.selected[next] == item) {
      ++next;
    } else {
      s.unranked.push_back(item);
    }
  }
  // More than `count`: the budget is below the items, and the ranking kept it less `count`.
  const auto pool = static_cast<int64_t>(s.unranked.size());
  // A partial Fisher-Yates shuffle driven by splitmix64: the first `count` entries are a
  // uniform draw without replacement.
  uint64_t state = seed;
  auto next_random = [&state]() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int64_t i = 0; i < count; ++i) {
    const auto j = i + static_cast<int64_t>(next_random() % static_cast<uint64_t>(pool - i));
    std::swap(s.unranked[i], s.unranked[j]);
  }
  head.sampled.assign(s.unranked.begin(), s.unranked.begin() + count);
  std::sort(head.sampled.begin(), head.sampled.end());
  head.sample_log_weight =
      static_cast<float>(std::log(static_cast<double>(pool) / static_cast<double>(count)));
  const size_t ranked = s.selected.size();
  s.selected.insert(s.selected.end(), head.sampled.begin(), head.sampled.end());
  std::inplace_merge(s.selected.begin(), s.selected.begin() + static_cast<int64_t>(ranked),
                     s.selected.end());
}

Status ShadowKvSequenceImpl::CandidateKeys(const LayerState& layer, const HeadState& head, int h) {
  const int64_t chunk_floats =
      static_cast<int64_t>(settings_.chunk_size) * settings_.geometry.head_dim;
  auto& s = scratch_;
  s.candidate_keys.resize(s.candidates.size() * chunk_floats);
  s.rebuild_items.clear();
  s.rebuild_targets.clear();
  const int rank = ScoreRank(layer);
  const bool reuse_slots = ScoresAttendedKeys(layer);
  for (size_t i = 0; i < s.candidates.size(); ++i) {
    float* target = s.candidate_keys.data() + i * chunk_floats;
    const int32_t slot = reuse_slots ? head.slots.slot_of_item(s.candidates[i]) : -1;
    if (slot >= 0) {
      std::memcpy(target, head.gather_keys.data() + slot * chunk_floats, chunk_floats * kFloat);
    } else if (key_store_ && reuse_slots) {  // scored from the stored exact keys
      SKV_RETURN_IF_ERROR(ReadExactKeys(head, s.candidates[i], target));
    } else {
      s.rebuild_items.push_back(s.candidates[i]);
      s.rebuild_targets.push_back(target);
    }
  }
  RebuildKeys(layer, head, h, rank);
  return Status::Ok();
}

Status ShadowKvSequenceImpl::ReadExactKeys(const HeadState& head, int32_t item, float* keys) const {
  SKV_RETURN_IF_ERROR(key_store_->Read(head.value_runs[item], keys));
  if (settings_.config.fp8_keys == 0) return Status::Ok();
  const int head_dim = settings_.geometry.head_dim;
  const float* landmark = head.landmarks.data() + static_cast<int64_t>(item) * head_dim;
  for (int t = 0; t < settings_.chunk_size; ++t) {
    for (int i = 0; i < head_dim; ++i) keys[t * head_dim + i] += landmark[i];
  }
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
      settings_.selection == Selection::kRerank && ScoresAttendedKeys(layer);
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
      SKV_RETURN_IF_ERROR(ReadExactKeys(head, item, keys));
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

}  // namespace shadowkv::kv::internal
