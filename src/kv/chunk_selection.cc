// Landmarks, outlier chunks, landmark scoring (AVX2 where built), top-k and gather slots.
#include "kv/chunk_selection.h"

#include <cblas.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "core/check.h"

namespace shadowkv::kv {
namespace {

// Query rows scored per GEMM, bounding the logits scratch for long multi-token appends.
constexpr int kQueryBlock = 32;

// Landmark scoring reads every landmark of a head at every decode step (S/chunk_size rows), so
// its loops are written for the vector unit: one pass over the landmarks for the whole GQA group
// (a GEMM with 1-8 rows spends its time packing the landmarks) and a polynomial exp.

// e^x for x <= 0 (softmax after subtracting the max): Cody-Waite reduction x = n·ln2 + f, then
// e^f by its Taylor series to degree 6 (|f| <= ln2/2: below 2e-7 relative), times 2^n.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float f = std::fma(n, -0.693145751953125f, x);
  f = std::fma(n, -1.428606820309417e-6f, f);
  float p = 1.0f / 720.0f;
  p = std::fma(p, f, 1.0f / 120.0f);
  p = std::fma(p, f, 1.0f / 24.0f);
  p = std::fma(p, f, 1.0f / 6.0f);
  p = std::fma(p, f, 0.5f);
  p = std::fma(p, f, 1.0f);
  p = std::fma(p, f, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float HorizontalSum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float HorizontalMax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// ExpNonPositive on 8 lanes.
inline __m256 ExpNonPositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606820309417e-6f), f);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// logits[g * num_landmarks + l] = scale · q_g·L_l for the `group` query heads at `queries`
// (head_dim apart), in one pass over the landmarks.
void GroupLogits(const float* queries, int group, const float* landmarks, int64_t num_landmarks,
                 int head_dim, float scale, float* logits) {
  int64_t l = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 8 == 0) {
    // Blocks of 8 landmarks (a few KiB, in L1 across the group): 8 independent FMA chains per
    // query head, then one transpose-and-add turns the 8 accumulators into 8 dot products.
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (; l + 8 <= num_landmarks; l += 8) {
      const float* block = landmarks + l * head_dim;
      for (int g = 0; g < group; ++g) {
        const float* q = queries + g * head_dim;
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int j = 0; j < 8; ++j) {
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(block + j * head_dim + d), qv, acc[j]);
          }
        }
        const __m256 s0123 =
            _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        const __m256 s4567 =
            _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
        const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                          _mm256_permute2f128_ps(s0123, s4567, 0x31));
        _mm256_storeu_ps(logits + g * num_landmarks + l, _mm256_mul_ps(dots, scale8));
      }
    }
  }
#endif
  for (; l < num_landmarks; ++l) {
    const float* landmark = landmarks + l * head_dim;
    for (int g = 0; g < group; ++g) {
      const float* q = queries + g * head_dim;
      float dot = 0.0f;
      for (int d = 0; d < head_dim; ++d) dot += landmark[d] * q[d];
      logits[g * num_landmarks + l] = dot * scale;
    }
  }
}

// In place: row = softmax(row).
void SoftmaxRow(float* row, int64_t length) {
  int64_t i = 0;
  float max_value = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__) && defined(__FMA__)
  __m256 max8 = _mm256_set1_ps(max_value);
  for (; i + 8 <= length; i += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(row + i));
  max_value = HorizontalMax(max8);
#endif
  for (; i < length; ++i) max_value = std::max(max_value, row[i]);

  i = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(max_value);
  __m256 sum8 = _mm256_setzero_ps();
  for (; i + 8 <= length; i += 8) {
    const __m256 e = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift));
    _mm256_storeu_ps(row + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  sum = HorizontalSum(sum8);
#endif
  for (; i < length; ++i) {
    row[i] = ExpNonPositive(row[i] - max_value);
    sum += row[i];
  }
  const float inv = 1.0f / sum;
  for (i = 0; i < length; ++i) row[i] *= inv;
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

namespace {

// Row g of sums [group_size, num_rows]: softmax over the rows of q_g·row/√head_dim, summed over
// the queries (the rows are landmarks, or candidate tokens for the exact scores).
void HeadSoftmaxSums(const float* queries, int num_queries, int64_t query_stride, int group_size,
                     const float* rows, int64_t num_rows, int head_dim, ScoreScratch* scratch,
                     float* sums) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const auto length = static_cast<size_t>(num_rows);
  const int lm_rows = static_cast<int>(num_rows);
  if (num_queries == 1) {
    // One query: its softmax rows are the sums.
    GroupLogits(queries, group_size, rows, num_rows, head_dim, scale, sums);
    for (int g = 0; g < group_size; ++g) SoftmaxRow(sums + g * length, lm_rows);
    return;
  }
  std::fill(sums, sums + group_size * length, 0.0f);
  scratch->logits.resize(std::min(num_queries, kQueryBlock) * length);
  for (int g = 0; g < group_size; ++g) {
    float* sum = sums + g * length;
    for (int begin = 0; begin < num_queries; begin += kQueryBlock) {
      const int count = std::min(kQueryBlock, num_queries - begin);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, count, lm_rows, head_dim, scale,
                  queries + begin * query_stride + g * head_dim, static_cast<int>(query_stride),
                  rows, head_dim, 0.0f, scratch->logits.data(), lm_rows);
      for (int r = 0; r < count; ++r) {
        float* row = scratch->logits.data() + r * length;
        SoftmaxRow(row, lm_rows);
        for (size_t l = 0; l < length; ++l) sum[l] += row[l];
      }
    }
  }
}

}  // namespace

void ScoreLandmarksPerHead(const float* queries, int num_queries, int64_t query_stride,
                           int group_size, const float* landmarks, int64_t num_landmarks,
                           int head_dim, ScoreScratch* scratch, float* head_scores) {
  if (num_landmarks == 0) return;
  HeadSoftmaxSums(queries, num_queries, query_stride, group_size, landmarks, num_landmarks,
                  head_dim, scratch, head_scores);
}

void ScoreLandmarks(const float* queries, int num_queries, int64_t query_stride, int group_size,
                    const float* landmarks, int64_t num_landmarks, int head_dim,
                    ScoreScratch* scratch, float* scores) {
  if (num_landmarks == 0) return;
  const auto length = static_cast<size_t>(num_landmarks);
  scratch->sums.resize(group_size * length);
  HeadSoftmaxSums(queries, num_queries, query_stride, group_size, landmarks, num_landmarks,
                  head_dim, scratch, scratch->sums.data());
  std::copy(scratch->sums.begin(), scratch->sums.begin() + length, scores);
  for (int g = 1; g < group_size; ++g) {
    const float* sum = scratch->sums.data() + g * length;
    for (size_t l = 0; l < length; ++l) scores[l] = std::max(scores[l], sum[l]);
  }
}

void ScoreChunksExact(const float* queries, int num_queries, int64_t query_stride, int group_size,
                      const float* keys, int64_t num_chunks, int chunk_size, int head_dim,
                      ScoreScratch* scratch, float* scores) {
  if (num_chunks == 0) return;
  const int64_t tokens = num_chunks * chunk_size;
  scratch->sums.resize(static_cast<size_t>(group_size) * tokens);
  HeadSoftmaxSums(queries, num_queries, query_stride, group_size, keys, tokens, head_dim, scratch,
                  scratch->sums.data());
  for (int64_t c = 0; c < num_chunks; ++c) {
    float best = 0.0f;
    for (int g = 0; g < group_size; ++g) {
      const float* probabilities = scratch->sums.data() + g * tokens + c * chunk_size;
      float sum = 0.0f;
      for (int t = 0; t < chunk_size; ++t) sum += probabilities[t];
      best = g == 0 ? sum : std::max(best, sum);
    }
    scores[c] = best;
  }
}

void SelectTopK(std::span<const float> scores, int64_t k, std::vector<float>* values,
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
  // The k-th largest score on a plain copy (no index indirection), then one pass in index order:
  // everything above it, and as many scores equal to it as fit, lowest index first.
  values->assign(scores.begin(), scores.end());
  std::nth_element(values->begin(), values->begin() + (k - 1), values->end(),
                   std::greater<float>());
  const float threshold = (*values)[k - 1];
  int64_t ties_allowed = k - std::count_if(values->begin(), values->begin() + (k - 1),
                                           [threshold](float v) { return v > threshold; });
  selected->reserve(k);
  for (int64_t i = 0; i < count; ++i) {
    if (scores[i] > threshold || (scores[i] == threshold && ties_allowed-- > 0)) {
      selected->push_back(static_cast<int32_t>(i));
    }
  }
}

void SelectTopKWithSuccessors(std::span<const float> scores, std::span<const int32_t> chunk_ids,
                              int64_t k, std::vector<float>* shifted, std::vector<float>* values,
                              std::vector<int32_t>* selected) {
  SKV_CHECK(chunk_ids.size() == scores.size());
  shifted->assign(scores.begin(), scores.end());
  for (size_t i = 1; i < scores.size(); ++i) {
    if (chunk_ids[i - 1] == chunk_ids[i] - 1) (*shifted)[i] = std::max(scores[i], scores[i - 1]);
  }
  SelectTopK(*shifted, k, values, selected);
}

namespace {

// The first `count` indices of `scores` (offset `first` in `order`) by decreasing score, ties
// lower index first; order[first, first + scores.size()) holds all indices afterwards.
void RankByScore(std::span<const float> scores, int64_t count, std::vector<int32_t>* order,
                 size_t first) {
  const auto begin = order->begin() + static_cast<std::ptrdiff_t>(first);
  std::iota(begin, begin + static_cast<std::ptrdiff_t>(scores.size()), 0);
  std::partial_sort(
      begin, begin + count, begin + static_cast<std::ptrdiff_t>(scores.size()),
      [&](int32_t a, int32_t b) { return scores[a] != scores[b] ? scores[a] > scores[b] : a < b; });
}

}  // namespace

void SelectRoundRobinOverHeads(std::span<const float> head_scores, int group_size,
                               int64_t num_items, int64_t k, std::vector<int32_t>* order,
                               std::vector<int32_t>* selected) {
  SKV_CHECK(group_size >= 1 && head_scores.size() == static_cast<size_t>(group_size) * num_items);
  k = std::clamp<int64_t>(k, 0, num_items);
  selected->clear();
  if (k == 0) return;
  // A head's cursor only passes chunks already taken, so it never reads past its k-th best:
  // ranking the top k of each head is enough.
  const auto items = static_cast<size_t>(num_items);
  order->resize(group_size * items);
  for (int g = 0; g < group_size; ++g) {
    RankByScore(head_scores.subspan(g * items, items), k, order, g * items);
  }
  std::vector<uint8_t> taken(items, 0);
  std::vector<int64_t> cursor(group_size, 0);
  while (static_cast<int64_t>(selected->size()) < k) {
    for (int g = 0; g < group_size && static_cast<int64_t>(selected->size()) < k; ++g) {
      const int32_t* ranked = order->data() + g * items;
      while (taken[ranked[cursor[g]]]) ++cursor[g];
      const int32_t item = ranked[cursor[g]++];
      taken[item] = 1;
      selected->push_back(item);
    }
  }
  std::sort(selected->begin(), selected->end());
}

MassBounds MassSelectionBounds(int64_t k, int64_t num_items) {
  const int64_t cap = std::min(2 * k, num_items);
  return {std::min(std::max<int64_t>(1, k / 4), cap), cap};
}

void SelectByMass(std::span<const float> scores, double mass, MassBounds bounds,
                  std::vector<int32_t>* order, std::vector<int32_t>* selected) {
  const auto count = static_cast<int64_t>(scores.size());
  const int64_t cap = std::clamp<int64_t>(bounds.cap, 0, count);
  const int64_t floor = std::clamp<int64_t>(bounds.floor, 0, cap);
  selected->clear();
  if (cap == 0) return;
  double total = 0.0;
  for (float s : scores) total += s;
  order->resize(scores.size());
  RankByScore(scores, cap, order, 0);
  int64_t taken = floor;
  if (total > 0.0 && std::isfinite(total)) {
    const double target = mass * total;
    double running = 0.0;
    taken = cap;
    for (int64_t i = 0; i < cap; ++i) {
      running += scores[(*order)[i]];
      if (running >= target) {
        taken = i + 1;
        break;
      }
    }
    taken = std::max(taken, floor);
  }
  selected->assign(order->begin(), order->begin() + taken);
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
