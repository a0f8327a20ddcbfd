// Kernel lab for the re-rank scorer (src/ops/cuda/shadowkv/rerank.cu, SkvExactScoreFastKernel):
// times variants that leave out or change one stage (RoPE, the query product, the per-chunk
// log-sum-exp) at Qwen2.5-0.5B's and Llama-3-8B's shapes, to place the time inside the kernel,
// and the A rows staged a tile ahead per warp (a two-tile ring, what the library does) against
// all at once per block (slower: on the H200 2026-12-02, 29.8 against 33.1 us at Qwen's rank 24,
// 138 against 259 us at Llama-3-8B's rank 160; fewer blocks fit on a multiprocessor).
// PairKernel: two 16-row tiles per warp at once, so that each B_h fragment read from shared
// memory feeds both tiles' products (the library reads all of B_h once per 16 rows), optionally
// with the rotated keys going from the accumulators straight into the query product (no key tile
// in shared memory) and with the next pair's A rows loaded while this one computes; each
// variant's log-sum-exps are checked against the library's form (LabKernel<D, 1, 1>).
// Measured on the H200 (tree cdb482d, docs/PERF.md): the best two-tile variant gains 2-8% over
// the library's kernel (4% at Qwen's rank 24, 2% at Llama-3-8B's rank 160), prefetching the next
// pair slows rank 160 by half; the library keeps its one kernel. This file is not built by CMake:
//   nvcc -O3 -std=c++20 -arch=sm_90a -I src dev/cuda/rerank_score_lab.cu -o rerank_score_lab
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/mma_utils.cuh"
#include "ops/cuda/shadowkv/rebuild_tile.cuh"

using namespace shadowkv::cuda;
using Bf16 = __nv_bfloat16;

#define CHECK_CUDA(x)                                                       \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

constexpr int kWarps = 4, kChunks = 32, kHeads16 = 16, kChunk = 8;

struct Params {
  const Bf16* coefficients;  // [rows, chunks * 8, rank]
  const Bf16* basis;         // [rows, rank, kv_heads * D]
  const Bf16* queries;       // [rows, kv_heads, group, D]
  const int* candidates;     // [rows, kv_heads, max_candidates]
  const float* inv_freq;
  float* lse;  // [rows, kv_heads, group, max_candidates]
  int rows, kv_heads, group, rank, capacity_chunks, max_candidates;
  float scale;
};

// Both lab kernels' start, for block (first chunk, KV head h, row): false where the block has
// no candidates (the list is packed). Else the block's chunks and their count, the rotary
// frequencies, and cp.async of B_h into b_tile and the group's queries (padded to 16 heads)
// into q_tile, committed; the caller waits and synchronises.
template <int kHeadDim>
__device__ bool StartBlock(const Params& p, int h, int row, int first, int* chunks, float* inv_freq,
                           int* count_shared, Bf16* b_tile, Bf16* q_tile, int pitch) {
  const int* list = p.candidates + (static_cast<int64_t>(row) * p.kv_heads + h) * p.max_candidates;
  if (first >= p.max_candidates || list[first] < 0) return false;
  if (threadIdx.x == 0) *count_shared = 0;
  __syncthreads();
  if (threadIdx.x < kChunks) {
    const int i = first + threadIdx.x;
    const int chunk = i < p.max_candidates ? list[i] : -1;
    chunks[threadIdx.x] = chunk;
    if (chunk >= 0) atomicAdd(count_shared, 1);
  }
  for (int i = threadIdx.x; i < kHeadDim / 2; i += blockDim.x) inv_freq[i] = p.inv_freq[i];
  const int width = p.kv_heads * kHeadDim;
  SkvStageBasis<kHeadDim>(p.basis + static_cast<int64_t>(row) * p.rank * width + h * kHeadDim,
                          width, p.rank, b_tile, pitch);
  const Bf16* q_row = p.queries + (static_cast<int64_t>(row) * p.kv_heads + h) * p.group * kHeadDim;
  for (int i = threadIdx.x; i < kHeads16 * (kHeadDim / 8); i += blockDim.x) {
    const int head = i / (kHeadDim / 8), v = i % (kHeadDim / 8);
    const bool inside = head < p.group;
    CpAsync16(q_tile + head * pitch + v * 8, inside ? q_row + head * kHeadDim + v * 8 : q_row,
              inside ? 16 : 0);
  }
  CpAsyncCommit();
  return true;
}

// After a barrier: each (chunk, query head)'s log-sum-exp of the block's token logits
// [count * kChunk, group] into p.lse, from column `first`.
__device__ void WriteChunkLse(const Params& p, const float* token_logits, int count, int first,
                              int h, int row) {
  float* lse = p.lse + (static_cast<int64_t>(row) * p.kv_heads + h) * p.group * p.max_candidates;
  for (int i = threadIdx.x; i < count * p.group; i += blockDim.x) {
    const int chunk = i / p.group, gq = i % p.group;
    const float* x = token_logits + chunk * kChunk * p.group + gq;
    float top = -INFINITY;
    for (int t = 0; t < kChunk; ++t) top = fmaxf(top, x[t * p.group]);
    float sum = 0.0f;
    for (int t = 0; t < kChunk; ++t) sum += expf(x[t * p.group] - top);
    lse[gq * p.max_candidates + first + chunk] = top + logf(sum);
  }
}

// kRope: 0 none, 1 sincos per element (the library's), 2 per-chunk base angle and an 8-step
// table. kProduct: the query product and log-sum-exp (0: skip both).
template <int kHeadDim, int kRope, int kProduct, bool kStageAll = false>
__global__ void __launch_bounds__(kWarps * 32) LabKernel(Params p) {
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ int chunks[kChunks];
  __shared__ float inv_freq[kHeadDim / 2];
  __shared__ int count_shared;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kChunks;
  const int rank = p.rank, rank_padded = SkvRankPadded(rank);
  const int a_pitch = rank_padded + 8, pitch = kHeadDim + 8;
  Bf16* b_tile = reinterpret_cast<Bf16*>(shared);
  Bf16* q_tile = b_tile + rank_padded * pitch;
  Bf16* a_ring = q_tile + kHeads16 * pitch + warp * 2 * 16 * a_pitch;
  Bf16* key_tile = q_tile + kHeads16 * pitch + kWarps * 2 * 16 * a_pitch + warp * 16 * pitch;
  float* token_logits = reinterpret_cast<float*>(key_tile + (kWarps - warp) * 16 * pitch);
  // kRope 2: cos/sin of each chunk's first position and of the steps 0..7, [*, kHeadDim / 2].
  constexpr int kHalf = kHeadDim / 2;
  float* base_cos = token_logits + kChunks * kChunk * p.group;
  float* base_sin = base_cos + kChunks * kHalf;
  float* step_cos = base_sin + kChunks * kHalf;
  float* step_sin = step_cos + kChunk * kHalf;
  if (!StartBlock<kHeadDim>(p, h, row, first, chunks, inv_freq, &count_shared, b_tile, q_tile,
                            pitch)) {
    return;
  }
  __syncthreads();
  if constexpr (kRope == 2) {
    for (int i = threadIdx.x; i < kChunks * (kHeadDim / 2); i += blockDim.x) {
      const int c = i / (kHeadDim / 2), f = i % (kHeadDim / 2);
      float s, co;
      RopeSinCos(static_cast<float>(max(chunks[c], 0) * kChunk) * inv_freq[f], &s, &co);
      base_cos[c * kHalf + f] = co;
      base_sin[c * kHalf + f] = s;
    }
    for (int i = threadIdx.x; i < kChunk * (kHeadDim / 2); i += blockDim.x) {
      const int t = i / (kHeadDim / 2), f = i % (kHeadDim / 2);
      float s, co;
      RopeSinCos(static_cast<float>(t) * inv_freq[f], &s, &co);
      step_cos[t * kHalf + f] = co;
      step_sin[t * kHalf + f] = s;
    }
  }
  const int count = count_shared, total_rows = count * kChunk;
  const int num_tiles = (total_rows + 15) / 16;
  const Bf16* coefficients =
      p.coefficients + static_cast<int64_t>(row) * p.capacity_chunks * kChunk * rank;
  auto load_tile = [&](int tile, Bf16* target) {
    SkvLoadCoefficientTile(coefficients, rank, rank, kChunk, chunks, total_rows, tile, target,
                           a_pitch);
  };
  // kStageAll: every tile's rows into a block-wide buffer (after the key tiles' region end).
  Bf16* a_all = reinterpret_cast<Bf16*>(token_logits + kChunks * kChunk * p.group);
  if constexpr (kStageAll) {
    for (int tile = warp; tile < num_tiles; tile += kWarps)
      load_tile(tile, a_all + tile * 16 * a_pitch);
    CpAsyncCommit();
    CpAsyncWait<0>();
  } else {
    if (warp < num_tiles) load_tile(warp, a_ring);
    CpAsyncCommit();
    CpAsyncWait<1>();
  }
  __syncthreads();
  const int g = lane / 4, c2 = (lane % 4) * 2;
  int buffer = 0;
  for (int tile = warp; tile < num_tiles; tile += kWarps, buffer ^= 1) {
    if constexpr (!kStageAll) {
      if (tile + kWarps < num_tiles) load_tile(tile + kWarps, a_ring + (buffer ^ 1) * 16 * a_pitch);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncwarp();
    }
    const Bf16* a_tile = kStageAll ? a_all + tile * 16 * a_pitch : a_ring + buffer * 16 * a_pitch;
    if constexpr (kRope == 1) {
      auto position = [&](int r) {
        const int token_row = tile * 16 + r;
        const int which = min(token_row / kChunk, count - 1);
        return static_cast<float>(chunks[which] * kChunk + token_row % kChunk);
      };
      SkvRebuildTile<kHeadDim, true>(a_tile, a_pitch, b_tile, pitch, rank_padded, inv_freq,
                                     position, key_tile, pitch);
    } else {
      float acc[kHeadDim / 8][4];
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      for (int k0 = 0; k0 < rank_padded; k0 += 16) {
        uint32_t a[4];
        LdMatrixX4(a, a_tile + (lane & 15) * a_pitch + k0 + (lane >> 4) * 8);
#pragma unroll
        for (int n0 = 0; n0 < kHeadDim; n0 += 16) {
          uint32_t b[4];
          LdMatrixX4Trans(b, b_tile + (k0 + (lane & 15)) * pitch + n0 + (lane >> 4) * 8);
          MmaBf16(acc[n0 / 8], a, b[0], b[1]);
          MmaBf16(acc[n0 / 8 + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int half_row = 0; half_row < 2; ++half_row) {
        const int r = g + 8 * half_row;
        if constexpr (kRope == 2) {
          const int token_row = tile * 16 + r;
          const int which = min(token_row / kChunk, count - 1), t = token_row % kChunk;
#pragma unroll
          for (int j = 0; j < kHeadDim / 16; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int f = j * 8 + c2 + e;
              const float bc = base_cos[which * kHalf + f], bs = base_sin[which * kHalf + f];
              const float sc = step_cos[t * kHalf + f], ss = step_sin[t * kHalf + f];
              const float cosine = bc * sc - bs * ss, sine = bs * sc + bc * ss;
              const float x0 = acc[j][2 * half_row + e],
                          x1 = acc[j + kHeadDim / 16][2 * half_row + e];
              acc[j][2 * half_row + e] = x0 * cosine - x1 * sine;
              acc[j + kHeadDim / 16][2 * half_row + e] = x0 * sine + x1 * cosine;
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          *reinterpret_cast<uint32_t*>(key_tile + r * pitch + j * 8 + c2) =
              PackBf16(acc[j][2 * half_row], acc[j][2 * half_row + 1]);
        }
      }
      __syncwarp();
    }
    if constexpr (kProduct) {
      float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int k0 = 0; k0 < kHeadDim; k0 += 16) {
        uint32_t a[4], b[4];
        LdMatrixX4(a, key_tile + (lane & 15) * pitch + k0 + (lane >> 4) * 8);
        LdMatrixX4(b, q_tile + ((lane >> 4) * 8 + (lane & 7)) * pitch + k0 + ((lane >> 3) & 1) * 8);
        MmaBf16(acc[0], a, b[0], b[1]);
        MmaBf16(acc[1], a, b[2], b[3]);
      }
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token_row = tile * 16 + g + 8 * (e >> 1), head = nb * 8 + c2 + (e & 1);
          if (token_row < total_rows && head < p.group)
            token_logits[token_row * p.group + head] = acc[nb][e] * p.scale;
        }
      }
    }
    __syncwarp();
  }
  CpAsyncWait<0>();
  __syncthreads();
  if constexpr (kProduct) {
    WriteChunkLse(p, token_logits, count, first, h, row);
  } else if (threadIdx.x == 0) {
    p.lse[blockIdx.x] = __bfloat162float(key_tile[0]);  // keep the work
  }
}

// Two tiles per warp (see the file's comment). kRegQk: the query product's A fragments packed
// from the rotated accumulators (lane (g, c2) holds rows g and g + 8 of columns 8j + c2, c2 + 1:
// n-blocks 2kb and 2kb + 1 are k-block kb's fragments). kPrefetch: two A buffers of a pair each.
template <int kHeadDim, bool kRegQk, bool kPrefetch>
__global__ void __launch_bounds__(kWarps * 32) PairKernel(Params p) {
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ int chunks[kChunks];
  __shared__ float inv_freq[kHeadDim / 2];
  __shared__ int count_shared;
  constexpr int kBuffers = kPrefetch ? 2 : 1;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kChunks;
  const int rank = p.rank, rank_padded = SkvRankPadded(rank);
  const int a_pitch = rank_padded + 8, pitch = kHeadDim + 8;
  Bf16* b_tile = reinterpret_cast<Bf16*>(shared);
  Bf16* q_tile = b_tile + rank_padded * pitch;
  Bf16* rings = q_tile + kHeads16 * pitch;
  Bf16* a_ring = rings + warp * kBuffers * 32 * a_pitch;
  Bf16* keys = rings + kWarps * kBuffers * 32 * a_pitch;
  Bf16* key_tile = keys + warp * 16 * pitch;  // !kRegQk
  float* token_logits = reinterpret_cast<float*>(keys + (kRegQk ? 0 : kWarps * 16 * pitch));
  if (!StartBlock<kHeadDim>(p, h, row, first, chunks, inv_freq, &count_shared, b_tile, q_tile,
                            pitch)) {
    return;
  }
  __syncthreads();  // the chunk list and its count
  const int count = count_shared, total_rows = count * kChunk;
  const int num_tiles = (total_rows + 15) / 16, num_pairs = (num_tiles + 1) / 2;
  const Bf16* coefficients =
      p.coefficients + static_cast<int64_t>(row) * p.capacity_chunks * kChunk * rank;
  auto load_pair = [&](int pair, Bf16* target) {  // rows past total_rows come as zeros
    SkvLoadCoefficientTile(coefficients, rank, rank, kChunk, chunks, total_rows, 2 * pair, target,
                           a_pitch);
    SkvLoadCoefficientTile(coefficients, rank, rank, kChunk, chunks, total_rows, 2 * pair + 1,
                           target + 16 * a_pitch, a_pitch);
  };
  if (warp < num_pairs) load_pair(warp, a_ring);
  CpAsyncCommit();
  CpAsyncWait<1>();  // B_h and the queries
  __syncthreads();
  const int g = lane / 4, c2 = (lane % 4) * 2;
  int buffer = 0;
  for (int pair = warp; pair < num_pairs; pair += kWarps) {
    if constexpr (kPrefetch) {
      if (pair + kWarps < num_pairs) load_pair(pair + kWarps, a_ring + (buffer ^ 1) * 32 * a_pitch);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      if (pair != warp) {
        load_pair(pair, a_ring);
        CpAsyncCommit();
      }
      CpAsyncWait<0>();
    }
    __syncwarp();
    const Bf16* a_pair = a_ring + buffer * 32 * a_pitch;
    float acc[2][kHeadDim / 8][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.0f;
    }
    for (int k0 = 0; k0 < rank_padded; k0 += 16) {
      uint32_t a0[4], a1[4];
      LdMatrixX4(a0, a_pair + (lane & 15) * a_pitch + k0 + (lane >> 4) * 8);
      LdMatrixX4(a1, a_pair + (16 + (lane & 15)) * a_pitch + k0 + (lane >> 4) * 8);
#pragma unroll
      for (int n0 = 0; n0 < kHeadDim; n0 += 16) {
        uint32_t b[4];
        LdMatrixX4Trans(b, b_tile + (k0 + (lane & 15)) * pitch + n0 + (lane >> 4) * 8);
        MmaBf16(acc[0][n0 / 8], a0, b[0], b[1]);
        MmaBf16(acc[0][n0 / 8 + 1], a0, b[2], b[3]);
        MmaBf16(acc[1][n0 / 8], a1, b[0], b[1]);
        MmaBf16(acc[1][n0 / 8 + 1], a1, b[2], b[3]);
      }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int tile = 2 * pair + t;
#pragma unroll
      for (int half_row = 0; half_row < 2; ++half_row) {  // RoPE (halves), as SkvRebuildTile
        const int token_row = tile * 16 + g + 8 * half_row;
        const int which = min(token_row / kChunk, count - 1);
        const float at = static_cast<float>(chunks[which] * kChunk + token_row % kChunk);
        SkvRotateAccumulators<kHeadDim, true>(acc[t], half_row, at, inv_freq);
      }
      float qk[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
      if constexpr (kRegQk) {
#pragma unroll
        for (int kb = 0; kb < kHeadDim / 16; ++kb) {
          const uint32_t a[4] = {PackBf16(acc[t][2 * kb][0], acc[t][2 * kb][1]),
                                 PackBf16(acc[t][2 * kb][2], acc[t][2 * kb][3]),
                                 PackBf16(acc[t][2 * kb + 1][0], acc[t][2 * kb + 1][1]),
                                 PackBf16(acc[t][2 * kb + 1][2], acc[t][2 * kb + 1][3])};
          uint32_t b[4];
          LdMatrixX4(b, q_tile + ((lane >> 4) * 8 + (lane & 7)) * pitch + kb * 16 +
                            ((lane >> 3) & 1) * 8);
          MmaBf16(qk[0], a, b[0], b[1]);
          MmaBf16(qk[1], a, b[2], b[3]);
        }
      } else {
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
#pragma unroll
          for (int j = 0; j < kHeadDim / 8; ++j) {
            *reinterpret_cast<uint32_t*>(key_tile + (g + 8 * half_row) * pitch + j * 8 + c2) =
                PackBf16(acc[t][j][2 * half_row], acc[t][j][2 * half_row + 1]);
          }
        }
        __syncwarp();
#pragma unroll
        for (int k0 = 0; k0 < kHeadDim; k0 += 16) {
          uint32_t a[4], b[4];
          LdMatrixX4(a, key_tile + (lane & 15) * pitch + k0 + (lane >> 4) * 8);
          LdMatrixX4(b, q_tile + ((lane >> 4) * 8 + (lane & 7)) * pitch + k0 + ((lane >> 3) & 1) * 8);
          MmaBf16(qk[0], a, b[0], b[1]);
          MmaBf16(qk[1], a, b[2], b[3]);
        }
        __syncwarp();  // the key tile takes the next tile
      }
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token_row = tile * 16 + g + 8 * (e >> 1), head = nb * 8 + c2 + (e & 1);
          if (token_row < total_rows && head < p.group)
            token_logits[token_row * p.group + head] = qk[nb][e] * p.scale;
        }
      }
    }
    if constexpr (kPrefetch) buffer ^= 1;
    __syncwarp();  // every lane has read this pair's A rows before they are replaced
  }
  CpAsyncWait<0>();
  __syncthreads();
  WriteChunkLse(p, token_logits, count, first, h, row);
}

// Median microseconds of 20 launches of `kernel` (after 3 warm-ups).
float TimeKernel(void (*kernel)(Params), const Params& p, int64_t bytes) {
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
  const dim3 grid((p.max_candidates + kChunks - 1) / kChunks, p.kv_heads, p.rows);
  for (int i = 0; i < 3; ++i) kernel<<<grid, kWarps * 32, bytes>>>(p);
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) {
    cudaEventRecord(start);
    kernel<<<grid, kWarps * 32, bytes>>>(p);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] * 1e3f;
}

template <int kHeadDim, int kRope, int kProduct, bool kStageAll = false>
float Time(const Params& p, int64_t bytes) {
  return TimeKernel(LabKernel<kHeadDim, kRope, kProduct, kStageAll>, p, bytes);
}

template <int kHeadDim>
void Run(const char* name, int kv_heads, int group, int rank, int rows, int candidates) {
  const int capacity = 4096;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  auto random_bf16 = [&](int64_t n) {
    std::vector<Bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(uniform(rng));
    return v;
  };
  const int64_t coef_n = int64_t{rows} * capacity * kChunk * rank;
  const int64_t basis_n = int64_t{rows} * rank * kv_heads * kHeadDim;
  const int64_t q_n = int64_t{rows} * kv_heads * group * kHeadDim;
  std::vector<int> list(int64_t{rows} * kv_heads * candidates);
  for (size_t i = 0; i < list.size(); ++i) list[i] = static_cast<int>((i * 7919) % capacity);
  for (int64_t r = 0; r < int64_t{rows} * kv_heads; ++r) {
    std::sort(list.begin() + r * candidates, list.begin() + (r + 1) * candidates);
  }
  std::vector<float> freq(kHeadDim / 2);
  for (int i = 0; i < kHeadDim / 2; ++i) freq[i] = std::pow(10000.0f, -2.0f * i / kHeadDim);
  auto upload = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    T* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, v.size() * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  };
  Params p;
  p.coefficients = upload(random_bf16(coef_n));
  p.basis = upload(random_bf16(basis_n));
  p.queries = upload(random_bf16(q_n));
  p.candidates = upload(list);
  p.inv_freq = upload(freq);
  CHECK_CUDA(cudaMalloc(&p.lse, sizeof(float) * rows * kv_heads * group * candidates));
  p.rows = rows;
  p.kv_heads = kv_heads;
  p.group = group;
  p.rank = rank;
  p.capacity_chunks = capacity;
  p.max_candidates = candidates;
  p.scale = 0.125f;
  const int rank_padded = SkvRankPadded(rank), pitch = kHeadDim + 8;
  const int64_t bytes = 2 * (int64_t{rank_padded} * pitch + kHeads16 * pitch +
                             kWarps * (2 * 16 * (rank_padded + 8) + 16 * pitch)) +
                        4 * kChunks * kChunk * group;
  const double tokens = static_cast<double>(rows) * kv_heads * candidates * kChunk;
  const float full = Time<kHeadDim, 1, 1>(p, bytes);
  const float no_rope = Time<kHeadDim, 0, 1>(p, bytes);
  const float table_rope =
      Time<kHeadDim, 2, 1>(p, bytes + 4 * 2 * (kChunks + kChunk) * (kHeadDim / 2));
  const float no_product = Time<kHeadDim, 1, 0>(p, bytes);
  const float rebuild_only = Time<kHeadDim, 0, 0>(p, bytes);
  const float stage_all =
      Time<kHeadDim, 1, 1, true>(p, bytes + 2 * int64_t{kChunks} * kChunk * (rank_padded + 8));
  // The pair variants against the library's form (run again here: the variants above that skip
  // the product write placeholders): the same bf16 keys and products give the same log-sum-exps.
  const int64_t lse_n = int64_t{rows} * kv_heads * group * candidates;
  std::vector<float> want(lse_n), got(lse_n);
  CHECK_CUDA(cudaMemset(p.lse, 0, lse_n * sizeof(float)));
  Time<kHeadDim, 1, 1>(p, bytes);
  CHECK_CUDA(cudaMemcpy(want.data(), p.lse, lse_n * sizeof(float), cudaMemcpyDeviceToHost));
  auto pair_bytes = [&](bool reg_qk, bool prefetch) {
    return 2 * (int64_t{rank_padded} * pitch + kHeads16 * pitch +
                kWarps * ((prefetch ? 2 : 1) * 32 * (rank_padded + 8) + (reg_qk ? 0 : 16 * pitch))) +
           4 * kChunks * kChunk * group;
  };
  struct Variant {
    const char* name;
    void (*kernel)(Params);
    bool reg_qk, prefetch;
  };
  const Variant variants[] = {
      {"pair", PairKernel<kHeadDim, false, false>, false, false},
      {"pair+reg-qk", PairKernel<kHeadDim, true, false>, true, false},
      {"pair+prefetch", PairKernel<kHeadDim, false, true>, false, true},
      {"pair+reg-qk+prefetch", PairKernel<kHeadDim, true, true>, true, true}};
  std::string pairs;
  for (const Variant& v : variants) {
    CHECK_CUDA(cudaMemset(p.lse, 0, lse_n * sizeof(float)));
    const float us = TimeKernel(v.kernel, p, pair_bytes(v.reg_qk, v.prefetch));
    CHECK_CUDA(cudaMemcpy(got.data(), p.lse, lse_n * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int64_t i = 0; i < lse_n; ++i) worst = std::max(worst, double{std::fabs(got[i] - want[i])});
    char text[160];
    std::snprintf(text, sizeof(text), "; %s %.1f us (%.2f G tokens/s, %lld B shared, lse within %.1e)",
                  v.name, us, tokens / us * 1e-3,
                  static_cast<long long>(pair_bytes(v.reg_qk, v.prefetch)), worst);
    pairs += text;
  }
  std::printf(
      "%s rank %d rows %d candidates %d: a tile ahead %.1f us (%.2f G tokens/s), no RoPE %.1f, "
      "table RoPE %.1f, no query product or lse %.1f, A·B alone %.1f us; all rows at once %.1f "
      "us (%.2f G tokens/s)%s\n",
      name, rank, rows, candidates, full, tokens / full * 1e-3, no_rope, table_rope, no_product,
      rebuild_only, stage_all, tokens / stage_all * 1e-3, pairs.c_str());
}

int main() {
  Run<64>("qwen2.5-0.5b", 2, 7, 24, 64, 256);
  Run<64>("qwen2.5-0.5b", 2, 7, 64, 64, 512);
  Run<128>("llama3-8b", 8, 4, 160, 12, 512);
  Run<128>("llama3-8b", 8, 4, 32, 12, 512);
  return 0;
}
