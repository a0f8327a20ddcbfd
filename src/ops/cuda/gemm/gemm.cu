// Skinny GEMM kernel. A block owns 32 output features; its 8 warps split the input dimension in
// interleaved 32-wide chunks and meet in shared memory. Per chunk a lane loads 16 bytes of two
// weight rows per m-tile and 16 bytes of two x rows straight into mma.sync fragments: the order
// of the summed dims does not matter, so lane (g, c) = (lane/4, lane%4) takes dims 8c..8c+7 of
// the chunk for both operands (a quad reads 64 contiguous bytes of a row).
#include "ops/cuda/gemm/gemm.cuh"

#include "ops/cuda/common/mma_utils.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockOut = 32;  // two m16 tiles per warp
constexpr int kUnroll = 4;     // chunks in flight per warp

__device__ __forceinline__ uint4 Load16(const __nv_bfloat16* address) {
  return __ldg(reinterpret_cast<const uint4*>(address));
}

// acc += the chunk's two k16 steps (words 2k, 2k + 1 of every operand).
template <bool kTwoRowTiles>
__device__ __forceinline__ void MmaChunk(float (&acc)[2][2][4], const uint4 (&w)[2][2],
                                         const uint4 (&x)[2]) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t a[4] = {k == 0 ? w[mt][0].x : w[mt][0].z, k == 0 ? w[mt][1].x : w[mt][1].z,
                             k == 0 ? w[mt][0].y : w[mt][0].w, k == 0 ? w[mt][1].y : w[mt][1].w};
      MmaBf16(acc[mt][0], a, k == 0 ? x[0].x : x[0].z, k == 0 ? x[0].y : x[0].w);
      if (kTwoRowTiles) MmaBf16(acc[mt][1], a, k == 0 ? x[1].x : x[1].z, k == 0 ? x[1].y : x[1].w);
    }
  }
}

template <bool kTwoRowTiles>
__device__ __forceinline__ void LoadChunk(uint4 (&w)[2][2], uint4 (&x)[2],
                                          const __nv_bfloat16* const (&w_rows)[2][2],
                                          const __nv_bfloat16* const (&x_rows)[2], int64_t offset) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) w[mt][h] = Load16(w_rows[mt][h] + offset);
  }
  x[0] = Load16(x_rows[0] + offset);
  x[1] = kTwoRowTiles ? Load16(x_rows[1] + offset) : make_uint4(0, 0, 0, 0);
}

template <bool kTwoRowTiles>
__global__ void __launch_bounds__(kThreads) SkinnyGemmKernel(SkinnyGemmParams p) {
  __shared__ float partial[kWarps][kBlockOut][kSkinnyGemmMaxRows + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int out0 = blockIdx.x * kBlockOut;
  const int num_chunks = p.in / 32;
  // Weight rows out0 + 16 mt + g (+ 8) and x rows g (+ 8); rows past the end read the last
  // valid row instead (no branch): their results are never stored.
  const __nv_bfloat16* w_rows[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(out0 + 16 * mt + g + 8 * h, p.out - 1);
      w_rows[mt][h] = p.weight + static_cast<int64_t>(row) * p.in + 8 * c;
    }
  }
  const __nv_bfloat16* x_rows[2] = {p.x + static_cast<int64_t>(min(g, p.rows - 1)) * p.in + 8 * c,
                                    p.x + static_cast<int64_t>(min(g + 8, p.rows - 1)) * p.in + 8 * c};

  float acc[2][2][4] = {};  // [m-tile][n-tile (x rows 0-7, 8-15)][fragment]
  // Whole groups of kUnroll chunks per warp with every load issued before the first product,
  // then the remaining chunks one at a time.
  constexpr int kGroupChunks = kUnroll * kWarps;
  const int full_groups = num_chunks / kGroupChunks;
  for (int group = 0; group < full_groups; ++group) {
    uint4 w[kUnroll][2][2], x[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t offset = static_cast<int64_t>(group * kGroupChunks + u * kWarps + warp) * 32;
      LoadChunk<kTwoRowTiles>(w[u], x[u], w_rows, x_rows, offset);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) MmaChunk<kTwoRowTiles>(acc, w[u], x[u]);
  }
  for (int chunk = full_groups * kGroupChunks + warp; chunk < num_chunks; chunk += kWarps) {
    uint4 w[2][2], x[2];
    LoadChunk<kTwoRowTiles>(w, x, w_rows, x_rows, static_cast<int64_t>(chunk) * 32);
    MmaChunk<kTwoRowTiles>(acc, w, x);
  }

  // Fragment (mt, nt): rows (features) 16 mt + g (+8), columns (x rows) 8 nt + 2c (+1).
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      partial[warp][16 * mt + g][8 * nt + 2 * c] = acc[mt][nt][0];
      partial[warp][16 * mt + g][8 * nt + 2 * c + 1] = acc[mt][nt][1];
      partial[warp][16 * mt + g + 8][8 * nt + 2 * c] = acc[mt][nt][2];
      partial[warp][16 * mt + g + 8][8 * nt + 2 * c + 1] = acc[mt][nt][3];
    }
  }
  __syncthreads();
  for (int index = threadIdx.x; index < kBlockOut * kSkinnyGemmMaxRows; index += kThreads) {
    const int row = index / kBlockOut, feature = index % kBlockOut;  // consecutive threads: features
    const int out = out0 + feature;
    if (row >= p.rows || out >= p.out) continue;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += partial[w][feature][row];
    const int64_t at = static_cast<int64_t>(row) * p.out + out;
    if (p.bf16_output) {
      __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.y);
      if (p.beta != 0.0f) sum += p.beta * __bfloat162float(y[at]);
      y[at] = __float2bfloat16(sum);
    } else {
      float* y = static_cast<float*>(p.y);
      if (p.beta != 0.0f) sum += p.beta * y[at];
      y[at] = sum;
    }
  }
}

}  // namespace

bool SkinnyGemmSupports(int64_t rows, int64_t in, int64_t out) {
  return rows >= 1 && rows <= kSkinnyGemmMaxRows && in >= 32 && in % 32 == 0 && out >= 1 &&
         in <= (int64_t{1} << 30) && out <= (int64_t{1} << 30);
}

cudaError_t LaunchSkinnyGemm(const SkinnyGemmParams& p, cudaStream_t stream) {
  if (!SkinnyGemmSupports(p.rows, p.in, p.out)) return cudaErrorInvalidValue;
  const dim3 grid((p.out + kBlockOut - 1) / kBlockOut);
  if (p.rows > 8) {
    SkinnyGemmKernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    SkinnyGemmKernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
