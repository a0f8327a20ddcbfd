// One warp's piece of a ShadowKV key rebuild on tensor cores: 16 key rows of one KV head from
// their A rows and B_h, both staged in shared memory, rotated at each row's position and rounded
// to bf16. The gather rebuild (rebuild.cu) stores such tiles into gather slots; the re-ranking
// scorer (rerank.cu) multiplies them by the group's queries instead.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/mma_utils.cuh"

namespace shadowkv::cuda {

__host__ __device__ constexpr int SkvRankPadded(int rank) { return (rank + 15) / 16 * 16; }

// B_h [rank_padded, kHeadDim] of one KV head into `b_tile` (pitch b_pitch elements; rows past
// `rank` zero), by the whole block through cp.async; the caller commits and waits. `basis`
// points at B_h's first row, rows `width` elements apart.
template <int kHeadDim>
__device__ __forceinline__ void SkvStageBasis(const __nv_bfloat16* basis, int64_t width, int rank,
                                              __nv_bfloat16* b_tile, int b_pitch) {
  const int rank_padded = SkvRankPadded(rank);
  for (int i = threadIdx.x; i < rank_padded * (kHeadDim / 8); i += blockDim.x) {
    const int k = i / (kHeadDim / 8), v = i % (kHeadDim / 8);
    const bool inside = k < rank;
    CpAsync16(b_tile + k * b_pitch + v * 8, inside ? basis + k * width + v * 8 : basis,
              inside ? 16 : 0);
  }
}

// One warp: the A rows of token rows [16 tile, 16 tile + 16) of a list of chunks into `target`
// [16, a_pitch] (cp.async, not committed; zeros past `total_rows` and past `rank`). Token row t
// is token t % chunk_size of chunk chunks[t / chunk_size]; `coefficients` is the layer's A
// [chunks * chunk_size, stride]. Lane r < 16 finds row r's offset once and the copies read it by
// shuffle; a copy's (row, vector) steps along without dividing (the loop is the kernels' hot
// path, and the chunk size and rank are not compile-time constants).
__device__ __forceinline__ void SkvLoadCoefficientTile(const __nv_bfloat16* coefficients,
                                                       int64_t stride, int rank, int chunk_size,
                                                       const int* chunks, int total_rows, int tile,
                                                       __nv_bfloat16* target, int a_pitch) {
  const int lane = threadIdx.x % 32, vectors = SkvRankPadded(rank) / 8;
  int64_t row_offset = -1;  // lane r: row r's first coefficient, or -1 past total_rows
  if (lane < 16 && tile * 16 + lane < total_rows) {
    const int token_row = tile * 16 + lane, which = token_row / chunk_size;
    row_offset = (static_cast<int64_t>(chunks[which]) * chunk_size + token_row - which * chunk_size) *
                 stride;
  }
  const int step_rows = 32 / vectors, step_vectors = 32 - step_rows * vectors;
  int r = lane / vectors, v = lane - r * vectors;
  const int rounds = (16 * vectors + 31) / 32;  // the same in every lane: shuffles stay whole
  for (int round = 0; round < rounds; ++round) {
    const bool valid = r < 16;
    const int64_t offset = __shfl_sync(0xffffffffu, row_offset, valid ? r : 0);
    const bool inside = valid && offset >= 0 && v * 8 < rank;
    if (valid) {
      CpAsync16(target + r * a_pitch + v * 8, inside ? coefficients + offset + v * 8 : coefficients,
                inside ? 16 : 0);
    }
    r += step_rows;
    v += step_vectors;
    if (v >= vectors) {
      v -= vectors;
      ++r;
    }
  }
}

// RoPE in place on one warp's m16n8 accumulators of a 16-row key tile, the rows of
// `half_row` (row g + 8 half_row of each lane, g = lane / 4) at position `at`. Both RoPE styles
// pair columns inside one lane: kHalves (x[i], x[i + D/2]) = acc[j], acc[j + D/16]; pairs
// (x[2i], x[2i+1]) = elements 0/1 and 2/3 of acc[j]. inv_freq [kHeadDim / 2].
template <int kHeadDim, bool kHalves>
__device__ __forceinline__ void SkvRotateAccumulators(float (&acc)[kHeadDim / 8][4], int half_row,
                                                      float at, const float* inv_freq) {
  const int c2 = (threadIdx.x % 4) * 2;
  if constexpr (kHalves) {
#pragma unroll
    for (int j = 0; j < kHeadDim / 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float sine, cosine;
        RopeSinCos(at * inv_freq[j * 8 + c2 + e], &sine, &cosine);
        const float x0 = acc[j][2 * half_row + e], x1 = acc[j + kHeadDim / 16][2 * half_row + e];
        acc[j][2 * half_row + e] = x0 * cosine - x1 * sine;
        acc[j + kHeadDim / 16][2 * half_row + e] = x0 * sine + x1 * cosine;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      float sine, cosine;
      RopeSinCos(at * inv_freq[j * 4 + c2 / 2], &sine, &cosine);
      const float x0 = acc[j][2 * half_row], x1 = acc[j][2 * half_row + 1];
      acc[j][2 * half_row] = x0 * cosine - x1 * sine;
      acc[j][2 * half_row + 1] = x0 * sine + x1 * cosine;
    }
  }
}

// One warp: keys = RoPE(A tile · B_h) for the tile's 16 rows, as bf16 into `out_tile` [16,
// out_pitch]. `position(r)` gives row r's position (float); inv_freq [kHeadDim / 2] the rotary
// frequencies (full-width rotary). Accumulator layout (m16n8k16): lane holds rows g, g + 8 and
// columns 8j + 2c, 8j + 2c + 1, rotated there (SkvRotateAccumulators). Ends with __syncwarp:
// the tile is readable by the whole warp.
template <int kHeadDim, bool kHalves, typename PositionOf>
__device__ __forceinline__ void SkvRebuildTile(const __nv_bfloat16* a_tile, int a_pitch,
                                               const __nv_bfloat16* b_tile, int b_pitch,
                                               int rank_padded, const float* inv_freq,
                                               PositionOf position, __nv_bfloat16* out_tile,
                                               int out_pitch) {
  const int lane = threadIdx.x % 32, g = lane / 4, c2 = (lane % 4) * 2;
  float acc[kHeadDim / 8][4];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (int k0 = 0; k0 < rank_padded; k0 += 16) {
    uint32_t a[4];
    LdMatrixX4(a, a_tile + (lane & 15) * a_pitch + k0 + (lane >> 4) * 8);
#pragma unroll
    for (int n0 = 0; n0 < kHeadDim; n0 += 16) {
      uint32_t b[4];
      LdMatrixX4Trans(b, b_tile + (k0 + (lane & 15)) * b_pitch + n0 + (lane >> 4) * 8);
      MmaBf16(acc[n0 / 8], a, b[0], b[1]);
      MmaBf16(acc[n0 / 8 + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int half_row = 0; half_row < 2; ++half_row) {
    const int r = g + 8 * half_row;
    SkvRotateAccumulators<kHeadDim, kHalves>(acc, half_row, position(r), inv_freq);
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      *reinterpret_cast<uint32_t*>(out_tile + r * out_pitch + j * 8 + c2) =
          PackBf16(acc[j][2 * half_row], acc[j][2 * half_row + 1]);
    }
  }
  __syncwarp();
}

}  // namespace shadowkv::cuda
