// CPU attention: per (KV head, block of query rows) scores by GEMM, masked softmax, then P·V.
#include "ops/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace shadowkv {
namespace {

constexpr int kQueryBlock = 64;  // query rows per task in prefill

struct Task {
  int job;
  int kv_head;
  int query_head;  // -1: decode form, rows are the group's query heads of query 0
  int row_begin;
  int row_end;
};

// a · b over d floats, summed in kLanes independent partial sums so the compiler can keep them
// in one SIMD register (a single running sum is a serial chain it may not reorder).
inline float Dot(const float* a, const float* b, int d) {
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  int c = 0;
  for (; c + kLanes <= d; c += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[c + j] * b[c + j];
  }
  float dot = 0.0f;
  for (; c < d; ++c) dot += a[c] * b[c];
  for (int j = 0; j < kLanes; ++j) dot += lanes[j];
  return dot;
}

// scores[r * ld + t] = scale * q_r · k_t for t < columns. Few rows (decode): direct loops that
// stream the keys once; many rows (prefill): BLAS.
void ScoreRows(const float* q, int q_stride, int rows, const KvSegment& s, int64_t columns,
               int d, float scale, float* scores, int64_t ld) {
  if (rows > 8) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, static_cast<int>(columns), d, scale,
                q, q_stride, s.keys, s.row_stride, 0.0f, scores, static_cast<int>(ld));
    return;
  }
  for (int64_t t = 0; t < columns; ++t) {
    const float* k = s.keys + t * s.row_stride;
    for (int r = 0; r < rows; ++r) scores[r * ld + t] = Dot(q + r * q_stride, k, d) * scale;
  }
}

// out_r (+)= Σ_t p[r * ld + t] · v_t for t < columns.
void AccumulateValues(const float* p, int64_t ld, int rows, const KvSegment& s, int64_t columns,
                      int d, bool overwrite, float* out, int out_stride) {
  if (rows > 8) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, static_cast<int>(columns), 1.0f,
                p, static_cast<int>(ld), s.values, s.row_stride, overwrite ? 0.0f : 1.0f, out,
                out_stride);
    return;
  }
  if (overwrite) {
    for (int r = 0; r < rows; ++r) std::fill(out + r * out_stride, out + r * out_stride + d, 0.0f);
  }
  for (int64_t t = 0; t < columns; ++t) {
    const float* v = s.values + t * s.row_stride;
    for (int r = 0; r < rows; ++r) {
      const float weight = p[r * ld + t];
      float* o = out + r * out_stride;
      for (int c = 0; c < d; ++c) o[c] += weight * v[c];
    }
  }
}

// Rows of one task: row r has pointer q + r*q_stride, output o + r*o_stride, and position.
void RunTask(const AttentionShape& shape, const AttentionJob& job, const Task& task,
             std::vector<float>& scores) {
  const int d = shape.head_dim;
  const int q_width = shape.num_query_heads * d;
  const auto& segments = job.input->heads[task.kv_head];
  const int rows = task.row_end - task.row_begin;
  if (rows <= 0) return;

  const float* q;
  float* out;
  int q_stride;
  if (task.query_head < 0) {  // decode: the group's heads of the single query
    const int group = shape.num_query_heads / shape.num_kv_heads;
    q = job.queries + (task.kv_head * group + task.row_begin) * d;
    out = job.out + (task.kv_head * group + task.row_begin) * d;
    q_stride = d;
  } else {
    q = job.queries + static_cast<int64_t>(task.row_begin) * q_width + task.query_head * d;
    out = job.out + static_cast<int64_t>(task.row_begin) * q_width + task.query_head * d;
    q_stride = q_width;
  }
  auto row_position = [&](int r) {
    return task.query_head < 0 ? job.first_position : job.first_position + task.row_begin + r;
  };
  // Columns each segment contributes: a causal segment only up to the last row's position, so
  // a prefill block does not score the keys of later blocks.
  thread_local std::vector<int64_t> used;
  used.clear();
  int64_t total = 0;
  for (const auto& s : segments) {
    used.push_back(s.causal ? std::clamp<int64_t>(row_position(rows - 1) - s.first_position + 1, 0,
                                                  s.num_tokens)
                            : s.num_tokens);
    total += used.back();
  }

  if (total == 0) {
    for (int r = 0; r < rows; ++r) std::fill(out + r * q_stride, out + r * q_stride + d, 0.0f);
    return;
  }
  scores.resize(static_cast<size_t>(rows) * total);
  // S[r, t] = scale * q_r · k_t, segment by segment.
  int64_t column = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    if (used[i] > 0) ScoreRows(q, q_stride, rows, s, used[i], d, shape.scale, scores.data() + column, total);
    if (used[i] > 0 && s.log_weight != 0.0f) {
      for (int r = 0; r < rows; ++r) {
        float* row = scores.data() + static_cast<int64_t>(r) * total + column;
        for (int64_t t = 0; t < used[i]; ++t) row[t] += s.log_weight;
      }
    }
    column += used[i];
  }
  // Causal mask, then row softmax.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    float* row = scores.data() + static_cast<int64_t>(r) * total;
    const int64_t pos = row_position(r);
    column = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      const auto& s = segments[i];
      if (s.causal) {
        const int64_t visible = std::clamp<int64_t>(pos - s.first_position + 1, 0, used[i]);
        std::fill(row + column + visible, row + column + used[i], neg_inf);
        if (shape.window > 0) {
          const int64_t hidden =
              std::clamp<int64_t>(pos - shape.window + 1 - s.first_position, 0, visible);
          std::fill(row + column, row + column + hidden, neg_inf);
        }
      }
      column += used[i];
    }
    float max_score = neg_inf;
    for (int64_t t = 0; t < total; ++t) max_score = std::max(max_score, row[t]);
    if (max_score == neg_inf) {  // nothing visible
      std::fill(row, row + total, 0.0f);
      continue;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < total; ++t) {
      row[t] = std::exp(row[t] - max_score);
      sum += row[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < total; ++t) row[t] *= inv;
  }
  // O = P · V, segment by segment.
  column = 0;
  bool first = true;
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    if (used[i] > 0) {
      AccumulateValues(scores.data() + column, total, rows, s, used[i], d, first, out, q_stride);
      first = false;
    }
    column += used[i];
  }
  if (first) {  // nothing visible at all
    for (int r = 0; r < rows; ++r) std::fill(out + r * q_stride, out + r * q_stride + d, 0.0f);
  }
}

}  // namespace

void RunAttention(const AttentionShape& shape, std::span<const AttentionJob> jobs,
                  ThreadPool& pool) {
  std::vector<Task> tasks;
  const int group = shape.num_query_heads / shape.num_kv_heads;
  for (int j = 0; j < static_cast<int>(jobs.size()); ++j) {
    const AttentionJob& job = jobs[j];
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      if (job.num_queries == 1) {
        tasks.push_back({j, h, -1, 0, group});
        continue;
      }
      for (int g = 0; g < group; ++g) {
        for (int b = 0; b < job.num_queries; b += kQueryBlock) {
          tasks.push_back({j, h, h * group + g, b, std::min(job.num_queries, b + kQueryBlock)});
        }
      }
    }
  }
  pool.ParallelFor(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end, int) {
    thread_local std::vector<float> scores;  // each worker's own scratch
    for (int64_t i = begin; i < end; ++i) RunTask(shape, jobs[tasks[i].job], tasks[i], scores);
  });
}

void ReferenceAttention(const AttentionShape& shape, const AttentionJob& job) {
  const int d = shape.head_dim;
  const int q_width = shape.num_query_heads * d;
  const int group = shape.num_query_heads / shape.num_kv_heads;
  for (int i = 0; i < job.num_queries; ++i) {
    const int64_t pos = job.first_position + i;
    for (int hq = 0; hq < shape.num_query_heads; ++hq) {
      const float* q = job.queries + static_cast<int64_t>(i) * q_width + hq * d;
      std::vector<double> weights;
      std::vector<const float*> values;
      for (const auto& s : job.input->heads[hq / group]) {
        for (int t = 0; t < s.num_tokens; ++t) {
          if (s.causal && s.first_position + t > pos) continue;
          if (s.causal && shape.window > 0 && s.first_position + t <= pos - shape.window) continue;
          const float* k = s.keys + static_cast<int64_t>(t) * s.row_stride;
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
          weights.push_back(dot * shape.scale + s.log_weight);
          values.push_back(s.values + static_cast<int64_t>(t) * s.row_stride);
        }
      }
      float* o = job.out + static_cast<int64_t>(i) * q_width + hq * d;
      std::vector<double> acc(d, 0.0);
      double max_w = -std::numeric_limits<double>::infinity(), sum = 0;
      for (double w : weights) max_w = std::max(max_w, w);
      for (size_t t = 0; t < weights.size(); ++t) {
        const double p = std::exp(weights[t] - max_w);
        sum += p;
        for (int c = 0; c < d; ++c) acc[c] += p * values[t][c];
      }
      for (int c = 0; c < d; ++c) o[c] = weights.empty() ? 0.0f : static_cast<float>(acc[c] / sum);
    }
  }
}

}  // namespace shadowkv
