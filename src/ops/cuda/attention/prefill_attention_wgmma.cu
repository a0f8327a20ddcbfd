// The Hopper (sm_90a, wgmma) prefill attention kernel, which prefill_attention.cu's launcher runs
// for head dim 128 where the build has sm_90a code.
#include "ops/cuda/attention/prefill_attention_wgmma.cuh"

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/common/mma_utils.cuh"

namespace shadowkv::cuda {
namespace {

// A block is two warpgroups of 64 packed rows each sharing 64-key K/V tiles in a 3-stage
// cp.async ring. S = Q·Kᵀ is one m64n64 wgmma chain per
// warpgroup with Q and K read from shared memory; the scores become the register A operand of
// O += P·V (m64n128, V read transposed from shared memory). Q, K and V tiles use the 128-byte
// swizzle: each head_dim/64 block of a row is one 128-byte line, its 16-byte chunks permuted by
// the line index mod 8, and 8 lines form a 1024-byte atom. Head dim 128 only. A sliding window
// starts the tile loop at the first tile the block's lowest row sees and masks as the causal
// bound does.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ const int kWgmmaCompiled = 1;
#else
__device__ const int kWgmmaCompiled = 0;
#endif

constexpr int kWgRows = 64;               // packed rows per warpgroup
constexpr int kWgBlockRows = 2 * kWgRows;
constexpr int kWgThreads = 256;
constexpr int kWgKeys = 64;               // keys per tile
constexpr int kWgStages = 3;
constexpr int kWgQBytes = kWgBlockRows * 256;   // two 64-dim blocks of 128-byte lines
constexpr int kWgTileBytes = kWgKeys * 256;     // K or V of one tile
constexpr int kWgSharedBytes = kWgQBytes + 2 * kWgStages * kWgTileBytes + 1024;  // + alignment

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a swizzled [2][rows][128 B] tile.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk, int rows) {
  return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Shared-memory matrix descriptor, 128-byte swizzle; offsets in bytes.
__device__ __forceinline__ uint64_t SmemDescriptor(uint32_t address, uint32_t leading,
                                                   uint32_t stride) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((leading >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaWaitAll() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Pins a register between asynchronous wgmma accesses (the compiler does not see those).
template <int kCount>
__device__ __forceinline__ void FenceRegisters(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// d[32] (+)= A (shared, descriptor) · B (shared, descriptor): m64n64k16, bf16 -> fp32.
__device__ __forceinline__ void WgmmaM64N64SS(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

// d[64] += A (registers, mma.sync A layout per warp) · B (shared, descriptor, MN-major):
// m64n128k16, bf16 -> fp32.
__device__ __forceinline__ void WgmmaM64N128RS(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#endif

__global__ void __launch_bounds__(kWgThreads, 1) PrefillWgmmaKernel(PrefillAttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = 128;
  extern __shared__ uint8_t shared_raw[];
  const uint32_t raw_address = SharedAddress(shared_raw);
  const uint32_t base = (raw_address + 1023) & ~1023u;  // the swizzle atoms need 1024 B alignment
  uint8_t* shared = shared_raw + (base - raw_address);
  const uint32_t q_address = base;
  auto k_address = [&](int stage) { return base + kWgQBytes + stage * 2 * kWgTileBytes; };
  auto v_address = [&](int stage) { return k_address(stage) + kWgTileBytes; };

  const PrefillSequence seq = p.sequences[blockIdx.z];
  const int kv_head = blockIdx.y;
  const int group = p.num_query_heads / p.num_kv_heads;
  const int packed_rows = seq.num_queries * group;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kWgBlockRows;  // heaviest tiles start first
  if (row0 >= packed_rows) return;
  const int warpgroup = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int64_t q_width = static_cast<int64_t>(p.num_query_heads) * kHeadDim;
  const int64_t head_offset = p.cache.HeadOffset(seq.slot, p.layer, kv_head);
  const __nv_bfloat16* keys = p.cache.keys + head_offset;
  const __nv_bfloat16* values = p.cache.values + head_offset;
  const int last_packed = min(packed_rows, row0 + kWgBlockRows) - 1;
  const int num_keys = seq.first_position + last_packed / group + 1;
  const int num_tiles = (num_keys + kWgKeys - 1) / kWgKeys;
  const int min_position = seq.first_position + row0 / group;
  const int max_position = num_keys - 1;
  // With a sliding window, keys below the lowest row's window are seen by no row of the block.
  const int first_tile = p.window > 0 ? max(0, min_position - p.window + 1) / kWgKeys : 0;

  auto load_tile = [&](int tile) {
    if (tile < num_tiles) {
      const int stage = tile % kWgStages, key0 = tile * kWgKeys;
      for (int index = threadIdx.x; index < kWgKeys * 16; index += kWgThreads) {
        const int r = index / 16, chunk = index % 16;
        const int key = key0 + r;
        const int64_t offset = static_cast<int64_t>(key < num_keys ? key : 0) * kHeadDim + chunk * 8;
        const int bytes = key < num_keys ? 16 : 0;  // zeros past the last key, never garbage
        const uint32_t at = SwizzledOffset(r, chunk, kWgKeys);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(k_address(stage) + at),
                     "l"(keys + offset), "r"(bytes)
                     : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(v_address(stage) + at),
                     "l"(values + offset), "r"(bytes)
                     : "memory");
      }
    }
    CpAsyncCommit();  // possibly empty: keeps the group count uniform
  };
  load_tile(first_tile);
  load_tile(first_tile + 1);

  for (int index = threadIdx.x; index < kWgBlockRows * 16; index += kWgThreads) {
    const int r = index / 16, chunk = index % 16;
    const int packed = row0 + r;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (packed < packed_rows) {
      const int token = packed / group, head = kv_head * group + packed % group;
      value = *reinterpret_cast<const uint4*>(p.queries + (seq.first_row + token) * q_width +
                                              head * kHeadDim + chunk * 8);
    }
    *reinterpret_cast<uint4*>(shared + SwizzledOffset(r, chunk, kWgBlockRows)) = value;
  }

  // This thread's rows: warpgroup * 64 + warp * 16 + lane / 4 (+ 8).
  const int row_low = row0 + warpgroup * kWgRows + warp * 16 + lane / 4, row_high = row_low + 8;
  const int position_low = seq.first_position + row_low / group;
  const int position_high = seq.first_position + row_high / group;
  const float score_scale = p.scale * kLog2e;

  float out[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) out[i] = 0.0f;
  float max_low = -INFINITY, max_high = -INFINITY, sum_low = 0.0f, sum_high = 0.0f;
  const uint32_t q_rows = q_address + warpgroup * kWgRows * 128;

  for (int tile = first_tile; tile < num_tiles; ++tile) {
    CpAsyncWait<1>();  // this thread's copies of `tile` landed (only tile + 1 may be pending)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the wgmma
    __syncthreads();
    const int stage = tile % kWgStages, key0 = tile * kWgKeys;

    float score[32];
    FenceRegisters(score);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half = kk / 4 * kWgBlockRows * 128, within = kk % 4 * 32;
      const uint64_t a = SmemDescriptor(q_rows + half + within, 16, 1024);
      const uint64_t b =
          SmemDescriptor(k_address(stage) + kk / 4 * kWgKeys * 128 + within, 16, 1024);
      WgmmaM64N64SS(score, a, b, kk > 0);
    }
    WgmmaCommit();
    WgmmaWaitAll();
    FenceRegisters(score);
    FenceRegisters(out);
    __syncthreads();    // every warpgroup is done with the stage the next copy overwrites
    load_tile(tile + 2);

    // Scores: n8 block nb holds keys key0 + 8 nb + 2 (lane % 4) + {0, 1}, rows low then high.
    // Causal: a key above some row's position; window: a key below some row's window.
    const bool needs_mask =
        key0 + kWgKeys - 1 > min_position || (p.window > 0 && key0 + p.window <= max_position);
    float tile_max_low = -INFINITY, tile_max_high = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nb * 8 + lane % 4 * 2 + (e & 1);
        float s = score[nb * 4 + e];
        const int position = e < 2 ? position_low : position_high;
        if (needs_mask && (key > position || (p.window > 0 && key + p.window <= position))) {
          s = -INFINITY;
        }
        score[nb * 4 + e] = s;
      }
      tile_max_low = fmaxf(tile_max_low, fmaxf(score[nb * 4], score[nb * 4 + 1]));
      tile_max_high = fmaxf(tile_max_high, fmaxf(score[nb * 4 + 2], score[nb * 4 + 3]));
    }
#pragma unroll
    for (int offset = 1; offset <= 2; offset <<= 1) {
      tile_max_low = fmaxf(tile_max_low, __shfl_xor_sync(0xffffffffu, tile_max_low, offset));
      tile_max_high = fmaxf(tile_max_high, __shfl_xor_sync(0xffffffffu, tile_max_high, offset));
    }
    const float new_max_low = fmaxf(max_low, tile_max_low);
    const float new_max_high = fmaxf(max_high, tile_max_high);
    const float base_low = new_max_low == -INFINITY ? 0.0f : new_max_low;
    const float base_high = new_max_high == -INFINITY ? 0.0f : new_max_high;
    const float correction_low = FastExp2((max_low - base_low) * score_scale);
    const float correction_high = FastExp2((max_high - base_high) * score_scale);
    max_low = new_max_low;
    max_high = new_max_high;
    const float offset_low = -base_low * score_scale, offset_high = -base_high * score_scale;
    float tile_sum_low = 0.0f, tile_sum_high = 0.0f;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      score[nb * 4] = FastExp2(fmaf(score[nb * 4], score_scale, offset_low));
      score[nb * 4 + 1] = FastExp2(fmaf(score[nb * 4 + 1], score_scale, offset_low));
      score[nb * 4 + 2] = FastExp2(fmaf(score[nb * 4 + 2], score_scale, offset_high));
      score[nb * 4 + 3] = FastExp2(fmaf(score[nb * 4 + 3], score_scale, offset_high));
      tile_sum_low += score[nb * 4] + score[nb * 4 + 1];
      tile_sum_high += score[nb * 4 + 2] + score[nb * 4 + 3];
    }
    sum_low = sum_low * correction_low + tile_sum_low;
    sum_high = sum_high * correction_high + tile_sum_high;
#pragma unroll
    for (int nb = 0; nb < 16; ++nb) {
      out[nb * 4] *= correction_low;
      out[nb * 4 + 1] *= correction_low;
      out[nb * 4 + 2] *= correction_high;
      out[nb * 4 + 3] *= correction_high;
    }

    uint32_t p_frag[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      p_frag[j][0] = PackBf16(score[8 * j], score[8 * j + 1]);
      p_frag[j][1] = PackBf16(score[8 * j + 2], score[8 * j + 3]);
      p_frag[j][2] = PackBf16(score[8 * j + 4], score[8 * j + 5]);
      p_frag[j][3] = PackBf16(score[8 * j + 6], score[8 * j + 7]);
    }
    FenceRegisters(out);
    WgmmaFence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // V as B, MN-major: keys 16 j.. along K, dims (contiguous) along N. Leading offset:
      // between the two 64-dim blocks; stride offset: between groups of 8 keys. (The exchanged
      // order was tried on the H200 and fails the parity tests.)
      const uint64_t b = SmemDescriptor(v_address(stage) + j * 16 * 128, kWgKeys * 128, 1024);
      WgmmaM64N128RS(out, p_frag[j], b);
    }
    WgmmaCommit();
    // Waiting here (not across the next tile's Q·Kᵀ) keeps ptxas from serializing the wgmmas
    // (C7515); the other warpgroup of the block fills the gap.
    WgmmaWaitAll();
    FenceRegisters(out);
  }

#pragma unroll
  for (int offset = 1; offset <= 2; offset <<= 1) {
    sum_low += __shfl_xor_sync(0xffffffffu, sum_low, offset);
    sum_high += __shfl_xor_sync(0xffffffffu, sum_high, offset);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int packed = half == 0 ? row_low : row_high;
    if (packed >= packed_rows) continue;
    const float inv = 1.0f / (half == 0 ? sum_low : sum_high);
    const int token = packed / group, head = kv_head * group + packed % group;
    __nv_bfloat16* dest = p.out + (seq.first_row + token) * q_width + head * kHeadDim;
#pragma unroll
    for (int nb = 0; nb < 16; ++nb) {
      const int dim = nb * 8 + lane % 4 * 2;
      *reinterpret_cast<__nv_bfloat162*>(dest + dim) = __floats2bfloat162_rn(
          out[nb * 4 + 2 * half] * inv, out[nb * 4 + 2 * half + 1] * inv);
    }
  }
#endif
}

}  // namespace

bool PrefillWgmmaAvailable() {
  static const bool available = [] {
    int compiled = 0;
    return cudaMemcpyFromSymbol(&compiled, kWgmmaCompiled, sizeof(compiled)) == cudaSuccess &&
           compiled == 1;
  }();
  return available;
}

cudaError_t LaunchPrefillWgmma(const PrefillAttentionParams& p, int group, cudaStream_t stream) {
  auto kernel = PrefillWgmmaKernel;
  const cudaError_t configured =
      AllowDynamicSharedMemory(reinterpret_cast<const void*>(kernel), kWgSharedBytes);
  if (configured != cudaSuccess) return configured;
  const int64_t tiles = (static_cast<int64_t>(p.max_queries) * group + kWgBlockRows - 1) / kWgBlockRows;
  const dim3 grid(static_cast<unsigned>(tiles), p.num_kv_heads, p.num_sequences);
  kernel<<<grid, kWgThreads, kWgSharedBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
