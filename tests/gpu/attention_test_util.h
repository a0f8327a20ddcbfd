// A random bf16 KV cache for the attention tests, on both sides: device buffers for the kernels,
// fp32 copies and AttentionInput segments for the CPU op. Rows past each slot's length hold
// NaN, so a kernel that reads them (even to multiply by zero) fails its comparison.
#pragma once

#include <vector>

#include "core/attention_input.h"
#include "gpu_test_util.h"
#include "ops/cuda/common/kv_cache_view.cuh"

namespace shadowkv::cuda::testing {

class RandomKvCache {
 public:
  RandomKvCache(int num_slots, int num_layers, int num_kv_heads, int head_dim, int64_t capacity,
                const std::vector<int64_t>& slot_lengths, std::mt19937& rng) {
    view_.num_slots = num_slots;
    view_.num_layers = num_layers;
    view_.num_kv_heads = num_kv_heads;
    view_.head_dim = head_dim;
    view_.capacity = capacity;
    const int64_t count = view_.HeadOffset(num_slots, 0, 0);
    keys_ = RandomBf16Values(count, rng);
    values_ = RandomBf16Values(count, rng);
    for (int slot = 0; slot < num_slots; ++slot) {
      for (int layer = 0; layer < num_layers; ++layer) {
        for (int h = 0; h < num_kv_heads; ++h) {
          const int64_t base = view_.HeadOffset(slot, layer, h);
          for (int64_t i = slot_lengths[slot] * head_dim; i < capacity * head_dim; ++i) {
            keys_[base + i] = values_[base + i] = NAN;
          }
        }
      }
    }
    device_keys_ = ToDevice(ToBf16(keys_));
    device_values_ = ToDevice(ToBf16(values_));
    view_.keys = reinterpret_cast<__nv_bfloat16*>(device_keys_.get());
    view_.values = reinterpret_cast<__nv_bfloat16*>(device_values_.get());
  }

  const KvCacheView& view() const { return view_; }

  // The first `num_tokens` tokens of (slot, layer) as one segment per KV head.
  AttentionInput Segments(int slot, int layer, int32_t num_tokens, bool causal) const {
    AttentionInput input;
    input.Reset(view_.num_kv_heads);
    for (int h = 0; h < view_.num_kv_heads; ++h) {
      const int64_t base = view_.HeadOffset(slot, layer, h);
      input.heads[h].push_back(KvSegment{keys_.data() + base, values_.data() + base,
                                             num_tokens, view_.head_dim, causal, 0});
    }
    return input;
  }

 private:
  KvCacheView view_;
  std::vector<float> keys_, values_;  // fp32 copies of the bf16 cache
  DeviceBuffer<uint16_t> device_keys_, device_values_;
};

}  // namespace shadowkv::cuda::testing
