// The Quest KV policy: every token stays exact; each decode query reads the pages whose
// key bounds promise the largest scores, plus the page it sits in.
#include <algorithm>
#include <limits>
#include <numeric>

#include "kv/exact_store.h"
#include "kv/policies.h"

namespace shadowkv::kv {
namespace {

struct QuestLayer {
  ExactKvStore store;  // row t holds position t
  // Element-wise bounds of the post-RoPE keys of each page (the last may be partial).
  std::vector<float> page_min;  // [num_pages, kv_width]
  std::vector<float> page_max;  // [num_pages, kv_width]
  int64_t num_pages = 0;
  int64_t budget_pages = 0;  // top pages chosen besides the queries' own, fixed at FinishPrefill
  bool finished = false;
};

class QuestSequence final : public SequenceKv {
 public:
  QuestSequence(const KvPolicyConfig& config, const KvGeometry& geometry)
      : config_(config), geometry_(geometry), layers_(geometry.num_layers) {
    for (auto& layer : layers_) layer.store = ExactKvStore(geometry.kv_width());
  }

  Status Append(int layer_index, const TokenBlock& block) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    QuestLayer& layer = layers_[layer_index];
    SKV_RETURN_IF_ERROR(CheckAppend(geometry_, layer_index, block, layer.store.num_rows()));
    const int width = geometry_.kv_width();
    const int page_size = config_.quest_page_size;
    for (int i = 0; i < block.num_tokens; ++i) {
      const int64_t position = block.first_position + i;
      const float* key = block.keys + static_cast<int64_t>(i) * width;
      if (position % page_size == 0) {
        layer.page_min.insert(layer.page_min.end(), key, key + width);
        layer.page_max.insert(layer.page_max.end(), key, key + width);
        layer.num_pages++;
        continue;
      }
      float* lo = layer.page_min.data() + (layer.num_pages - 1) * width;
      float* hi = layer.page_max.data() + (layer.num_pages - 1) * width;
      for (int c = 0; c < width; ++c) {
        lo[c] = std::min(lo[c], key[c]);
        hi[c] = std::max(hi[c], key[c]);
      }
    }
    layer.store.Append(block);
    return Status::Ok();
  }

  Status Prepare(int layer_index, const float* queries, int num_queries,
                 AttentionInput* out) override {
    const QuestLayer& layer = layers_[layer_index];
    const int64_t tokens = layer.store.num_rows();
    const int page_size = config_.quest_page_size;
    const int head_dim = geometry_.head_dim;
    // Pages holding the queries' own tokens are always read; the top pages come from before.
    const int64_t first_query_page =
        std::clamp<int64_t>((tokens - num_queries) / page_size, 0, layer.num_pages);
    const bool dense = !layer.finished || layer_index < config_.quest_dense_layers ||
                       first_query_page <= layer.budget_pages || queries == nullptr;
    out->Reset(geometry_.num_kv_heads);
    stats_.prepare_calls++;
    stats_.context_tokens += tokens;
    if (dense) {
      for (int h = 0; h < geometry_.num_kv_heads; ++h) {
        if (tokens > 0) out->heads[h].push_back(layer.store.Segment(h, head_dim, 0, tokens, 0));
      }
      stats_.attended_tokens += tokens;
      return Status::Ok();
    }
    std::vector<float> scores;
    std::vector<int64_t> pages;
    int64_t attended = 0;
    for (int h = 0; h < geometry_.num_kv_heads; ++h) {
      ScorePages(layer, h, queries, num_queries, first_query_page, &scores);
      pages.resize(first_query_page);
      std::iota(pages.begin(), pages.end(), 0);
      auto higher = [&](int64_t a, int64_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
      };
      std::nth_element(pages.begin(), pages.begin() + layer.budget_pages, pages.end(), higher);
      pages.resize(layer.budget_pages);
      std::sort(pages.begin(), pages.end());
      for (int64_t p = first_query_page; p < layer.num_pages; ++p) pages.push_back(p);
      // Consecutive pages become one segment.
      for (size_t i = 0; i < pages.size();) {
        size_t j = i + 1;
        while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
        const int64_t begin = pages[i] * page_size;
        const int64_t end = std::min<int64_t>((pages[j - 1] + 1) * page_size, tokens);
        out->heads[h].push_back(layer.store.Segment(h, head_dim, begin, end, begin));
        attended += end - begin;
        i = j;
      }
      stats_.chunk_selections += static_cast<int64_t>(pages.size());
    }
    stats_.attended_tokens += attended / geometry_.num_kv_heads;
    return Status::Ok();
  }

  Status FinishPrefill(int layer_index) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    QuestLayer& layer = layers_[layer_index];
    if (!layer.finished) {
      layer.finished = true;
      layer.budget_pages = config_.BudgetTokens(layer.store.num_rows()) / config_.quest_page_size;
    }
    return Status::Ok();
  }

  int64_t num_tokens() const override { return layers_.back().store.num_rows(); }

  MemoryUsage memory() const override {
    MemoryUsage usage;
    for (const auto& layer : layers_) {
      usage.fast_bytes +=
          layer.store.bytes() +
          static_cast<int64_t>((layer.page_min.size() + layer.page_max.size()) * sizeof(float));
    }
    return usage;
  }
  const PolicyStats& stats() const override { return stats_; }

 private:
  // scores[p] for pages [0, num_pages) of KV head `kv_head`: per query head the upper bound
  // Σ_d max(q_d·max_d, q_d·min_d) summed over the queries; the GQA group combined by max.
  void ScorePages(const QuestLayer& layer, int kv_head, const float* queries, int num_queries,
                  int64_t num_pages, std::vector<float>* scores) const {
    const int head_dim = geometry_.head_dim;
    const int width = geometry_.kv_width();
    const int q_width = geometry_.q_width();
    const int group = geometry_.group_size();
    scores->assign(num_pages, -std::numeric_limits<float>::infinity());
    for (int64_t p = 0; p < num_pages; ++p) {
      const float* lo = layer.page_min.data() + p * width + kv_head * head_dim;
      const float* hi = layer.page_max.data() + p * width + kv_head * head_dim;
      float best = -std::numeric_limits<float>::infinity();
      for (int g = 0; g < group; ++g) {
        float total = 0.0f;
        for (int i = 0; i < num_queries; ++i) {
          const float* q =
              queries + static_cast<int64_t>(i) * q_width + (kv_head * group + g) * head_dim;
          for (int d = 0; d < head_dim; ++d) total += std::max(q[d] * hi[d], q[d] * lo[d]);
        }
        best = std::max(best, total);
      }
      (*scores)[p] = best;
    }
  }

  KvPolicyConfig config_;
  KvGeometry geometry_;
  std::vector<QuestLayer> layers_;
  PolicyStats stats_;
};

class QuestPolicy final : public KvPolicy {
 public:
  QuestPolicy(KvPolicyConfig config, KvGeometry geometry)
      : KvPolicy(std::move(config), std::move(geometry)) {}
  std::string_view name() const override { return "quest"; }
  Result<std::unique_ptr<SequenceKv>> NewSequence() const override {
    return std::unique_ptr<SequenceKv>(std::make_unique<QuestSequence>(config_, geometry_));
  }
  // Every token exact, plus two bound vectors per page.
  MemoryUsage EstimateMemory(int64_t num_tokens) const override {
    const int64_t pages = (num_tokens + config_.quest_page_size - 1) / config_.quest_page_size;
    return {2 * (num_tokens + pages) * geometry_.kv_width() * geometry_.num_layers *
                static_cast<int64_t>(sizeof(float)),
            0};
  }
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeQuestPolicy(const KvPolicyConfig& config,
                                                  const KvGeometry& geometry) {
  return std::unique_ptr<KvPolicy>(std::make_unique<QuestPolicy>(config, geometry));
}

}  // namespace shadowkv::kv
