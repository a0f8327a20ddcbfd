// CudaModel's full KV cache: allocation, slots, copies between slots, and the export of a
// slot's keys and values to host memory. Loading and the step buffers are in cuda_model.cc.
#include <cstdint>
#include <vector>

#include "core/half.h"
#include "gpu/model/cuda_model_impl.h"
#include "ops/cuda/common/cuda_check.h"

namespace shadowkv::cuda {

int64_t CudaModel::KvBytesPerToken() const {
  const ModelConfig& c = impl_->config;
  return 2ll * c.num_layers * c.num_kv_heads * c.head_dim * static_cast<int64_t>(sizeof(Bf16));
}

Status CudaModel::AllocateKvCache(int num_slots, int64_t capacity, bool keep_pre_rope_keys) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  if (num_slots < 1 || capacity < 1) {
    return Error(ErrorCode::kInvalidArgument, "KV cache of {} slots x {} tokens", num_slots,
                 capacity);
  }
  if (capacity > c.context_length) {
    return Error(ErrorCode::kOutOfRange, "KV capacity {} exceeds the model's context of {}",
                 capacity, c.context_length);
  }
  FreeKvCache();
  const int64_t count =
      static_cast<int64_t>(num_slots) * c.num_layers * c.num_kv_heads * capacity * c.head_dim;
  Status status = m.kv_keys.Allocate(count);
  if (status.ok()) status = m.kv_values.Allocate(count);
  if (status.ok() && keep_pre_rope_keys) status = m.kv_keys_pre.Allocate(count);
  if (!status.ok()) {
    FreeKvCache();
    return Error(status.code(), "KV cache of {} slots x {} tokens ({:.2f} GiB): {}", num_slots,
                 capacity, (keep_pre_rope_keys ? 3.0 : 2.0) * count * sizeof(Bf16) / (1 << 30),
                 status.message());
  }
  m.cache.keys = m.kv_keys.get();
  m.cache.values = m.kv_values.get();
  m.cache.num_slots = num_slots;
  m.cache.num_layers = c.num_layers;
  m.cache.num_kv_heads = c.num_kv_heads;
  m.cache.head_dim = c.head_dim;
  m.cache.capacity = capacity;
  m.lengths.assign(num_slots, 0);
  return Status::Ok();
}

void CudaModel::FreeKvCache() {
  Impl& m = *impl_;
  m.DropGraphs();  // they hold the old cache's addresses
  m.kv_keys.Reset();
  m.kv_values.Reset();
  m.kv_keys_pre.Reset();
  m.cache = KvCacheView{};
  m.lengths.clear();
}

int CudaModel::num_slots() const { return impl_->cache.num_slots; }
int64_t CudaModel::slot_capacity() const { return impl_->cache.capacity; }
int64_t CudaModel::slot_length(int slot) const {
  return slot >= 0 && slot < num_slots() ? impl_->lengths[slot] : 0;
}
void CudaModel::ResetSlot(int slot) {
  if (slot >= 0 && slot < num_slots()) impl_->lengths[slot] = 0;
}

Status CudaModel::CopySlot(int from, int to) {
  Impl& m = *impl_;
  if (from < 0 || from >= num_slots() || to < 0 || to >= num_slots()) {
    return Error(ErrorCode::kInvalidArgument, "slot {} or {} is outside [0, {})", from, to,
                 num_slots());
  }
  if (from == to) return Status::Ok();
  const KvCacheView& v = m.cache;
  // Every (layer, KV head) run of the slot: length tokens out of capacity.
  const size_t pitch = static_cast<size_t>(v.capacity) * v.head_dim * sizeof(Bf16);
  const size_t width = static_cast<size_t>(m.lengths[from]) * v.head_dim * sizeof(Bf16);
  const size_t height = static_cast<size_t>(v.num_layers) * v.num_kv_heads;
  if (width > 0) {
    for (Bf16* base : {v.keys, v.values}) {
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(base + v.HeadOffset(to, 0, 0), pitch,
                                                 base + v.HeadOffset(from, 0, 0), pitch, width,
                                                 height, cudaMemcpyDeviceToDevice, m.stream));
    }
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  }
  m.lengths[to] = m.lengths[from];
  return Status::Ok();
}

Result<CudaSlotExport> CudaModel::ExportSlot(int slot, int64_t num_tokens) const {
  const Impl& m = *impl_;
  if (slot < 0 || slot >= num_slots()) {
    return Error(ErrorCode::kInvalidArgument, "slot {} is outside [0, {})", slot, num_slots());
  }
  if (num_tokens < 0 || num_tokens > m.lengths[slot]) {
    return Error(ErrorCode::kOutOfRange, "export of {} tokens from slot {}, which holds {}",
                 num_tokens, slot, m.lengths[slot]);
  }
  const KvCacheView& v = m.cache;
  const int layers = v.num_layers, heads = v.num_kv_heads, dim = v.head_dim;
  const int64_t width = static_cast<int64_t>(heads) * dim;
  const size_t layer_elems = static_cast<size_t>(num_tokens) * width;
  CudaSlotExport out;
  out.num_tokens = num_tokens;
  out.keys.resize(layers);
  out.values.resize(layers);
  if (num_tokens == 0) return out;
  std::vector<uint16_t> staging(layer_elems * layers);  // bf16 bits
  // Head-major runs [layer, head][token, dim] -> token-major rows per layer.
  auto head_major = [&](const Bf16* base, std::vector<std::vector<float>>* to) -> Status {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        staging.data(), static_cast<size_t>(num_tokens) * dim * sizeof(Bf16),
        base + v.HeadOffset(slot, 0, 0), static_cast<size_t>(v.capacity) * dim * sizeof(Bf16),
        static_cast<size_t>(num_tokens) * dim * sizeof(Bf16),
        static_cast<size_t>(layers) * heads, cudaMemcpyDeviceToHost, m.stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
    for (int layer = 0; layer < layers; ++layer) {
      std::vector<float>& rows = (*to)[layer];
      rows.resize(layer_elems);
      for (int h = 0; h < heads; ++h) {
        const uint16_t* run = staging.data() + (static_cast<size_t>(layer) * heads + h) * num_tokens * dim;
        for (int64_t t = 0; t < num_tokens; ++t) {
          for (int d = 0; d < dim; ++d) {
            rows[t * width + h * dim + d] = Bf16ToFp32(run[t * dim + d]);
          }
        }
      }
    }
    return Status::Ok();
  };
  SKV_RETURN_IF_ERROR(head_major(v.keys, &out.keys));
  SKV_RETURN_IF_ERROR(head_major(v.values, &out.values));
  if (m.kv_keys_pre.get() != nullptr) {
    // Pre-RoPE keys are token-major already: [slots, layers, capacity, kv_width].
    const size_t pitch = static_cast<size_t>(v.capacity) * width * sizeof(Bf16);
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        staging.data(), layer_elems * sizeof(Bf16),
        m.kv_keys_pre.get() + static_cast<size_t>(slot) * layers * v.capacity * width, pitch,
        layer_elems * sizeof(Bf16), layers, cudaMemcpyDeviceToHost, m.stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
    out.keys_pre_rope.resize(layers);
    for (int layer = 0; layer < layers; ++layer) {
      const uint16_t* rows = staging.data() + static_cast<size_t>(layer) * layer_elems;
      out.keys_pre_rope[layer].resize(layer_elems);
      for (size_t i = 0; i < layer_elems; ++i) {
        out.keys_pre_rope[layer][i] = Bf16ToFp32(rows[i]);
      }
    }
  }
  return out;
}

}  // namespace shadowkv::cuda
