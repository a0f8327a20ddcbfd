// ExactKvStore: append, erase and segment arithmetic for one layer's exact keys and values.
#include "kv/exact_store.h"

#include <algorithm>

namespace shadowkv::kv {

void ExactKvStore::Append(const TokenBlock& block) {
  const size_t added = static_cast<size_t>(block.num_tokens) * kv_width_;
  keys_.insert(keys_.end(), block.keys, block.keys + added);
  values_.insert(values_.end(), block.values, block.values + added);
  num_rows_ += block.num_tokens;
}

void ExactKvStore::EraseRows(int64_t begin, int64_t end, int64_t spare_rows) {
  begin = std::clamp<int64_t>(begin, 0, num_rows_);
  end = std::clamp<int64_t>(end, begin, num_rows_);
  const int64_t rows_left = num_rows_ - (end - begin);
  auto remake = [&](std::vector<float>& data) {
    std::vector<float> kept;
    kept.reserve(static_cast<size_t>(rows_left + spare_rows) * kv_width_);
    kept.insert(kept.end(), data.begin(), data.begin() + begin * kv_width_);
    kept.insert(kept.end(), data.begin() + end * kv_width_, data.end());
    data.swap(kept);
  };
  remake(keys_);
  remake(values_);
  num_rows_ = rows_left;
}

void ExactKvStore::Reserve(int64_t rows) {
  keys_.reserve(static_cast<size_t>(rows) * kv_width_);
  values_.reserve(static_cast<size_t>(rows) * kv_width_);
}

void ExactKvStore::Clear() {
  std::vector<float>().swap(keys_);
  std::vector<float>().swap(values_);
  num_rows_ = 0;
}

KvSegment ExactKvStore::Segment(int kv_head, int head_dim, int64_t begin, int64_t end,
                                int64_t first_row_position) const {
  KvSegment segment;
  segment.keys = keys_.data() + begin * kv_width_ + kv_head * head_dim;
  segment.values = values_.data() + begin * kv_width_ + kv_head * head_dim;
  segment.num_tokens = static_cast<int32_t>(end - begin);
  segment.row_stride = kv_width_;
  segment.causal = true;
  segment.first_position = first_row_position;
  return segment;
}

int64_t ExactKvStore::bytes() const {
  return 2 * num_rows_ * kv_width_ * static_cast<int64_t>(sizeof(float));
}

Status CheckLayer(const KvGeometry& geometry, int layer) {
  if (layer < 0 || layer >= geometry.num_layers) {
    return Error(ErrorCode::kInternal, "layer {} is not in [0, {})", layer, geometry.num_layers);
  }
  return Status::Ok();
}

Status CheckAppend(const KvGeometry& geometry, int layer, const TokenBlock& block,
                   int64_t held_tokens) {
  if (block.first_position != held_tokens) {
    return Error(ErrorCode::kInternal, "layer {}: append at position {} but it holds {} tokens",
                 layer, block.first_position, held_tokens);
  }
  if (held_tokens + block.num_tokens > geometry.max_context) {
    return Error(ErrorCode::kOutOfRange, "sequence of {} tokens exceeds the context of {}",
                 held_tokens + block.num_tokens, geometry.max_context);
  }
  return Status::Ok();
}

}  // namespace shadowkv::kv
