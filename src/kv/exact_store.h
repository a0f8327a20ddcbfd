// ExactKvStore: one layer's exact post-RoPE keys and values, all KV heads side by side per row.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "kv/kv_policy.h"

namespace shadowkv::kv {

// Rows are tokens in the order appended. The store knows no positions: the policy that owns it
// knows which position each row holds (rows can be erased, e.g. by the streaming policy).
class ExactKvStore {
 public:
  explicit ExactKvStore(int kv_width = 0) : kv_width_(kv_width) {}

  // Appends rows [0, num_tokens) of block's keys/values (each kv_width floats).
  void Append(const TokenBlock& block);
  // Removes rows [begin, end); later rows move down. The allocation is remade to hold what is
  // left plus `spare_rows`, so evicted tokens really free memory and the next `spare_rows`
  // appended rows do not reallocate. Costs one copy of the rows left: callers amortise it.
  void EraseRows(int64_t begin, int64_t end, int64_t spare_rows);
  // Reserves room for `rows` rows (so appends up to that size do not reallocate).
  void Reserve(int64_t rows);
  // Drops every row and frees the memory.
  void Clear();

  int64_t num_rows() const { return num_rows_; }
  int kv_width() const { return kv_width_; }
  const float* keys() const { return keys_.data(); }      // [num_rows, kv_width]
  const float* values() const { return values_.data(); }  // [num_rows, kv_width]
  const float* key_row(int64_t row) const { return keys_.data() + row * kv_width_; }
  const float* value_row(int64_t row) const { return values_.data() + row * kv_width_; }

  // Segment of KV head `kv_head` over rows [begin, end), which must hold consecutive positions
  // from `first_row_position`; causal, which costs nothing for rows that precede every query.
  KvSegment Segment(int kv_head, int head_dim, int64_t begin, int64_t end,
                    int64_t first_row_position) const;

  // Bytes of the rows held (keys and values), as the full policy counts them: allocator slack
  // is left out so that policies compare on what they keep.
  int64_t bytes() const;

 private:
  int kv_width_;
  int64_t num_rows_ = 0;
  std::vector<float> keys_;    // [num_rows, kv_width]
  std::vector<float> values_;  // [num_rows, kv_width]
};

// Checks that `layer` is one of the model's layers.
Status CheckLayer(const KvGeometry& geometry, int layer);
// Checks that `block` continues a layer that holds `held_tokens` tokens and fits the context.
Status CheckAppend(const KvGeometry& geometry, int layer, const TokenBlock& block,
                   int64_t held_tokens);

}  // namespace shadowkv::kv
