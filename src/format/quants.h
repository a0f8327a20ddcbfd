// GGML block formats: their byte layouts, dequantisation to fp32, and simple quantisers.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "format/gguf.h"

namespace shadowkv::gguf {

inline constexpr int64_t kQk = 32;    // elements per block of the Q4_0 .. Q8_1 formats
inline constexpr int64_t kQkK = 256;  // elements per super-block of the K formats
inline constexpr int kKScaleBytes = 12;

// Block layouts, exactly as stored in the file (little-endian). `d`, `m`, `dmin` and `s` are fp16
// bits (core/half.h). Blocks in a mapped file may sit at any address: copy them out (memcpy)
// rather than dereferencing a cast pointer. Element i of a 32-element block is written x[i].

// x[i] = d * (q[i] - 8); q[i] is the low nibble of qs[i] for i < 16, the high nibble of qs[i-16].
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQk / 2];
};
static_assert(sizeof(BlockQ4_0) == 18);

// x[i] = d * q[i] + m; nibbles as in Q4_0.
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[kQk / 2];
};
static_assert(sizeof(BlockQ4_1) == 20);

// x[i] = d * (q[i] - 16); q[i] = nibble as in Q4_0 | bit i of qh (a little-endian uint32) << 4.
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[kQk / 2];
};
static_assert(sizeof(BlockQ5_0) == 22);

// x[i] = d * q[i] + m; q[i] as in Q5_0.
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[kQk / 2];
};
static_assert(sizeof(BlockQ5_1) == 24);

// x[i] = d * qs[i].
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQk];
};
static_assert(sizeof(BlockQ8_0) == 34);

// x[i] = d * qs[i]; s = d * sum(qs), kept for dot products with Q4_1/Q5_1 (an activation format).
struct BlockQ8_1 {
  uint16_t d, s;
  int8_t qs[kQk];
};
static_assert(sizeof(BlockQ8_1) == 36);

// 16 groups of 16. Element e: q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
// x[e] = d * (scales[e / 16] & 15) * q - dmin * (scales[e / 16] >> 4).
struct BlockQ2_K {
  uint8_t scales[kQkK / 16];
  uint8_t qs[kQkK / 4];
  uint16_t d, dmin;
};
static_assert(sizeof(BlockQ2_K) == 84);

// 16 groups of 16 with signed 6-bit scales (low 4 bits in bytes 0..7, high 2 bits in 8..11),
// offset by 32. Element e: 2 low bits from qs as in Q2_K; q = low - 4 unless bit e / 32 of
// hmask[e % 32] is set; x[e] = d * scale[e / 16] * q.
struct BlockQ3_K {
  uint8_t hmask[kQkK / 8];
  uint8_t qs[kQkK / 4];
  uint8_t scales[kKScaleBytes];
  uint16_t d;
};
static_assert(sizeof(BlockQ3_K) == 110);

// 8 groups of 32, each with a 6-bit scale and a 6-bit min packed into `scales` (see
// UnpackKScaleMin). Group g takes the low (g even) or high (g odd) nibbles of qs[32 * (g / 2) ..];
// x = d * scale[g] * q - dmin * min[g].
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qs[kQkK / 2];
};
static_assert(sizeof(BlockQ4_K) == 144);

// As Q4_K with a fifth bit: bit g of qh[l] is bit 4 of element l of group g.
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qh[kQkK / 8];
  uint8_t qs[kQkK / 2];
};
static_assert(sizeof(BlockQ5_K) == 176);

// Two halves of 128; in half h, group k (0..3) of 32 takes nibble (k >= 2 ? high : low) of
// ql[64 h + 32 (k & 1) + l] and bits 2k, 2k+1 of qh[32 h + l] as bits 4, 5;
// x[e] = d * scales[e / 16] * (q - 32).
struct BlockQ6_K {
  uint8_t ql[kQkK / 2];
  uint8_t qh[kQkK / 4];
  int8_t scales[kQkK / 16];
  uint16_t d;
};
static_assert(sizeof(BlockQ6_K) == 210);

// x[i] = d * qs[i], d an fp32; bsums[j] = sum of qs[16 j .. 16 j + 15] (an activation format).
struct BlockQ8_K {
  float d;
  int8_t qs[kQkK];
  int16_t bsums[kQkK / 16];
};
static_assert(sizeof(BlockQ8_K) == 292);

// The 6-bit scale and min of group `group` (0..7) of a Q4_K/Q5_K super-block.
inline void UnpackKScaleMin(const uint8_t* scales, int group, uint8_t* scale, uint8_t* min) {
  if (group < 4) {
    *scale = scales[group] & 63;
    *min = scales[group + 4] & 63;
  } else {
    *scale = (scales[group + 4] & 0x0f) | ((scales[group - 4] >> 6) << 4);
    *min = (scales[group + 4] >> 4) | ((scales[group] >> 6) << 4);
  }
}

// True for the types DequantizeRow handles: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
bool CanDequantize(GgmlType type);

// dst[count] = the `count` elements stored at src; count must be a multiple of the block size.
// The results are those of the reference formulas above, rounded step by step (no fused
// multiply-add), so they are reproducible across machines.
Status DequantizeRow(GgmlType type, const uint8_t* src, float* dst, int64_t count);

// dst[num_rows, row_length] = rows [first_row, first_row + num_rows) of `tensor`. These read a
// model's weights at load time, so a NaN or infinite value is an error naming the tensor, row and
// column (dst then holds the rows as decoded).
Status DequantizeRows(const TensorInfo& tensor, int64_t first_row, int64_t num_rows, float* dst);

// The whole tensor as fp32, [rows, row_length]; non-finite values are refused as above.
Result<std::vector<float>> DequantizeTensor(const TensorInfo& tensor);

// Refuses non-finite values in weights that are used as stored (never dequantised at load),
// without decoding them: every element of F32/F16/BF16, the fp16 scales of block formats (whose
// values are finite exactly when their scales are). The error names the tensor, row and column.
Status CheckTensorFinite(const TensorInfo& tensor);

// Quantisers for building test models; count must be a multiple of 32. They round as the gguf
// Python package does: Q8_0 d = max|x| / 127, q = round(x / d) (halves away from zero); Q4_0
// d = -x_maxabs / 8 (x_maxabs: the element of largest magnitude, sign kept), q = trunc(x / d +
// 8.5); Q4_1 d = (max - min) / 15, m = min, q = trunc((x - min) / d + 0.5).
Status QuantizeRowQ8_0(const float* src, uint8_t* dst, int64_t count);
Status QuantizeRowQ4_0(const float* src, uint8_t* dst, int64_t count);
Status QuantizeRowQ4_1(const float* src, uint8_t* dst, int64_t count);

// dst = `count` floats stored as `type` (F32, F16, BF16, Q8_0, Q4_0 or Q4_1); dst must hold
// count / block_size * type_size bytes.
Status QuantizeRow(GgmlType type, const float* src, uint8_t* dst, int64_t count);

}  // namespace shadowkv::gguf
