// The StreamingLLM KV policy: the first sink_tokens tokens plus the most recent (T - sinks).
#include <algorithm>

#include "kv/exact_store.h"
#include "kv/policies.h"

namespace shadowkv::kv {
namespace {

// One layer's rows: [0, num_sinks) hold positions 0.. (the attention sinks); then dead_rows
// evicted rows waiting for compaction; then the recent rows at consecutive positions from
// recent_first_position. Eviction only marks rows dead; they are copied out once dead_rows
// reaches half the recent window, so a decode step costs O(1) amortised and memory stays
// within (T + recent/2) rows.
struct StreamingLayer {
  ExactKvStore store;
  int64_t tokens = 0;  // logical length (evicted tokens included)
  int64_t num_sinks = 0;
  int64_t dead_rows = 0;
  int64_t recent_first_position = 0;
  int64_t recent_capacity = 0;  // T - num_sinks, fixed at FinishPrefill
  bool finished = false;

  int64_t live_rows() const { return store.num_rows() - dead_rows; }
  int64_t recent_begin_row() const { return std::min(num_sinks, store.num_rows()) + dead_rows; }
};

class StreamingSequence final : public SequenceKv {
 public:
  StreamingSequence(const KvPolicyConfig& config, const KvGeometry& geometry)
      : config_(config), geometry_(geometry) {
    layers_.reserve(geometry.num_layers);
    for (int l = 0; l < geometry.num_layers; ++l) {
      StreamingLayer layer;
      layer.store = ExactKvStore(geometry.kv_width());
      layer.num_sinks = config.sink_tokens;
      layer.recent_first_position = config.sink_tokens;
      layers_.push_back(std::move(layer));
    }
  }

  Status Append(int layer_index, const TokenBlock& block) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    StreamingLayer& layer = layers_[layer_index];
    SKV_RETURN_IF_ERROR(CheckAppend(geometry_, layer_index, block, layer.tokens));
    layer.store.Append(block);
    layer.tokens += block.num_tokens;
    // Every query of the block keeps its own window: the first one, at block.first_position,
    // needs the (recent_capacity - 1) tokens before it.
    if (layer.finished) Evict(layer, block.first_position + 1 - layer.recent_capacity);
    return Status::Ok();
  }

  Status Prepare(int layer_index, const float*, int, AttentionInput* out) override {
    const StreamingLayer& layer = layers_[layer_index];
    const int64_t sink_rows = std::min(layer.num_sinks, layer.store.num_rows());
    const int64_t recent_begin = layer.recent_begin_row();
    out->Reset(geometry_.num_kv_heads);
    for (int h = 0; h < geometry_.num_kv_heads; ++h) {
      if (sink_rows > 0) {
        out->heads[h].push_back(layer.store.Segment(h, geometry_.head_dim, 0, sink_rows, 0));
      }
      if (layer.store.num_rows() > recent_begin) {
        out->heads[h].push_back(layer.store.Segment(h, geometry_.head_dim, recent_begin,
                                                    layer.store.num_rows(),
                                                    layer.recent_first_position));
      }
    }
    stats_.prepare_calls++;
    stats_.context_tokens += layer.tokens;
    stats_.attended_tokens += layer.live_rows();
    return Status::Ok();
  }

  Status FinishPrefill(int layer_index) override {
    StreamingLayer& layer = layers_[layer_index];
    if (!layer.finished) {
      const int64_t budget = std::max<int64_t>(config_.BudgetTokens(layer.tokens), 1);
      // Sinks never fill the whole budget: the newest token must always be visible.
      layer.num_sinks = std::min<int64_t>(config_.sink_tokens, budget - 1);
      layer.recent_first_position = layer.num_sinks;
      layer.recent_capacity = budget - layer.num_sinks;
      layer.finished = true;
    }
    // The strict rule: the next query sees the sinks and exactly recent_capacity tokens.
    Evict(layer, layer.tokens - layer.recent_capacity);
    if (layer.dead_rows > 0) Compact(layer);
    return Status::Ok();
  }

  int64_t num_tokens() const override { return layers_.back().tokens; }

  MemoryUsage memory() const override {
    MemoryUsage usage;
    for (const auto& layer : layers_) usage.fast_bytes += layer.store.bytes();
    return usage;
  }
  const PolicyStats& stats() const override { return stats_; }

 private:
  // Drops recent tokens at positions before `keep_from` (sinks stay).
  void Evict(StreamingLayer& layer, int64_t keep_from) {
    const int64_t live_recent = layer.store.num_rows() - layer.recent_begin_row();
    const int64_t drop =
        std::clamp<int64_t>(keep_from - layer.recent_first_position, 0, live_recent);
    layer.dead_rows += drop;
    layer.recent_first_position += drop;
    if (layer.dead_rows >= std::max<int64_t>(1, layer.recent_capacity / 2)) Compact(layer);
  }

  void Compact(StreamingLayer& layer) {
    const int64_t sink_rows = std::min(layer.num_sinks, layer.store.num_rows());
    layer.store.EraseRows(sink_rows, sink_rows + layer.dead_rows,
                          std::max<int64_t>(1, layer.recent_capacity / 2));
    layer.dead_rows = 0;
  }

  KvPolicyConfig config_;
  KvGeometry geometry_;
  std::vector<StreamingLayer> layers_;
  PolicyStats stats_;
};

class StreamingPolicy final : public KvPolicy {
 public:
  StreamingPolicy(KvPolicyConfig config, KvGeometry geometry)
      : KvPolicy(std::move(config), std::move(geometry)) {}
  std::string_view name() const override { return "streaming"; }
  Result<std::unique_ptr<SequenceKv>> NewSequence() const override {
    return std::unique_ptr<SequenceKv>(std::make_unique<StreamingSequence>(config_, geometry_));
  }
  // Steady state after prefill: the budget plus the compaction slack.
  MemoryUsage EstimateMemory(int64_t num_tokens) const override {
    const int64_t budget = std::max<int64_t>(config_.BudgetTokens(num_tokens), 1);
    const int64_t recent = budget - std::min<int64_t>(config_.sink_tokens, budget - 1);
    const int64_t rows =
        num_tokens <= budget ? num_tokens : budget + std::max<int64_t>(1, recent / 2);
    return {2 * rows * geometry_.kv_width() * geometry_.num_layers *
                static_cast<int64_t>(sizeof(float)),
            0};
  }
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeStreamingPolicy(const KvPolicyConfig& config,
                                                      const KvGeometry& geometry) {
  return std::unique_ptr<KvPolicy>(std::make_unique<StreamingPolicy>(config, geometry));
}

}  // namespace shadowkv::kv
