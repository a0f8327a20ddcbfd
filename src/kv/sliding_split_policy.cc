// KV policies on sliding-window models (gemma3): the windowed layers keep exactly the tokens
// their window can still reach, the global layers go to the policy the setting names.
//
// A SplitSequence owns two sequences and routes each model layer to one of them:
//   window part: WindowSequence, the windowed layers' exact post-RoPE keys and values, tokens
//                older than any future query's window dropped (at most 2 * sliding_window - 1
//                rows per layer once prefilled; a prefill chunk adds its own rows);
//   global part: the named policy (full, shadowkv, snapkv, quest, streaming), made for a
//                geometry of the global layers alone, so its layer counts, budgets, per-layer
//                stats and estimates never see the windowed layers.
// Both parts are owned by the SplitSequence and used from its thread only.
#include <algorithm>

#include "kv/exact_store.h"
#include "kv/policies.h"
#include "kv/shadowkv_policy.h"

namespace shadowkv::kv {
namespace {

// One windowed layer: rows [0, dead_rows) are tokens no later query can see, waiting for
// compaction; rows from dead_rows on hold consecutive positions from first_position + dead_rows.
struct WindowLayer {
  ExactKvStore store;
  int64_t tokens = 0;          // logical length (dropped tokens included)
  int64_t first_position = 0;  // position of row 0
  int64_t dead_rows = 0;

  int64_t live_rows() const { return store.num_rows() - dead_rows; }
};

// The windowed layers of a sequence (layer indices local to the window part). A query at
// position p sees p - window + 1 .. p: the attention op masks that from the segment's
// positions; the rows before the oldest position a future query can see are dropped, in
// batches of at least `window` rows so a decode step costs O(1) amortised.
class WindowSequence final : public SequenceKv {
 public:
  WindowSequence(const KvGeometry& geometry, int64_t window)
      : geometry_(geometry), window_(window), layer_stats_(geometry.num_layers) {
    layers_.reserve(geometry.num_layers);
    for (int l = 0; l < geometry.num_layers; ++l) {
      layers_.push_back(WindowLayer{ExactKvStore(geometry.kv_width())});
    }
  }

  Status Append(int layer_index, const TokenBlock& block) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    WindowLayer& layer = layers_[layer_index];
    SKV_RETURN_IF_ERROR(CheckAppend(geometry_, layer_index, block, layer.tokens));
    // The block's first query, at block.first_position, is the one that reaches furthest back.
    Drop(layer, block.first_position + 1 - window_, window_);
    layer.store.Append(block);
    layer.tokens += block.num_tokens;
    return Status::Ok();
  }

  Status Prepare(int layer_index, const float*, int num_queries, AttentionInput* out) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    const WindowLayer& layer = layers_[layer_index];
    out->Reset(geometry_.num_kv_heads);
    if (layer.live_rows() > 0) {
      for (int h = 0; h < geometry_.num_kv_heads; ++h) {
        out->heads[h].push_back(layer.store.Segment(h, geometry_.head_dim, layer.dead_rows,
                                                    layer.store.num_rows(),
                                                    layer.first_position + layer.dead_rows));
      }
    }
    // The attention reads the union of the queries' windows.
    PolicyStats step;
    step.prepare_calls = 1;
    step.context_tokens = layer.tokens;
    step.attended_tokens =
        std::min<int64_t>(layer.live_rows(), window_ + std::max(num_queries, 1) - 1);
    stats_ += step;
    layer_stats_[layer_index] += step;
    return Status::Ok();
  }

  // The next query sits at position `tokens`: everything before its window goes now.
  Status FinishPrefill(int layer_index) override {
    SKV_RETURN_IF_ERROR(CheckLayer(geometry_, layer_index));
    WindowLayer& layer = layers_[layer_index];
    Drop(layer, layer.tokens + 1 - window_, 1);
    return Status::Ok();
  }

  int64_t num_tokens() const override { return layers_.empty() ? 0 : layers_.back().tokens; }
  int64_t layer_tokens(int layer_index) const { return layers_[layer_index].tokens; }
  int64_t live_rows(int layer_index) const { return layers_[layer_index].live_rows(); }
  int64_t live_first_position(int layer_index) const {
    return layers_[layer_index].first_position + layers_[layer_index].dead_rows;
  }

  // Rows held, dropped rows awaiting compaction included (they are still allocated).
  MemoryUsage memory() const override {
    MemoryUsage usage;
    for (const WindowLayer& layer : layers_) usage.fast_bytes += layer.store.bytes();
    return usage;
  }
  const PolicyStats& stats() const override { return stats_; }
  std::vector<PolicyStats> layer_stats() const override { return layer_stats_; }
  Result<std::unique_ptr<SequenceKv>> Fork() const override {
    return std::unique_ptr<SequenceKv>(std::make_unique<WindowSequence>(*this));
  }

 private:
  // Marks the live rows at positions before `keep_from` dead; compacts once `batch` rows are.
  void Drop(WindowLayer& layer, int64_t keep_from, int64_t batch) {
    const int64_t drop = std::clamp<int64_t>(keep_from - (layer.first_position + layer.dead_rows),
                                             0, layer.live_rows());
    layer.dead_rows += drop;
    if (layer.dead_rows > 0 && layer.dead_rows >= batch) {
      layer.store.EraseRows(0, layer.dead_rows, window_);
      layer.first_position += layer.dead_rows;
      layer.dead_rows = 0;
    }
  }

  KvGeometry geometry_;  // of the windowed layers alone
  int64_t window_;
  std::vector<WindowLayer> layers_;  // [windowed layers]
  PolicyStats stats_;
  std::vector<PolicyStats> layer_stats_;  // [windowed layers]
};

// Where a model layer lives: in which part, at which index there.
struct LayerRoute {
  bool windowed = false;
  int index = 0;
};

std::vector<LayerRoute> RoutesOf(const KvGeometry& geometry) {
  std::vector<LayerRoute> routes(geometry.num_layers);
  int windowed = 0, global = 0;
  for (int l = 0; l < geometry.num_layers; ++l) {
    routes[l].windowed = geometry.layer_windowed[l];
    routes[l].index = routes[l].windowed ? windowed++ : global++;
  }
  return routes;
}

KvGeometry PartGeometry(const KvGeometry& geometry, bool windowed) {
  KvGeometry part = geometry;
  part.num_layers = static_cast<int>(
      std::count(geometry.layer_windowed.begin(), geometry.layer_windowed.end(), windowed));
  part.sliding_window = windowed ? geometry.sliding_window : 0;
  part.layer_windowed.clear();
  return part;
}

// Routes every call to the part that holds the layer. Base is SequenceKv, or ShadowKvSequence
// where the global part is one (so `inspect` and eval see its ranks at the model's layers).
template <typename Base>
class SplitSequence : public Base {
 public:
  SplitSequence(std::shared_ptr<const std::vector<LayerRoute>> routes,
                std::unique_ptr<WindowSequence> window, std::unique_ptr<SequenceKv> global)
      : routes_(std::move(routes)), window_(std::move(window)), global_(std::move(global)) {}

  Status Append(int layer, const TokenBlock& block) override {
    SKV_ASSIGN_OR_RETURN(const LayerRoute route, Route(layer));
    return route.windowed ? window_->Append(route.index, block)
                          : global_->Append(route.index, block);
  }
  Status Prepare(int layer, const float* queries, int num_queries, AttentionInput* out) override {
    SKV_ASSIGN_OR_RETURN(const LayerRoute route, Route(layer));
    return route.windowed ? window_->Prepare(route.index, queries, num_queries, out)
                          : global_->Prepare(route.index, queries, num_queries, out);
  }
  Status FinishPrefill(int layer) override {
    SKV_ASSIGN_OR_RETURN(const LayerRoute route, Route(layer));
    return route.windowed ? window_->FinishPrefill(route.index)
                          : global_->FinishPrefill(route.index);
  }

  // As every policy: the count of the model's last layer.
  int64_t num_tokens() const override {
    return routes_->back().windowed ? window_->num_tokens() : global_->num_tokens();
  }
  MemoryUsage memory() const override {
    MemoryUsage usage = window_->memory();
    usage += global_->memory();
    return usage;
  }
  // Both parts' counters summed, refreshed at each call (the reference lives until the next).
  const PolicyStats& stats() const override {
    stats_ = window_->stats();
    stats_ += global_->stats();
    return stats_;
  }
  // [num_layers] at the model's layers where the global part keeps per-layer counters.
  std::vector<PolicyStats> layer_stats() const override {
    const std::vector<PolicyStats> global = global_->layer_stats();
    if (global.empty()) return {};
    const std::vector<PolicyStats> window = window_->layer_stats();
    std::vector<PolicyStats> out;
    for (const LayerRoute& route : *routes_) {
      out.push_back(route.windowed ? window[route.index] : global[route.index]);
    }
    return out;
  }

  Result<std::unique_ptr<SequenceKv>> Fork() const override {
    SKV_ASSIGN_OR_RETURN(std::unique_ptr<SequenceKv> global, global_->Fork());
    SKV_ASSIGN_OR_RETURN(std::unique_ptr<SequenceKv> window, window_->Fork());
    return Make(routes_,
                std::unique_ptr<WindowSequence>(static_cast<WindowSequence*>(window.release())),
                std::move(global));
  }

  // A SplitSequence over the two parts, a ShadowKvSequence where the global part is one.
  static std::unique_ptr<SequenceKv> Make(std::shared_ptr<const std::vector<LayerRoute>> routes,
                                          std::unique_ptr<WindowSequence> window,
                                          std::unique_ptr<SequenceKv> global);

 protected:
  Result<LayerRoute> Route(int layer) const {
    if (layer < 0 || layer >= static_cast<int>(routes_->size())) {
      return Error(ErrorCode::kInternal, "layer {} is not in [0, {})", layer, routes_->size());
    }
    return (*routes_)[layer];
  }

  std::shared_ptr<const std::vector<LayerRoute>> routes_;  // [num_layers], shared by forks
  std::unique_ptr<WindowSequence> window_;
  std::unique_ptr<SequenceKv> global_;
  mutable PolicyStats stats_;
};

// The global layers are ShadowKV's: their states as it describes them; a windowed layer is an
// uncompressed one whose exact rows are its window.
class ShadowKvSplitSequence final : public SplitSequence<ShadowKvSequence> {
 public:
  using SplitSequence<ShadowKvSequence>::SplitSequence;

  ShadowKvLayerInfo Inspect(int layer) const override {
    const Result<LayerRoute> route = Route(layer);
    if (!route.ok()) return {};
    if (!route->windowed) {
      return static_cast<const ShadowKvSequence&>(*global_).Inspect(route->index);
    }
    ShadowKvLayerInfo info;
    info.exact_tokens = window_->live_rows(route->index);
    info.exact_first_position = window_->live_first_position(route->index);
    return info;
  }
};

template <typename Base>
std::unique_ptr<SequenceKv> SplitSequence<Base>::Make(
    std::shared_ptr<const std::vector<LayerRoute>> routes, std::unique_ptr<WindowSequence> window,
    std::unique_ptr<SequenceKv> global) {
  if (dynamic_cast<const ShadowKvSequence*>(global.get())) {
    return std::make_unique<ShadowKvSplitSequence>(std::move(routes), std::move(window),
                                                   std::move(global));
  }
  return std::make_unique<SplitSequence<SequenceKv>>(std::move(routes), std::move(window),
                                                     std::move(global));
}

class SplitPolicy final : public KvPolicy {
 public:
  SplitPolicy(KvPolicyConfig config, KvGeometry geometry, std::unique_ptr<KvPolicy> global)
      : KvPolicy(std::move(config), std::move(geometry)),
        window_geometry_(PartGeometry(geometry_, true)),
        routes_(std::make_shared<const std::vector<LayerRoute>>(RoutesOf(geometry_))),
        global_(std::move(global)) {}

  std::string_view name() const override { return global_->name(); }

  Result<std::unique_ptr<SequenceKv>> NewSequence() const override {
    SKV_ASSIGN_OR_RETURN(std::unique_ptr<SequenceKv> global, global_->NewSequence());
    return SplitSequence<SequenceKv>::Make(
        routes_, std::make_unique<WindowSequence>(window_geometry_, geometry_.sliding_window),
        std::move(global));
  }

  // The window part once prefilled holds sliding_window - 1 rows per windowed layer and grows to
  // 2 * sliding_window - 1 before it compacts; the global part as its policy estimates.
  MemoryUsage EstimateMemory(int64_t num_tokens) const override {
    const int64_t rows = std::min<int64_t>(num_tokens, 2 * geometry_.sliding_window - 1);
    MemoryUsage usage{2 * rows * window_geometry_.kv_width() * window_geometry_.num_layers *
                          static_cast<int64_t>(sizeof(float)),
                      0};
    usage += global_->EstimateMemory(num_tokens);
    return usage;
  }

 private:
  KvGeometry window_geometry_;
  std::shared_ptr<const std::vector<LayerRoute>> routes_;
  std::unique_ptr<KvPolicy> global_;
};

}  // namespace

KvGeometry GlobalLayersGeometry(const KvGeometry& geometry) {
  return PartGeometry(geometry, false);
}

KvPolicyConfig GlobalLayersConfig(const KvPolicyConfig& config, const KvGeometry& geometry) {
  // "The first N layers" of a setting count the model's layers: the global layers among them.
  auto global_before = [&](int64_t layers) {
    int count = 0;
    for (int l = 0; l < geometry.num_layers && l < layers; ++l)
      count += !geometry.layer_windowed[l];
    return count;
  };
  KvPolicyConfig global = config;
  global.exact_layers = global_before(config.exact_layers);
  global.quest_dense_layers = global_before(config.quest_dense_layers);
  return global;
}

Result<std::unique_ptr<KvPolicy>> MakeSlidingSplitPolicy(const KvPolicyConfig& config,
                                                         const KvGeometry& geometry,
                                                         std::unique_ptr<KvPolicy> global) {
  const int global_layers = GlobalLayersGeometry(geometry).num_layers;
  if (global->geometry().num_layers != global_layers) {
    return Error(ErrorCode::kInternal, "the global layers' policy has {} layers, the model {}",
                 global->geometry().num_layers, global_layers);
  }
  return std::unique_ptr<KvPolicy>(
      std::make_unique<SplitPolicy>(config, geometry, std::move(global)));
}

}  // namespace shadowkv::kv
