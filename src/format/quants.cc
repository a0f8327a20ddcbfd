// Dequantisation of GGML block formats to fp32, and the Q8_0/Q4_0/Q4_1 quantisers.
#include "format/quants.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>

#include "core/half.h"

// The outputs must equal the reference values bit for bit, so every product and sum is rounded on
// its own: no contraction into fused multiply-adds.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace shadowkv::gguf {
namespace {

template <typename Block>
Block LoadBlock(const uint8_t* src, int64_t index) {
  Block block;
  std::memcpy(&block, src + index * static_cast<int64_t>(sizeof(Block)), sizeof(Block));
  return block;
}

template <typename Block>
void StoreBlock(const Block& block, uint8_t* dst, int64_t index) {
  std::memcpy(dst + index * static_cast<int64_t>(sizeof(Block)), &block, sizeof(Block));
}

// The 4-bit value of element i (0..31) of a Q4_0/Q4_1/Q5_0/Q5_1 block.
inline int Nibble(const uint8_t* qs, int i) { return i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4; }

void DequantizeQ4_0(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ4_0>(src, b);
    const float d = Fp16ToFp32(block.d);
    for (int i = 0; i < kQk; ++i)
      dst[b * kQk + i] = d * static_cast<float>(Nibble(block.qs, i) - 8);
  }
}

void DequantizeQ4_1(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ4_1>(src, b);
    const float d = Fp16ToFp32(block.d);
    const float m = Fp16ToFp32(block.m);
    for (int i = 0; i < kQk; ++i)
      dst[b * kQk + i] = d * static_cast<float>(Nibble(block.qs, i)) + m;
  }
}

inline int FiveBit(const uint8_t* qs, const uint8_t* qh_bytes, int i) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof(qh));
  return Nibble(qs, i) | static_cast<int>(((qh >> i) & 1u) << 4);
}

void DequantizeQ5_0(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ5_0>(src, b);
    const float d = Fp16ToFp32(block.d);
    for (int i = 0; i < kQk; ++i) {
      dst[b * kQk + i] = d * static_cast<float>(FiveBit(block.qs, block.qh, i) - 16);
    }
  }
}

void DequantizeQ5_1(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ5_1>(src, b);
    const float d = Fp16ToFp32(block.d);
    const float m = Fp16ToFp32(block.m);
    for (int i = 0; i < kQk; ++i) {
      dst[b * kQk + i] = d * static_cast<float>(FiveBit(block.qs, block.qh, i)) + m;
    }
  }
}

void DequantizeQ8_0(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ8_0>(src, b);
    const float d = Fp16ToFp32(block.d);
    for (int i = 0; i < kQk; ++i) dst[b * kQk + i] = d * static_cast<float>(block.qs[i]);
  }
}

void DequantizeQ2_K(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ2_K>(src, b);
    const float d = Fp16ToFp32(block.d);
    const float dmin = Fp16ToFp32(block.dmin);
    float* out = dst + b * kQkK;
    for (int e = 0; e < kQkK; ++e) {
      const uint8_t scale = block.scales[e / 16];
      const int shift = 2 * ((e % 128) / 32);
      const int q = (block.qs[32 * (e / 128) + e % 32] >> shift) & 3;
      const float group_scale = d * static_cast<float>(scale & 0x0f);
      const float group_min = dmin * static_cast<float>(scale >> 4);
      out[e] = group_scale * static_cast<float>(q) - group_min;
    }
  }
}

// The 16 signed 6-bit scales of a Q3_K super-block.
void UnpackQ3KScales(const uint8_t* packed, int* scales) {
  for (int i = 0; i < 16; ++i) {
    const int low = (packed[i % 8] >> (4 * (i / 8))) & 0x0f;
    const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 0x03;
    scales[i] = (low | (high << 4)) - 32;
  }
}

void DequantizeQ3_K(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ3_K>(src, b);
    const float d = Fp16ToFp32(block.d);
    int scales[16];
    UnpackQ3KScales(block.scales, scales);
    float* out = dst + b * kQkK;
    for (int e = 0; e < kQkK; ++e) {
      const int low = (block.qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      const bool high_set = (block.hmask[e % 32] >> (e / 32)) & 1;
      const int q = high_set ? low : low - 4;
      out[e] = (d * static_cast<float>(scales[e / 16])) * static_cast<float>(q);
    }
  }
}

void DequantizeQ4_K(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ4_K>(src, b);
    const float d = Fp16ToFp32(block.d);
    const float dmin = Fp16ToFp32(block.dmin);
    for (int group = 0; group < 8; ++group) {
      uint8_t scale, min;
      UnpackKScaleMin(block.scales, group, &scale, &min);
      const float group_scale = d * static_cast<float>(scale);
      const float group_min = dmin * static_cast<float>(min);
      const uint8_t* qs = block.qs + 32 * (group / 2);
      const int shift = 4 * (group % 2);
      float* out = dst + b * kQkK + 32 * group;
      for (int l = 0; l < 32; ++l) {
        out[l] = group_scale * static_cast<float>((qs[l] >> shift) & 0x0f) - group_min;
      }
    }
  }
}

void DequantizeQ5_K(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ5_K>(src, b);
    const float d = Fp16ToFp32(block.d);
    const float dmin = Fp16ToFp32(block.dmin);
    for (int group = 0; group < 8; ++group) {
      uint8_t scale, min;
      UnpackKScaleMin(block.scales, group, &scale, &min);
      const float group_scale = d * static_cast<float>(scale);
      const float group_min = dmin * static_cast<float>(min);
      const uint8_t* qs = block.qs + 32 * (group / 2);
      const int shift = 4 * (group % 2);
      float* out = dst + b * kQkK + 32 * group;
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[l] >> shift) & 0x0f) | (((block.qh[l] >> group) & 1) << 4);
        out[l] = group_scale * static_cast<float>(q) - group_min;
      }
    }
  }
}

void DequantizeQ6_K(const uint8_t* src, float* dst, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto block = LoadBlock<BlockQ6_K>(src, b);
    const float d = Fp16ToFp32(block.d);
    float* out = dst + b * kQkK;
    for (int e = 0; e < kQkK; ++e) {
      const int half = e / 128;
      const int group = (e % 128) / 32;
      const int l = e % 32;
      const uint8_t low_byte = block.ql[64 * half + 32 * (group & 1) + l];
      const int low = group >= 2 ? low_byte >> 4 : low_byte & 0x0f;
      const int high = (block.qh[32 * half + l] >> (2 * group)) & 3;
      const int q = (low | (high << 4)) - 32;
      out[e] = (d * static_cast<float>(block.scales[e / 16])) * static_cast<float>(q);
    }
  }
}

// trunc(value) clamped to a 4-bit code; NaN (from non-finite input) becomes 0.
int TruncateToNibble(float value) {
  if (!(value > 0.0f)) return 0;
  return value >= 15.0f ? 15 : static_cast<int>(value);
}

// round(value), halves away from zero, clamped to the int8 codes Q8_0 uses; NaN becomes 0.
int8_t RoundToInt8(float value) {
  if (!(value == value)) return 0;
  return static_cast<int8_t>(std::round(std::clamp(value, -127.0f, 127.0f)));
}

constexpr GgmlType kDequantizable[] = {
    GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ4_0, GgmlType::kQ4_1,
    GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0, GgmlType::kQ2_K, GgmlType::kQ3_K,
    GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K,
};

std::string TypeList(std::span<const GgmlType> types) {
  std::string list;
  for (GgmlType type : types) {
    if (!list.empty()) list += ", ";
    list += TypeName(type);
  }
  return list;
}

Status CheckBlockMultiple(GgmlType type, int64_t count) {
  const TypeTraits traits = TraitsOf(type);
  if (count < 0 || count % traits.block_size != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "element count {} is not a multiple of the {} block size {}", count, traits.name,
                 traits.block_size);
  }
  return Status::Ok();
}

// Index of the first NaN or infinity in values[0, count), or count. Tests the exponent bits so
// that the common all-finite case is one vectorisable pass.
int64_t FirstNonFinite(const float* values, int64_t count) {
  constexpr uint32_t kExponent = 0x7f800000u;
  constexpr int64_t kStride = 4096;
  for (int64_t begin = 0; begin < count; begin += kStride) {
    const int64_t end = std::min(count, begin + kStride);
    bool any = false;
    for (int64_t i = begin; i < end; ++i) {
      uint32_t bits;
      std::memcpy(&bits, values + i, sizeof(bits));
      any |= (bits & kExponent) == kExponent;
    }
    if (!any) continue;
    for (int64_t i = begin; i < end; ++i) {
      if (!std::isfinite(values[i])) return i;
    }
  }
  return count;
}

Status RequireData(const TensorInfo& tensor) {
  if (tensor.data != nullptr) return Status::Ok();
  return Error(ErrorCode::kInvalidArgument, "tensor '{}' has no data", tensor.name);
}

Status RequireDequantizable(const TensorInfo& tensor) {
  if (CanDequantize(tensor.type)) return Status::Ok();
  return Error(ErrorCode::kUnsupported,
               "tensor '{}': cannot dequantize {} data; supported types: {}", tensor.name,
               TypeName(tensor.type), TypeList(kDequantizable));
}

}  // namespace

bool CanDequantize(GgmlType type) {
  return std::find(std::begin(kDequantizable), std::end(kDequantizable), type) !=
         std::end(kDequantizable);
}

Status DequantizeRow(GgmlType type, const uint8_t* src, float* dst, int64_t count) {
  if (!CanDequantize(type)) {
    return Error(ErrorCode::kUnsupported, "cannot dequantize {} data; supported types: {}",
                 TypeName(type), TypeList(kDequantizable));
  }
  SKV_RETURN_IF_ERROR(CheckBlockMultiple(type, count));
  const int64_t num_blocks = count / TraitsOf(type).block_size;
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t half;
        std::memcpy(&half, src + 2 * i, sizeof(half));
        dst[i] = Fp16ToFp32(half);
      }
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bf16;
        std::memcpy(&bf16, src + 2 * i, sizeof(bf16));
        dst[i] = Bf16ToFp32(bf16);
      }
      break;
    case GgmlType::kQ4_0:
      DequantizeQ4_0(src, dst, num_blocks);
      break;
    case GgmlType::kQ4_1:
      DequantizeQ4_1(src, dst, num_blocks);
      break;
    case GgmlType::kQ5_0:
      DequantizeQ5_0(src, dst, num_blocks);
      break;
    case GgmlType::kQ5_1:
      DequantizeQ5_1(src, dst, num_blocks);
      break;
    case GgmlType::kQ8_0:
      DequantizeQ8_0(src, dst, num_blocks);
      break;
    case GgmlType::kQ2_K:
      DequantizeQ2_K(src, dst, num_blocks);
      break;
    case GgmlType::kQ3_K:
      DequantizeQ3_K(src, dst, num_blocks);
      break;
    case GgmlType::kQ4_K:
      DequantizeQ4_K(src, dst, num_blocks);
      break;
    case GgmlType::kQ5_K:
      DequantizeQ5_K(src, dst, num_blocks);
      break;
    case GgmlType::kQ6_K:
      DequantizeQ6_K(src, dst, num_blocks);
      break;
    default:
      return Error(ErrorCode::kInternal, "no dequantizer for {}", TypeName(type));
  }
  return Status::Ok();
}

Status DequantizeRows(const TensorInfo& tensor, int64_t first_row, int64_t num_rows, float* dst) {
  SKV_RETURN_IF_ERROR(RequireData(tensor));
  const int64_t rows = tensor.rows();
  if (first_row < 0 || num_rows < 0 || first_row > rows || num_rows > rows - first_row) {
    return Error(ErrorCode::kOutOfRange, "tensor '{}': rows [{}, {}) are outside its {} rows",
                 tensor.name, first_row, first_row + num_rows, rows);
  }
  const uint8_t* src = tensor.data + static_cast<size_t>(first_row) * tensor.row_bytes();
  const int64_t count = num_rows * tensor.row_length();
  const Status status = DequantizeRow(tensor.type, src, dst, count);
  if (!status.ok()) {
    return Status(status.code(), fmt::format("tensor '{}': {}", tensor.name, status.message()));
  }
  // One NaN or infinite weight turns every activation it reaches into NaN, and the model then
  // writes garbage without any error: a file's weights must be numbers.
  const int64_t bad = FirstNonFinite(dst, count);
  if (bad < count) {
    const int64_t row_length = tensor.row_length();
    return Error(ErrorCode::kCorrupt,
                 "tensor '{}' holds a non-finite weight ({}) at row {}, column {}", tensor.name,
                 dst[bad], first_row + bad / row_length, bad % row_length);
  }
  return Status::Ok();
}

namespace {

// How to find non-finite values in a type without decoding it. Float types are checked element
// by element; a block format's elements are a finite fp16 scale times a small integer (plus a
// finite fp16 min), so it is enough to check the block's scales.
struct FiniteProbe {
  int64_t unit_bytes;     // an element or a block
  int64_t unit_elements;  // elements per unit
  int fields[2];          // byte offsets of the fields to test in a unit (-1: none)
  bool is_f32;            // 32-bit fields; otherwise 16-bit
  uint32_t exponent;      // the all-ones exponent of the field's format
  bool is_bf16;
  const char* what;
};

FiniteProbe ProbeOf(GgmlType type) {
  auto block = [](int64_t bytes, int64_t elements, int d, int m) {
    return FiniteProbe{bytes, elements, {d, m}, false, 0x7c00u, false, "block scale"};
  };
  switch (type) {
    case GgmlType::kF32:
      return {4, 1, {0, -1}, true, 0x7f800000u, false, "weight"};
    case GgmlType::kF16:
      return {2, 1, {0, -1}, false, 0x7c00u, false, "weight"};
    case GgmlType::kBF16:
      return {2, 1, {0, -1}, false, 0x7f80u, true, "weight"};
    case GgmlType::kQ4_0:
      return block(sizeof(BlockQ4_0), kQk, offsetof(BlockQ4_0, d), -1);
    case GgmlType::kQ4_1:
      return block(sizeof(BlockQ4_1), kQk, offsetof(BlockQ4_1, d), offsetof(BlockQ4_1, m));
    case GgmlType::kQ5_0:
      return block(sizeof(BlockQ5_0), kQk, offsetof(BlockQ5_0, d), -1);
    case GgmlType::kQ5_1:
      return block(sizeof(BlockQ5_1), kQk, offsetof(BlockQ5_1, d), offsetof(BlockQ5_1, m));
    case GgmlType::kQ8_0:
      return block(sizeof(BlockQ8_0), kQk, offsetof(BlockQ8_0, d), -1);
    case GgmlType::kQ2_K:
      return block(sizeof(BlockQ2_K), kQkK, offsetof(BlockQ2_K, d), offsetof(BlockQ2_K, dmin));
    case GgmlType::kQ3_K:
      return block(sizeof(BlockQ3_K), kQkK, offsetof(BlockQ3_K, d), -1);
    case GgmlType::kQ4_K:
      return block(sizeof(BlockQ4_K), kQkK, offsetof(BlockQ4_K, d), offsetof(BlockQ4_K, dmin));
    case GgmlType::kQ5_K:
      return block(sizeof(BlockQ5_K), kQkK, offsetof(BlockQ5_K, d), offsetof(BlockQ5_K, dmin));
    case GgmlType::kQ6_K:
      return block(sizeof(BlockQ6_K), kQkK, offsetof(BlockQ6_K, d), -1);
    default:
      return {0, 0, {-1, -1}, false, 0, false, ""};
  }
}

}  // namespace

Status CheckTensorFinite(const TensorInfo& tensor) {
  SKV_RETURN_IF_ERROR(RequireDequantizable(tensor));
  SKV_RETURN_IF_ERROR(RequireData(tensor));
  const FiniteProbe probe = ProbeOf(tensor.type);
  const int64_t units = tensor.num_elements / probe.unit_elements;
  for (int64_t unit = 0; unit < units; ++unit) {
    const uint8_t* base = tensor.data + unit * probe.unit_bytes;
    for (int field : probe.fields) {
      if (field < 0) continue;
      uint32_t bits = 0;
      float value = 0.0f;
      if (probe.is_f32) {
        std::memcpy(&bits, base + field, sizeof(uint32_t));
        std::memcpy(&value, &bits, sizeof(value));
      } else {
        uint16_t half = 0;
        std::memcpy(&half, base + field, sizeof(half));
        bits = half;
        value = probe.is_bf16 ? Bf16ToFp32(half) : Fp16ToFp32(half);
      }
      if ((bits & probe.exponent) != probe.exponent) continue;
      const int64_t element = unit * probe.unit_elements;
      return Error(ErrorCode::kCorrupt,
                   "tensor '{}' holds a non-finite {} ({}) at row {}, column {}", tensor.name,
                   probe.what, value, element / tensor.row_length(), element % tensor.row_length());
    }
  }
  return Status::Ok();
}

Result<std::vector<float>> DequantizeTensor(const TensorInfo& tensor) {
  SKV_RETURN_IF_ERROR(RequireDequantizable(tensor));
  std::vector<float> values(static_cast<size_t>(tensor.num_elements));
  SKV_RETURN_IF_ERROR(DequantizeRows(tensor, 0, tensor.rows(), values.data()));
  return values;
}

Status QuantizeRowQ8_0(const float* src, uint8_t* dst, int64_t count) {
  SKV_RETURN_IF_ERROR(CheckBlockMultiple(GgmlType::kQ8_0, count));
  for (int64_t b = 0; b < count / kQk; ++b) {
    const float* x = src + b * kQk;
    float max_abs = 0.0f;
    for (int i = 0; i < kQk; ++i) max_abs = std::max(max_abs, std::fabs(x[i]));
    const float d = max_abs / 127.0f;
    const float inverse_d = d == 0.0f ? 0.0f : 1.0f / d;
    BlockQ8_0 block;
    block.d = Fp32ToFp16(d);
    for (int i = 0; i < kQk; ++i) block.qs[i] = RoundToInt8(x[i] * inverse_d);
    StoreBlock(block, dst, b);
  }
  return Status::Ok();
}

Status QuantizeRowQ4_0(const float* src, uint8_t* dst, int64_t count) {
  SKV_RETURN_IF_ERROR(CheckBlockMultiple(GgmlType::kQ4_0, count));
  for (int64_t b = 0; b < count / kQk; ++b) {
    const float* x = src + b * kQk;
    // The extreme element maps to -8 exactly, using the one level more that the negative side has.
    float max_abs = 0.0f;
    float extreme = 0.0f;
    for (int i = 0; i < kQk; ++i) {
      if (std::fabs(x[i]) > max_abs) {
        max_abs = std::fabs(x[i]);
        extreme = x[i];
      }
    }
    const float d = extreme / -8.0f;
    const float inverse_d = d == 0.0f ? 0.0f : 1.0f / d;
    BlockQ4_0 block;
    block.d = Fp32ToFp16(d);
    for (int i = 0; i < kQk / 2; ++i) {
      const int low = TruncateToNibble(x[i] * inverse_d + 8.5f);
      const int high = TruncateToNibble(x[i + kQk / 2] * inverse_d + 8.5f);
      block.qs[i] = static_cast<uint8_t>(low | (high << 4));
    }
    StoreBlock(block, dst, b);
  }
  return Status::Ok();
}

Status QuantizeRowQ4_1(const float* src, uint8_t* dst, int64_t count) {
  SKV_RETURN_IF_ERROR(CheckBlockMultiple(GgmlType::kQ4_1, count));
  for (int64_t b = 0; b < count / kQk; ++b) {
    const float* x = src + b * kQk;
    float min = x[0];
    float max = x[0];
    for (int i = 1; i < kQk; ++i) {
      min = std::min(min, x[i]);
      max = std::max(max, x[i]);
    }
    const float d = (max - min) / 15.0f;
    const float inverse_d = d == 0.0f ? 0.0f : 1.0f / d;
    BlockQ4_1 block;
    block.d = Fp32ToFp16(d);
    block.m = Fp32ToFp16(min);
    for (int i = 0; i < kQk / 2; ++i) {
      const int low = TruncateToNibble((x[i] - min) * inverse_d + 0.5f);
      const int high = TruncateToNibble((x[i + kQk / 2] - min) * inverse_d + 0.5f);
      block.qs[i] = static_cast<uint8_t>(low | (high << 4));
    }
    StoreBlock(block, dst, b);
  }
  return Status::Ok();
}

Status QuantizeRow(GgmlType type, const float* src, uint8_t* dst, int64_t count) {
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return Status::Ok();
    case GgmlType::kF16:
    case GgmlType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        const uint16_t bits = type == GgmlType::kF16 ? Fp32ToFp16(src[i]) : Fp32ToBf16(src[i]);
        std::memcpy(dst + 2 * i, &bits, sizeof(bits));
      }
      return Status::Ok();
    case GgmlType::kQ8_0:
      return QuantizeRowQ8_0(src, dst, count);
    case GgmlType::kQ4_0:
      return QuantizeRowQ4_0(src, dst, count);
    case GgmlType::kQ4_1:
      return QuantizeRowQ4_1(src, dst, count);
    default:
      return Error(ErrorCode::kUnsupported,
                   "cannot quantize to {}; supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1",
                   TypeName(type));
  }
}

}  // namespace shadowkv::gguf
