// The SnapKV KV policy: at the end of prefill, keep per KV head the prefix tokens the last
// prompt queries attend to most (pooled), plus those queries' own window; drop the rest.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kv/exact_store.h"
#include "kv/policies.h"

namespace shadowkv::kv {
namespace {

struct SnapLayer {
  int64_t tokens = 0;  // logical length (dropped tokens included)
  // Tokens not compressed: the whole prompt before FinishPrefill, afterwards the tokens
  // appended since, at positions tail_first_position...
  ExactKvStore tail;
  int64_t tail_first_position = 0;
  // Kept prompt tokens per KV head, in position order; they precede every later query.
  std::vector<std::vector<float>> kept_keys;    // [num_kv_heads][kept_tokens * head_dim]
  std::vector<std::vector<float>> kept_values;  // [num_kv_heads][kept_tokens * head_dim]
  int64_t kept_tokens = 0;
  // The last prompt queries (post-RoPE), kept until FinishPrefill.
  std::vector<float> window_queries;  // [window_rows, num_query_heads * head_dim]
  int64_t window_rows = 0;
  bool finished = false;
};

// Pools scores along positions with a centred window of `kernel` (stride 1, same padding;
// the average counts padding as zeros, as a zero-padded avg-pool does).
std::vector<float> PoolScores(const std::vector<float>& scores, int kernel, bool max_pool) {
  const int64_t length = static_cast<int64_t>(scores.size());
  const int64_t radius = kernel / 2;
  std::vector<float> pooled(length);
  for (int64_t t = 0; t < length; ++t) {
    const int64_t begin = std::max<int64_t>(0, t - radius);
    const int64_t end = std::min<int64_t>(length, t + radius + 1);
    float acc = max_pool ? scores[begin] : 0.0f;
    for (int64_t j = begin; j < end; ++j)
      acc = max_pool ? std::max(acc, scores[j]) : acc + scores[j];
    pooled[t] = max_pool ? acc : acc / kernel;
  }
  return pooled;
}

// Indices of the `count` largest scores (ties to the earlier position), in position order.
std::vector<int64_t> TopPositions(const std::vector<float>& scores, int64_t count) {
  std::vector<int64_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  auto higher = [&](int64_t a, int64_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  count = std::min<int64_t>(count, static_cast<int64_t>(order.size()));
  std::nth_element(order.begin(), order.begin() + count, order.end(), higher);
  order.resize(count);
  std::sort(order.begin(), order.end());
  return order;
}

class SnapKvSequence final : public SequenceKv {
 public:
  SnapKvSequence(const KvPolicyConfig& config, const KvGeometry& geometry)
      : config_(config), geometry_(geometry), layers_(geometry.num_layers) {
    for (auto& layer : layers_) {
      layer.tail = ExactKvStore(geometry.kv_width());
      layer.kept_keys.resize(geometry.num_kv_heads);
      layer.kept_values.resize(geometry.num_kv_heads);
    }
  }

  Status Append(int layer_index, const TokenBlock& block) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    SnapLayer& layer = layers_[layer_index];
    SKV_RETURN_IF_ERROR(CheckAppend(geometry_, layer_index, block, layer.tokens));
    layer.tail.Append(block);
    layer.tokens += block.num_tokens;
    if (!layer.finished) RememberQueries(layer, block);
    return Status::Ok();
  }

  Status Prepare(int layer_index, const float*, int, AttentionInput* out) override {
    const SnapLayer& layer = layers_[layer_index];
    const int head_dim = geometry_.head_dim;
    out->Reset(geometry_.num_kv_heads);
    for (int h = 0; h < geometry_.num_kv_heads; ++h) {
      if (layer.kept_tokens > 0) {
        KvSegment kept;
        kept.keys = layer.kept_keys[h].data();
        kept.values = layer.kept_values[h].data();
        kept.num_tokens = static_cast<int32_t>(layer.kept_tokens);
        kept.row_stride = head_dim;
        kept.causal = false;
        out->heads[h].push_back(kept);
      }
      if (layer.tail.num_rows() > 0) {
        out->heads[h].push_back(
            layer.tail.Segment(h, head_dim, 0, layer.tail.num_rows(), layer.tail_first_position));
      }
    }
    stats_.prepare_calls++;
    stats_.context_tokens += layer.tokens;
    stats_.attended_tokens += layer.kept_tokens + layer.tail.num_rows();
    return Status::Ok();
  }

  Status FinishPrefill(int layer_index) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    SnapLayer& layer = layers_[layer_index];
    if (layer.finished) return Status::Ok();  // SnapKV compresses the first prompt only
    layer.finished = true;
    const int64_t prompt = layer.tokens;
    const int64_t capacity = config_.BudgetTokens(prompt);
    if (prompt > capacity) SKV_RETURN_IF_ERROR(Compress(layer_index, capacity));
    std::vector<float>().swap(layer.window_queries);
    layer.window_rows = 0;
    return Status::Ok();
  }

  int64_t num_tokens() const override { return layers_.back().tokens; }

  MemoryUsage memory() const override {
    MemoryUsage usage;
    for (const auto& layer : layers_) {
      usage.fast_bytes += layer.tail.bytes();
      for (int h = 0; h < geometry_.num_kv_heads; ++h) {
        usage.fast_bytes += static_cast<int64_t>(
            (layer.kept_keys[h].size() + layer.kept_values[h].size()) * sizeof(float));
      }
      usage.fast_bytes += static_cast<int64_t>(layer.window_queries.size() * sizeof(float));
    }
    return usage;
  }
  const PolicyStats& stats() const override { return stats_; }

 private:
  // Keeps the last snap_window query rows of the prompt.
  void RememberQueries(SnapLayer& layer, const TokenBlock& block) {
    if (block.queries == nullptr) {  // the rows kept so far no longer end the prompt
      layer.window_queries.clear();
      layer.window_rows = 0;
      return;
    }
    const int64_t q_width = geometry_.q_width();
    const int64_t window = config_.snap_window;
    const int64_t take = std::min<int64_t>(block.num_tokens, window);
    const float* first = block.queries + (block.num_tokens - take) * q_width;
    layer.window_queries.insert(layer.window_queries.end(), first, first + take * q_width);
    layer.window_rows += take;
    if (layer.window_rows > window) {
      const int64_t extra = layer.window_rows - window;
      layer.window_queries.erase(layer.window_queries.begin(),
                                 layer.window_queries.begin() + extra * q_width);
      layer.window_rows = window;
    }
  }

  // Scores the prefix [0, prompt - window) per KV head by the window's attention and keeps
  // the top (capacity - window) positions of each head plus the window itself.
  Status Compress(int layer_index, int64_t capacity) {
    SnapLayer& layer = layers_[layer_index];
    const int64_t prompt = layer.tokens;
    const int64_t window = config_.snap_window;
    if (layer.window_rows < std::min(window, prompt)) {
      return Error(ErrorCode::kInternal,
                   "layer {}: SnapKV needs the last {} prompt queries but holds {}", layer_index,
                   window, layer.window_rows);
    }
    const int64_t window_tokens = std::min(window, prompt);
    const int64_t prefix = prompt - window_tokens;
    const int64_t keep = std::max<int64_t>(capacity - window_tokens, 0);
    const int head_dim = geometry_.head_dim;
    const int kv_width = geometry_.kv_width();
    const int q_width = geometry_.q_width();
    const int group = geometry_.group_size();
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const float* window_queries =
        layer.window_queries.data() + (layer.window_rows - window_tokens) * q_width;

    std::vector<float> weights(static_cast<size_t>(window_tokens) * prompt);  // [window, prompt]
    for (int h = 0; h < geometry_.num_kv_heads; ++h) {
      std::vector<float> head_scores(prefix, 0.0f);
      for (int g = 0; g < group; ++g) {
        const int query_head = h * group + g;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, window_tokens, prompt, head_dim, scale,
                    window_queries + query_head * head_dim, q_width,
                    layer.tail.keys() + h * head_dim, kv_width, 0.0f, weights.data(), prompt);
        for (int64_t i = 0; i < window_tokens; ++i) {
          // Window query i sits at position prefix + i and sees keys [0, prefix + i].
          float* row = weights.data() + i * prompt;
          const int64_t visible = prefix + i + 1;
          const float row_max = *std::max_element(row, row + visible);
          float sum = 0.0f;
          for (int64_t t = 0; t < visible; ++t) {
            row[t] = std::exp(row[t] - row_max);
            sum += row[t];
          }
          const float inv = 1.0f / (sum * group);
          for (int64_t t = 0; t < prefix; ++t) head_scores[t] += row[t] * inv;
        }
      }
      const auto pooled =
          PoolScores(head_scores, config_.snap_kernel, config_.snap_pooling == "max");
      const auto positions = TopPositions(pooled, keep);
      auto& keys = layer.kept_keys[h];
      auto& values = layer.kept_values[h];
      keys.clear();
      values.clear();
      keys.reserve((positions.size() + window_tokens) * head_dim);
      values.reserve((positions.size() + window_tokens) * head_dim);
      auto keep_row = [&](int64_t t) {
        const float* k = layer.tail.key_row(t) + h * head_dim;
        const float* v = layer.tail.value_row(t) + h * head_dim;
        keys.insert(keys.end(), k, k + head_dim);
        values.insert(values.end(), v, v + head_dim);
      };
      for (int64_t t : positions) keep_row(t);
      for (int64_t t = prefix; t < prompt; ++t) keep_row(t);
      layer.kept_tokens = static_cast<int64_t>(positions.size()) + window_tokens;
    }
    layer.tail.Clear();
    layer.tail_first_position = prompt;
    return Status::Ok();
  }

  KvPolicyConfig config_;
  KvGeometry geometry_;
  std::vector<SnapLayer> layers_;
  PolicyStats stats_;
};

class SnapKvPolicy final : public KvPolicy {
 public:
  SnapKvPolicy(KvPolicyConfig config, KvGeometry geometry)
      : KvPolicy(std::move(config), std::move(geometry)) {}
  std::string_view name() const override { return "snapkv"; }
  Result<std::unique_ptr<SequenceKv>> NewSequence() const override {
    return std::unique_ptr<SequenceKv>(std::make_unique<SnapKvSequence>(config_, geometry_));
  }
  MemoryUsage EstimateMemory(int64_t num_tokens) const override {
    const int64_t capacity = config_.BudgetTokens(num_tokens);
    const int64_t window = std::min<int64_t>(config_.snap_window, num_tokens);
    const int64_t rows =
        num_tokens <= capacity ? num_tokens : std::max<int64_t>(capacity - window, 0) + window;
    return {2 * rows * geometry_.kv_width() * geometry_.num_layers *
                static_cast<int64_t>(sizeof(float)),
            0};
  }
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeSnapKvPolicy(const KvPolicyConfig& config,
                                                   const KvGeometry& geometry) {
  const int64_t smallest_budget =
      config.budget_tokens > 0 ? config.budget_tokens : config.budget_min_tokens;
  if (smallest_budget <= config.snap_window) {
    return Error(ErrorCode::kInvalidArgument,
                 "SnapKV budget of {} tokens leaves no room beside its window of {}",
                 smallest_budget, config.snap_window);
  }
  return std::unique_ptr<KvPolicy>(std::make_unique<SnapKvPolicy>(config, geometry));
}

}  // namespace shadowkv::kv
