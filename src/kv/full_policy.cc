// The full KV policy: every token's exact post-RoPE key and value, attended by every query.
#include <cstring>

#include "kv/policies.h"

namespace shadowkv::kv {
namespace {

class FullSequence final : public SequenceKv {
 public:
  explicit FullSequence(const KvGeometry& geometry)
      : geometry_(geometry),
        keys_(geometry.num_layers),
        values_(geometry.num_layers),
        layer_tokens_(geometry.num_layers, 0) {}

  Status Append(int layer, const TokenBlock& block) override {
    if (block.first_position != layer_tokens_[layer]) {
      return Error(ErrorCode::kInternal, "layer {}: append at position {} but it holds {} tokens",
                   layer, block.first_position, layer_tokens_[layer]);
    }
    if (layer_tokens_[layer] + block.num_tokens > geometry_.max_context) {
      return Error(ErrorCode::kOutOfRange, "sequence of {} tokens exceeds the context of {}",
                   layer_tokens_[layer] + block.num_tokens, geometry_.max_context);
    }
    const size_t width = geometry_.kv_width();
    const size_t added = width * block.num_tokens;
    keys_[layer].insert(keys_[layer].end(), block.keys, block.keys + added);
    values_[layer].insert(values_[layer].end(), block.values, block.values + added);
    layer_tokens_[layer] += block.num_tokens;
    return Status::Ok();
  }

  Status Prepare(int layer, const float* queries, int num_queries, AttentionInput* out) override {
    const int64_t tokens = layer_tokens_[layer];
    const int width = geometry_.kv_width();
    out->Reset(geometry_.num_kv_heads);
    for (int h = 0; h < geometry_.num_kv_heads; ++h) {
      KvSegment segment;
      segment.keys = keys_[layer].data() + h * geometry_.head_dim;
      segment.values = values_[layer].data() + h * geometry_.head_dim;
      segment.num_tokens = static_cast<int32_t>(tokens);
      segment.row_stride = width;
      segment.causal = true;
      segment.first_position = 0;
      out->heads[h].push_back(segment);
    }
    stats_.prepare_calls++;
    stats_.context_tokens += tokens;
    stats_.attended_tokens += tokens;
    return Status::Ok();
  }

  Status FinishPrefill(int) override { return Status::Ok(); }
  int64_t num_tokens() const override { return layer_tokens_.empty() ? 0 : layer_tokens_.back(); }

  MemoryUsage memory() const override {
    MemoryUsage usage;
    for (int l = 0; l < geometry_.num_layers; ++l) {
      usage.fast_bytes +=
          static_cast<int64_t>((keys_[l].size() + values_[l].size()) * sizeof(float));
    }
    return usage;
  }
  const PolicyStats& stats() const override { return stats_; }
  Result<std::unique_ptr<SequenceKv>> Fork() const override {
    return std::unique_ptr<SequenceKv>(std::make_unique<FullSequence>(*this));
  }

 private:
  KvGeometry geometry_;
  std::vector<std::vector<float>> keys_;    // [layer][token * kv_width]
  std::vector<std::vector<float>> values_;  // [layer][token * kv_width]
  std::vector<int64_t> layer_tokens_;
  PolicyStats stats_;
};

class FullPolicy final : public KvPolicy {
 public:
  FullPolicy(KvPolicyConfig config, KvGeometry geometry)
      : KvPolicy(std::move(config), std::move(geometry)) {}
  std::string_view name() const override { return "full"; }
  Result<std::unique_ptr<SequenceKv>> NewSequence() const override {
    return std::unique_ptr<SequenceKv>(std::make_unique<FullSequence>(geometry_));
  }
  MemoryUsage EstimateMemory(int64_t num_tokens) const override {
    return {2 * num_tokens * geometry_.kv_width() * geometry_.num_layers *
                static_cast<int64_t>(sizeof(float)),
            0};
  }
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeFullPolicy(const KvPolicyConfig& config,
                                                 const KvGeometry& geometry) {
  return std::unique_ptr<KvPolicy>(std::make_unique<FullPolicy>(config, geometry));
}

}  // namespace shadowkv::kv
