// The ShadowKV policy: resolves and checks the settings once (rank rule, budget, selection,
// stores) and makes sequences (shadowkv_sequence.h) that share them.
#include "kv/shadowkv_policy.h"

#include <filesystem>
#include <string>

#include "kv/policies.h"
#include "kv/shadowkv_sequence.h"

namespace shadowkv::kv {
namespace {

using internal::BudgetChunks;
using internal::ChunksToForm;
using internal::GatherSlotCount;
using internal::kFloat;
using internal::LandmarkBytes;
using internal::Selection;
using internal::Settings;
using internal::ShadowKvSequenceImpl;

ValueFormat ValueFormatOf(const KvPolicyConfig& config) {
  return config.fp8_values != 0 ? ValueFormat::kFp8E4m3 : ValueFormat::kFp32;
}

// The key store's format (exact_keys).
ValueFormat KeyFormatOf(const KvPolicyConfig& config) {
  return config.fp8_keys != 0 ? ValueFormat::kFp8E4m3 : ValueFormat::kFp32;
}

Selection SelectionOf(const std::string& name) {
  if (name == "rerank") return Selection::kRerank;
  if (name == "heads") return Selection::kHeads;
  if (name == "mass") return Selection::kMass;
  return Selection::kLandmarks;
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
