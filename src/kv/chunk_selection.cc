// Landmarks, outlier chunks, landmark scoring (BLAS + vectorisable exp), top-k and gather slots.
#include "kv/chunk_selection.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/check.h"

namespace shadowkv::kv {
namespace {

// Query rows scored per GEMM, bounding the logits scratch for long multi-token appends.
constexpr int kQueryBlock = 32;

// e^x for x <= 0 (softmax after subtracting the max), ~1 ulp. Written so the compiler vectorises
// the loop around it: tens of thousands of landmarks per head and step make std::exp the cost.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;  // x·log2(e)
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.693147180559945309f;  // |f| <= ln2/2
  // Taylor series of e^f to degree 6: truncation error below 2e-7 relative for |f| <= 0.347.
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// In place: row = softmax(row).
void SoftmaxRow(float* row, int64_t length) {
  float max_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < length; ++i) max_value = std::max(max_value, row[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < length; ++i) {
    row[i] = ExpNonPositive(row[i] - max_value);
    sum += row[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < length; ++i) row[i] *= inv;
}

}  // namespace

void ComputeLandmarks(const float* keys, int64_t row_stride, int64_t num_chunks, int chunk_size,
                      int head_dim, float* landmarks) {
  const float inv = 1.0f / static_cast<float>(chunk_size);
  for (int64_t c = 0; c < num_chunks; ++c) {
    float* landmark = landmarks + c * head_dim;
    std::fill(landmark, landmark + head_dim, 0.0f);
    for (int t = 0; t < chunk_size; ++t) {
      const float* key = keys + (c * chunk_size + t) * row_stride;
      for (int d = 0; d < head_dim; ++d) landmark[d] += key[d];
    }
    for (int d = 0; d < head_dim; ++d) landmark[d] *= inv;
  }
}

void ChunkMinCosine(const float* keys, int64_t row_stride, const float* landmarks,
                    int64_t num_chunks, int chunk_size, int head_dim, float* min_cosine) {
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float* landmark = landmarks + c * head_dim;
    double landmark_norm = 0.0;
    for (int d = 0; d < head_dim; ++d) landmark_norm += double(landmark[d]) * landmark[d];
    double lowest = std::numeric_limits<double>::infinity();
    for (int t = 0; t < chunk_size; ++t) {
      const float* key = keys + (c * chunk_size + t) * row_stride;
      double dot = 0.0, key_norm = 0.0;
      for (int d = 0; d < head_dim; ++d) {
        dot += double(landmark[d]) * key[d];
        key_norm += double(key[d]) * key[d];
      }
      const double denominator = std::sqrt(landmark_norm * key_norm);
      lowest = std::min(lowest, denominator > 0.0 ? dot / denominator : 0.0);
    }
    min_cosine[c] = static_cast<float>(lowest);
  }
}

int64_t ResolveOutlierChunks(int64_t configured, int64_t budget_tokens, int64_t num_chunks) {
  int64_t count = configured;
  if (count < 0) {
    count = std::llround(static_cast<double>(budget_tokens) / 1024.0 * 24.0);
    if (num_chunks > 0) count = std::max<int64_t>(count, 1);
  }
  return std::clamp<int64_t>(count, 0, num_chunks);
}

std::vector<int32_t> PickOutlierChunks(std::span<const float> min_cosine, int64_t count) {
  std::vector<int32_t> order(min_cosine.size());
  std::iota(order.begin(), order.end(), 0);
  count = std::clamp<int64_t>(count, 0, static_cast<int64_t>(order.size()));
  auto lower = [&](int32_t a, int32_t b) {
    return min_cosine[a] != min_cosine[b] ? min_cosine[a] < min_cosine[b] : a < b;
  };
  std::nth_element(order.begin(), order.begin() + count, order.end(), lower);
  order.resize(count);
  std::sort(order.begin(), order.end());
  return order;
}

void ScoreLandmarks(const float* queries, int num_queries, int64_t query_stride, int group_size,
                    const float* landmarks, int64_t num_landmarks, int head_dim,
                    ScoreScratch* scratch, float* scores) {
  if (num_landmarks == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const auto length = static_cast<size_t>(num_landmarks);
  const int lm_rows = static_cast<int>(num_landmarks);
  if (num_queries == 1) {
    // The group's heads sit side by side: one GEMM, and the softmax rows are the sums.
    scratch->sums.resize(group_size * length);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, group_size, lm_rows, head_dim, scale,
                queries, head_dim, landmarks, head_dim, 0.0f, scratch->sums.data(), lm_rows);
    for (int g = 0; g < group_size; ++g) SoftmaxRow(scratch->sums.data() + g * length, lm_rows);
  } else {
    scratch->sums.assign(group_size * length, 0.0f);
    scratch->logits.resize(std::min(num_queries, kQueryBlock) * length);
    for (int g = 0; g < group_size; ++g) {
      float* sum = scratch->sums.data() + g * length;
      for (int begin = 0; begin < num_queries; begin += kQueryBlock) {
        const int rows = std::min(kQueryBlock, num_queries - begin);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, lm_rows, head_dim, scale,
                    queries + begin * query_stride + g * head_dim, static_cast<int>(query_stride),
                    landmarks, head_dim, 0.0f, scratch->logits.data(), lm_rows);
        for (int r = 0; r < rows; ++r) {
          float* row = scratch->logits.data() + r * length;
          SoftmaxRow(row, lm_rows);
          for (size_t l = 0; l < length; ++l) sum[l] += row[l];
        }
      }
    }
  }
  std::copy(scratch->sums.begin(), scratch->sums.begin() + length, scores);
  for (int g = 1; g < group_size; ++g) {
    const float* sum = scratch->sums.data() + g * length;
    for (size_t l = 0; l < length; ++l) scores[l] = std::max(scores[l], sum[l]);
  }
}

void SelectTopK(std::span<const float> scores, int64_t k, std::vector<int32_t>* order,
                std::vector<int32_t>* selected) {
  const auto count = static_cast<int64_t>(scores.size());
  k = std::clamp<int64_t>(k, 0, count);
  selected->clear();
  if (k == 0) return;
  if (k == count) {
    selected->resize(count);
    std::iota(selected->begin(), selected->end(), 0);
    return;
  }
  order->resize(count);
  std::iota(order->begin(), order->end(), 0);
  auto higher = [&](int32_t a, int32_t b) {
    return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
  };
  std::nth_element(order->begin(), order->begin() + k, order->end(), higher);
  selected->assign(order->begin(), order->begin() + k);
  std::sort(selected->begin(), selected->end());
}

void GatherSlots::Resize(int32_t num_slots, int64_t num_items) {
  SKV_CHECK(num_slots >= this->num_slots() && num_items >= static_cast<int64_t>(item_slot_.size()));
  slot_item_.resize(num_slots, -1);
  item_slot_.resize(num_items, -1);
  wanted_.resize(num_items, 0);
}

int64_t GatherSlots::Assign(std::span<const int32_t> selected, std::vector<Fill>* misses) {
  SKV_CHECK(static_cast<int64_t>(selected.size()) <= num_slots());
  misses->clear();
  for (int32_t item : selected) wanted_[item] = 1;
  free_.clear();
  for (int32_t slot = 0; slot < num_slots(); ++slot) {
    const int32_t held = slot_item_[slot];
    if (held >= 0 && wanted_[held]) continue;
    if (held >= 0) item_slot_[held] = -1;
    slot_item_[slot] = -1;
    free_.push_back(slot);
  }
  int64_t hits = 0;
  size_t next_free = 0;
  for (int32_t item : selected) {
    wanted_[item] = 0;
    if (item_slot_[item] >= 0) {
      ++hits;
      continue;
    }
    const int32_t slot = free_[next_free++];
    slot_item_[slot] = item;
    item_slot_[item] = slot;
    misses->push_back({slot, item});
  }
  return hits;
}

}  // namespace shadowkv::kv
