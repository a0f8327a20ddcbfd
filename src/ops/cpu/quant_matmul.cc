// Quantised matrix-vector kernels: activations rounded to 8-bit blocks, integer block dots in
// scalar code and in AVX2 (chosen at run time), fp32 accumulation across blocks.
#include "ops/cpu/quant_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define SKV_HAVE_X86 1
#define SKV_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SKV_HAVE_X86 0
#endif

namespace shadowkv {
namespace {

using gguf::GgmlType;

constexpr int64_t kBlockSize = 32;
constexpr size_t kQ4_0BlockBytes = 18;  // fp16 d, 16 bytes of nibbles
constexpr size_t kQ4_1BlockBytes = 20;  // fp16 d, fp16 m, 16 bytes of nibbles
constexpr size_t kQ8_0BlockBytes = 34;  // fp16 d, 32 int8
// Rows handed to a thread come in tiles of this many, the most any kernel processes together.
constexpr int64_t kTileRows = 4;
// A thread's share should hold at least this many weight blocks, or waking it costs more than
// it saves (a 576 x 576 Q4_1 matrix is ~10k blocks, about 10 us on one core).
constexpr int64_t kMinBlocksPerThread = 1024;
// Activations handled together per weight row: accumulators for more would not fit in registers.
constexpr int kMaxTileBatch = 8;
// Software prefetch distance for weights. Helps Q8_0 matrices larger than the L3 most.
constexpr size_t kPrefetchBytes = 4096;

uint16_t LoadU16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

size_t BlockBytes(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
      return kQ4_0BlockBytes;
    case GgmlType::kQ4_1:
      return kQ4_1BlockBytes;
    case GgmlType::kQ8_0:
      return kQ8_0BlockBytes;
    default:
      return 0;
  }
}

// The activations of one call rounded to 8 bits: x[b][c] ~ scale[j][b] * qs[b][c], j = c / 32.
// Scales and block sums are stored block-major so the values of one block for consecutive
// batch entries are adjacent (the AVX2 kernels load them as one vector).
struct QuantizedActivations {
  int64_t batch = 0;
  int64_t cols = 0;
  int64_t num_blocks = 0;
  int64_t batch_stride = 0;  // batch rounded up to 8
  std::vector<int8_t> qs;    // [batch, cols]
  std::vector<float> scale;  // [num_blocks, batch_stride]: max|x| / 127 of the block
  std::vector<float> sum;    // [num_blocks, batch_stride]: scale * sum of the block's qs

  void Resize(int64_t new_batch, int64_t new_cols) {
    batch = new_batch;
    cols = new_cols;
    num_blocks = cols / kBlockSize;
    batch_stride = (batch + 7) / 8 * 8;
    qs.resize(batch * cols);
    // 8 spare floats: a kernel reads 8 lanes from any batch offset.
    scale.assign(num_blocks * batch_stride + 8, 0.0f);
    sum.assign(num_blocks * batch_stride + 8, 0.0f);
  }
};

// The scale is kept at fp16 precision, as ggml's Q8_0/Q8_1 activation blocks store it. The block
// sum serves the Q4 offsets: Q4_1 pairs with ggml's Q8_1, whose sum is fp16(unrounded scale *
// total); Q4_0 pairs with Q8_0, whose dot is exact in the integers, i.e. scale * total. Products
// then match that reference implementation up to fp32 rounding.
inline void StoreScales(float unrounded_scale, int total, bool fp16_sum, float* scale, float* sum) {
  *scale = Fp16ToFp32(Fp32ToFp16(unrounded_scale));
  *sum = fp16_sum ? Fp16ToFp32(Fp32ToFp16(unrounded_scale * static_cast<float>(total)))
                  : *scale * static_cast<float>(total);
}

void QuantizeBlockScalar(const float* x, bool fp16_sum, int8_t* qs, float* scale, float* sum) {
  float max_abs = 0.0f;
  for (int i = 0; i < kBlockSize; ++i) max_abs = std::max(max_abs, std::fabs(x[i]));
  const float inverse = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
  int total = 0;
  for (int i = 0; i < kBlockSize; ++i) {
    // fmin/fmax keep NaN and overflow inside int8 (a NaN input gives garbage, not UB).
    const float q = std::fmin(std::fmax(std::nearbyint(x[i] * inverse), -127.0f), 127.0f);
    qs[i] = static_cast<int8_t>(q);
    total += qs[i];
  }
  StoreScales(max_abs / 127.0f, total, fp16_sum, scale, sum);
}

// Integer dot of one weight block with 32 activation bytes. For Q4 the nibbles are unsigned
// (0..15); the offset (-8 or m) is applied through the activation block sum.
int32_t BlockDotScalar(GgmlType type, const uint8_t* block, const int8_t* x) {
  int32_t dot = 0;
  if (type == GgmlType::kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < 32; ++i) dot += q[i] * x[i];
  } else {
    const uint8_t* q = block + (type == GgmlType::kQ4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) dot += (q[i] & 0x0f) * x[i] + (q[i] >> 4) * x[i + 16];
  }
  return dot;
}

// Block value = d * scale * dot + offset * sum, with offset -8d (Q4_0), m (Q4_1), 0 (Q8_0).
float BlockOffset(GgmlType type, const uint8_t* block, float d) {
  if (type == GgmlType::kQ4_0) return -8.0f * d;
  if (type == GgmlType::kQ4_1) return Fp16ToFp32(LoadU16(block + 2));
  return 0.0f;
}

void QuantRowsScalar(const QuantMatrix& w, const QuantizedActivations& act, int64_t row_begin,
                     int64_t row_end, float* y) {
  const size_t block_bytes = BlockBytes(w.type);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.data + r * w.row_bytes;
    for (int64_t b = 0; b < act.batch; ++b) {
      const int8_t* xq = act.qs.data() + b * act.cols;
      float acc = 0.0f;
      float offset_acc = 0.0f;
      for (int64_t j = 0; j < act.num_blocks; ++j) {
        const uint8_t* block = row + j * block_bytes;
        const float d = Fp16ToFp32(LoadU16(block));
        const int32_t dot = BlockDotScalar(w.type, block, xq + j * kBlockSize);
        acc += static_cast<float>(dot) * (d * act.scale[j * act.batch_stride + b]);
        offset_acc += BlockOffset(w.type, block, d) * act.sum[j * act.batch_stride + b];
      }
      y[b * w.rows + r] = acc + offset_acc;
    }
  }
}

void FloatRowsScalar(const QuantMatrix& w, const float* x, int64_t batch, int64_t row_begin,
                     int64_t row_end, float* y) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.data + r * w.row_bytes;
    for (int64_t b = 0; b < batch; ++b) {
      const float* xb = x + b * w.cols;
      float acc = 0.0f;
      for (int64_t c = 0; c < w.cols; ++c) {
        const float weight = w.type == GgmlType::kF32 ? reinterpret_cast<const float*>(row)[c]
                                                      : Fp16ToFp32(LoadU16(row + 2 * c));
        acc += weight * xb[c];
      }
      y[b * w.rows + r] = acc;
    }
  }
}

#if SKV_HAVE_X86

SKV_AVX2 float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Same values as QuantizeBlockScalar: max is exact, products and round-to-nearest-even match.
SKV_AVX2 void QuantizeBlockAvx2(const float* x, bool fp16_sum, int8_t* qs, float* scale,
                                float* sum) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 max_abs = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign_mask, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(max_abs), _mm256_extractf128_ps(max_abs, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float max_value = _mm_cvtss_f32(m);
  const __m256 inverse = _mm256_set1_ps(max_value > 0.0f ? 127.0f / max_value : 0.0f);
  const __m256 limit = _mm256_set1_ps(127.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inverse),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
    q[i] = _mm256_cvtps_epi32(r);
  }
  // Packing works within 128-bit lanes; the final permute restores element order.
  const __m256i q16_lo = _mm256_packs_epi32(q[0], q[1]);
  const __m256i q16_hi = _mm256_packs_epi32(q[2], q[3]);
  __m256i q8 = _mm256_packs_epi16(q16_lo, q16_hi);
  q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), q8);
  const __m256i sum32 =
      _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  StoreScales(max_value / 127.0f, _mm_cvtsi128_si32(s), fp16_sum, scale, sum);
}

// Weights of one block as 32 bytes in element order: nibbles 0..15 (Q4) or int8 (Q8_0).
template <GgmlType kType>
SKV_AVX2 inline __m256i LoadWeightBlock(const uint8_t* block) {
  if constexpr (kType == GgmlType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    constexpr int kQsOffset = kType == GgmlType::kQ4_1 ? 4 : 2;
    // Both halves hold the 16 bytes; the upper half is shifted so its high nibbles come down.
    const __m256i packed = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQsOffset)));
    const __m256i shifted = _mm256_srlv_epi32(packed, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
  }
}

// y for rows [row_begin, row_end) (a multiple of kRows) and kBatch activations from
// batch_begin, kRows rows at a time: each weight block is loaded and unpacked once and used for
// every activation of the tile.
template <GgmlType kType, int kRows, int kBatch, bool kPrefetch>
SKV_AVX2 void QuantTileAvx2(const QuantMatrix& w, const QuantizedActivations& act,
                            int64_t row_begin, int64_t row_end, int64_t batch_begin, float* y) {
  constexpr size_t kBytes = kType == GgmlType::kQ8_0   ? kQ8_0BlockBytes
                            : kType == GgmlType::kQ4_1 ? kQ4_1BlockBytes
                                                       : kQ4_0BlockBytes;
  constexpr bool kHasOffset = kType != GgmlType::kQ8_0;
  // Locals, not members: stores to the accumulators must not force reloads of these.
  const int64_t num_blocks = act.num_blocks;
  const int64_t stride = act.batch_stride;
  const float* scale = act.scale.data() + batch_begin;
  const float* sum = act.sum.data() + batch_begin;
  // Rows of a tile are adjacent in memory; prefetching whole tiles ahead makes each row fetch
  // the same row of a later tile, so every byte of the matrix is requested once.
  const size_t tile_bytes = kRows * w.row_bytes;
  const size_t prefetch_bytes = (kPrefetchBytes + tile_bytes - 1) / tile_bytes * tile_bytes;
  const int8_t* xq[kBatch];
  for (int b = 0; b < kBatch; ++b) xq[b] = act.qs.data() + (batch_begin + b) * act.cols;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t row0 = row_begin; row0 < row_end; row0 += kRows) {
    const uint8_t* rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = w.data + (row0 + r) * w.row_bytes;

    __m256 acc[kRows][kBatch];
    __m256 offset_acc[kRows];  // lane b: sum over blocks of offset * activation block sum
    for (int r = 0; r < kRows; ++r) {
      offset_acc[r] = _mm256_setzero_ps();
      for (int b = 0; b < kBatch; ++b) acc[r][b] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < num_blocks; ++j) {
      __m256i weights[kRows];
      __m256 d[kRows];
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* block = rows[r] + j * kBytes;
        if constexpr (kPrefetch) {
          _mm_prefetch(reinterpret_cast<const char*>(block) + prefetch_bytes, _MM_HINT_T0);
        }
        weights[r] = LoadWeightBlock<kType>(block);
        if constexpr (kType == GgmlType::kQ4_1) {
          uint32_t pair;
          std::memcpy(&pair, block, sizeof(pair));
          const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)));
          d[r] = _mm256_broadcastss_ps(dm);
          offset_acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                                          _mm256_loadu_ps(sum + j * stride), offset_acc[r]);
        } else {
          d[r] = _mm256_set1_ps(_cvtsh_ss(LoadU16(block)));
          if constexpr (kHasOffset) {
            offset_acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(d[r], _mm256_set1_ps(8.0f)),
                                             _mm256_loadu_ps(sum + j * stride), offset_acc[r]);
          }
        }
      }
      for (int b = 0; b < kBatch; ++b) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[b] + j * 32));
        const __m256 x_scale = _mm256_broadcast_ss(scale + j * stride + b);
        for (int r = 0; r < kRows; ++r) {
          __m256i products;
          if constexpr (kType == GgmlType::kQ8_0) {
            // maddubs wants one unsigned operand: |w| times x with w's sign moved onto x.
            products = _mm256_maddubs_epi16(_mm256_sign_epi8(weights[r], weights[r]),
                                            _mm256_sign_epi8(x, weights[r]));
          } else {
            products = _mm256_maddubs_epi16(weights[r], x);
          }
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
          acc[r][b] = _mm256_fmadd_ps(_mm256_mul_ps(dot, x_scale), d[r], acc[r][b]);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      alignas(32) float offsets[8];
      _mm256_store_ps(offsets, offset_acc[r]);
      for (int b = 0; b < kBatch; ++b) {
        float value = HorizontalSum(acc[r][b]);
        if constexpr (kHasOffset) value += offsets[b];
        y[(batch_begin + b) * w.rows + row0 + r] = value;
      }
    }
  }
}

using TileFn = void (*)(const QuantMatrix&, const QuantizedActivations&, int64_t, int64_t, int64_t,
                        float*);

// One-row tiles indexed by the number of activations they take, minus one.
template <GgmlType kType>
constexpr TileFn kRowTiles[kMaxTileBatch] = {
    QuantTileAvx2<kType, 1, 1, true>, QuantTileAvx2<kType, 1, 2, true>,
    QuantTileAvx2<kType, 1, 3, true>, QuantTileAvx2<kType, 1, 4, true>,
    QuantTileAvx2<kType, 1, 5, true>, QuantTileAvx2<kType, 1, 6, true>,
    QuantTileAvx2<kType, 1, 7, true>, QuantTileAvx2<kType, 1, 8, true>};

template <GgmlType kType>
SKV_AVX2 void QuantRowsAvx2(const QuantMatrix& w, const QuantizedActivations& act,
                            int64_t row_begin, int64_t row_end, float* y) {
  if (act.batch == 1) {
    if constexpr (kType == GgmlType::kQ8_0) {
      // One row at a time streams well without software prefetch (measured: prefetching
      // slowed large Q8_0 matrices by ~10%).
      QuantTileAvx2<kType, 1, 1, false>(w, act, row_begin, row_end, 0, y);
    } else {
      // Pairs of rows share the activation loads; two interleaved streams need the prefetch.
      const int64_t pair_end = row_begin + (row_end - row_begin) / 2 * 2;
      QuantTileAvx2<kType, 2, 1, true>(w, act, row_begin, pair_end, 0, y);
      QuantTileAvx2<kType, 1, 1, true>(w, act, pair_end, row_end, 0, y);
    }
    return;
  }
  if (act.batch <= kMaxTileBatch) {
    kRowTiles<kType>[act.batch - 1](w, act, row_begin, row_end, 0, y);
    return;
  }
  // More activations than one tile takes: all chunks of a row before the next row, so the row
  // is read from memory once and from L1 after.
  for (int64_t r = row_begin; r < row_end; ++r) {
    int64_t b = 0;
    for (; b + kMaxTileBatch <= act.batch; b += kMaxTileBatch) {
      kRowTiles<kType>[kMaxTileBatch - 1](w, act, r, r + 1, b, y);
    }
    if (b < act.batch) kRowTiles<kType>[act.batch - b - 1](w, act, r, r + 1, b, y);
  }
}

SKV_AVX2 void FloatRowsAvx2(const QuantMatrix& w, const float* x, int64_t batch, int64_t row_begin,
                            int64_t row_end, float* y) {
  constexpr int kMaxBatch = 4;
  const int64_t vector_cols = w.cols / 8 * 8;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.data + r * w.row_bytes;
    const float* row_f32 = reinterpret_cast<const float*>(row);
    for (int64_t b0 = 0; b0 < batch; b0 += kMaxBatch) {
      const int count = static_cast<int>(std::min<int64_t>(kMaxBatch, batch - b0));
      __m256 acc[kMaxBatch] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps()};
      for (int64_t c = 0; c < vector_cols; c += 8) {
        const __m256 weights =
            w.type == GgmlType::kF32
                ? _mm256_loadu_ps(row_f32 + c)
                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
        for (int b = 0; b < count; ++b) {
          acc[b] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + (b0 + b) * w.cols + c), acc[b]);
        }
      }
      for (int b = 0; b < count; ++b) {
        float value = HorizontalSum(acc[b]);
        for (int64_t c = vector_cols; c < w.cols; ++c) {
          const float weight =
              w.type == GgmlType::kF32 ? row_f32[c] : _cvtsh_ss(LoadU16(row + 2 * c));
          value += weight * x[(b0 + b) * w.cols + c];
        }
        y[(b0 + b) * w.rows + r] = value;
      }
    }
  }
}

#endif  // SKV_HAVE_X86

bool HaveAvx2() {
#if SKV_HAVE_X86
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return have;
#else
  return false;
#endif
}

// `type` is the weight type the activations will meet; it decides how block sums are rounded.
void QuantizeActivations(const float* x, int64_t batch, int64_t cols, GgmlType type, bool use_avx2,
                         QuantizedActivations& act) {
  act.Resize(batch, cols);
  const bool fp16_sum = type == GgmlType::kQ4_1;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < act.num_blocks; ++j) {
      const float* source = x + b * cols + j * kBlockSize;
      int8_t* qs = act.qs.data() + b * cols + j * kBlockSize;
      float* scale = act.scale.data() + j * act.batch_stride + b;
      float* sum = act.sum.data() + j * act.batch_stride + b;
#if SKV_HAVE_X86
      if (use_avx2) {
        QuantizeBlockAvx2(source, fp16_sum, qs, scale, sum);
        continue;
      }
#endif
      QuantizeBlockScalar(source, fp16_sum, qs, scale, sum);
    }
  }
}

using RowsFn = void (*)(const QuantMatrix&, const QuantizedActivations&, int64_t, int64_t, float*);

RowsFn SelectQuantRows(GgmlType type, bool use_avx2) {
#if SKV_HAVE_X86
  if (use_avx2) {
    switch (type) {
      case GgmlType::kQ4_0:
        return QuantRowsAvx2<GgmlType::kQ4_0>;
      case GgmlType::kQ4_1:
        return QuantRowsAvx2<GgmlType::kQ4_1>;
      case GgmlType::kQ8_0:
        return QuantRowsAvx2<GgmlType::kQ8_0>;
      default:
        break;
    }
  }
#endif
  return QuantRowsScalar;
}

}  // namespace

bool CpuIsaAvailable(CpuIsa isa) { return isa != CpuIsa::kAvx2 || HaveAvx2(); }

bool QuantMatVecSupports(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ8_0:
      return true;
    default:
      return false;
  }
}

size_t QuantRowBytes(GgmlType type, int64_t cols) {
  if (type == GgmlType::kF32) return static_cast<size_t>(cols) * 4;
  if (type == GgmlType::kF16) return static_cast<size_t>(cols) * 2;
  return static_cast<size_t>(cols / kBlockSize) * BlockBytes(type);
}

void QuantMatVec(const QuantMatrix& w, const float* x, int64_t batch, float* y, ThreadPool& pool,
                 CpuIsa isa) {
  SKV_CHECK(QuantMatVecSupports(w.type));
  SKV_CHECK(w.row_bytes >= QuantRowBytes(w.type, w.cols));
  if (batch <= 0 || w.rows <= 0) return;
  SKV_CHECK(isa != CpuIsa::kAvx2 || HaveAvx2());
  const bool use_avx2 = isa == CpuIsa::kAvx2 || (isa == CpuIsa::kBest && HaveAvx2());
  const int64_t num_tiles = (w.rows + kTileRows - 1) / kTileRows;
  const int64_t blocks_per_tile = std::max<int64_t>(1, kTileRows * w.cols / kBlockSize);
  const int64_t grain = std::max<int64_t>(1, kMinBlocksPerThread / blocks_per_tile);
  auto tile_rows = [&](int64_t tile_begin, int64_t tile_end) {
    return std::pair(tile_begin * kTileRows, std::min(w.rows, tile_end * kTileRows));
  };

  if (w.type == GgmlType::kF32 || w.type == GgmlType::kF16) {
    pool.ParallelFor(num_tiles, grain, [&](int64_t tile_begin, int64_t tile_end, int) {
      const auto [row_begin, row_end] = tile_rows(tile_begin, tile_end);
#if SKV_HAVE_X86
      if (use_avx2) return FloatRowsAvx2(w, x, batch, row_begin, row_end, y);
#endif
      FloatRowsScalar(w, x, batch, row_begin, row_end, y);
    });
    return;
  }

  SKV_CHECK(w.cols % kBlockSize == 0);
  // Reused across calls: decode issues many small products and the buffer is small. Workers
  // reach the caller's copy through the reference.
  static thread_local QuantizedActivations scratch;
  QuantizedActivations& act = scratch;
  QuantizeActivations(x, batch, w.cols, w.type, use_avx2, act);
  const RowsFn rows_fn = SelectQuantRows(w.type, use_avx2);
  pool.ParallelFor(num_tiles, grain, [&](int64_t tile_begin, int64_t tile_end, int) {
    const auto [row_begin, row_end] = tile_rows(tile_begin, tile_end);
    rows_fn(w, act, row_begin, row_end, y);
  });
}

std::vector<uint8_t> QuantizeRowsQ8_0(const float* w, int64_t rows, int64_t cols) {
  SKV_CHECK(cols % kBlockSize == 0);
  const int64_t num_blocks = rows * (cols / kBlockSize);
  std::vector<uint8_t> out(static_cast<size_t>(num_blocks) * kQ8_0BlockBytes);
  for (int64_t block = 0; block < num_blocks; ++block) {
    const float* source = w + block * kBlockSize;
    uint8_t* dest = out.data() + block * kQ8_0BlockBytes;
    float max_abs = 0.0f;
    for (int i = 0; i < kBlockSize; ++i) max_abs = std::max(max_abs, std::fabs(source[i]));
    // Divide by the stored (fp16-rounded) scale so the reconstruction error stays within d/2;
    // the scale is capped at the largest finite fp16.
    const uint16_t d_half = Fp32ToFp16(std::min(max_abs / 127.0f, 65504.0f));
    const float d = Fp16ToFp32(d_half);
    std::memcpy(dest, &d_half, sizeof(d_half));
    for (int i = 0; i < kBlockSize; ++i) {
      const float q = d > 0.0f ? std::nearbyint(source[i] / d) : 0.0f;
      dest[2 + i] =
          static_cast<uint8_t>(static_cast<int8_t>(std::fmin(std::fmax(q, -127.0f), 127.0f)));
    }
  }
  return out;
}

}  // namespace shadowkv
