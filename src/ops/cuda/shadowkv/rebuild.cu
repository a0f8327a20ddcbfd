// The second-version ShadowKV key rebuild (kSkvKernelsFast): keeps B_h in shared memory for a
// block of gather slots, pipelines the A rows with cp.async and applies RoPE to the mma
// accumulators in registers before one coalesced store per key row.
#include <cmath>
#include <cstdlib>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/common/kernel_attributes.h"
#include "ops/cuda/common/mma_utils.cuh"
#include "ops/cuda/shadowkv/rebuild_tile.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"

namespace shadowkv::cuda {
namespace {

using Bf16 = __nv_bfloat16;

// ---- key rebuild ------------------------------------------------------------------------------

constexpr int kRebuildWarps = 4;
// Gather slots per block (the basis is staged once for these), both fast kernels: 32 by
// default, which the kernel bench measured fastest for the first of them on the H200 (more,
// shorter blocks: no half-empty last wave); SkvDecodeParams::rebuild_slots
// = 64 or 128 takes more per block.
constexpr int kRebuildSlotsDefault = 32;
int RebuildSlots(int asked) { return asked == 64 || asked == 128 ? asked : kRebuildSlotsDefault; }


// A rebuild block's shared list of its missed gather slots, and the rotary frequencies.
template <int kSlots, int kHeadDim>
struct MissList {
  int slots[kSlots], chunks[kSlots], warp_counts[kSlots / 32];
  float inv_freq[kHeadDim / 2];
};

// The missed slots among the block's kSlots gather slots of (row, KV head), compacted in slot
// order into list.slots / list.chunks[0, count); also stages list.inv_freq. Returns count (the
// same in every thread). Contains a barrier; the lists need another before other threads read
// them.
template <int kSlots, int kHeadDim>
__device__ __forceinline__ int CompactMisses(const SkvDecodeParams& p, int row, int h,
                                             MissList<kSlots, kHeadDim>& list) {
  constexpr int kSlotWarps = kSlots / 32;
  const SkvLayout& l = p.layout;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* miss =
      p.miss_chunk + (static_cast<int64_t>(row) * l.num_kv_heads + h) * l.max_budget;
  int chunk = -1, slot = 0;
  unsigned ballot = 0;
  if (warp < kSlotWarps) {
    slot = blockIdx.x * kSlots + threadIdx.x;
    chunk = slot < l.max_budget ? miss[slot] : -1;
    ballot = __ballot_sync(0xffffffffu, chunk >= 0);
    if (lane == 0) list.warp_counts[warp] = __popc(ballot);
  }
  for (int i = threadIdx.x; i < kHeadDim / 2; i += blockDim.x) list.inv_freq[i] = p.inv_freq[i];
  __syncthreads();
  int count = 0, before = 0;
#pragma unroll
  for (int w = 0; w < kSlotWarps; ++w) {
    before += w < warp ? list.warp_counts[w] : 0;
    count += list.warp_counts[w];
  }
  if (chunk >= 0) {
    const int at = before + __popc(ballot & ((1u << lane) - 1u));
    list.slots[at] = slot;
    list.chunks[at] = chunk;
  }
  return count;
}

// One block per (kSlots slots, KV head, row). Shared: B_h [rank_padded, D + 8], per warp two A
// tiles [16, rank_padded + 8] (cp.async ring) and one output tile [16, D + 8] bf16; each warp
// rebuilds 16-row tiles (SkvRebuildTile) and stores them into the gather slots.
template <int kHeadDim, bool kHalves, int kSlots>
__global__ void __launch_bounds__(kRebuildWarps * 32) SkvRebuildFastKernel(SkvDecodeParams p) {
  static_assert(kSlots % 32 == 0 && kSlots <= kRebuildWarps * 32, "one thread per slot");
  extern __shared__ __align__(16) unsigned char rebuild_shared[];
  __shared__ MissList<kSlots, kHeadDim> misses;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int count = CompactMisses(p, row, h, misses);
  if (count == 0) return;

  const SkvRowMeta m = p.meta[row];
  const SkvSequenceInfo info = l.info[m.seq];
  // The layer's own rank sizes the tiles and the products (shared memory is sized for l.rank,
  // the most); A's rows and B keep the stride of l.rank.
  const int width = l.kv_width(), chunk_size = l.chunk_size, rank = l.RankOf(m.seq, p.layer);
  const int64_t stride = l.rank;
  const int rank_padded = SkvRankPadded(rank);
  const int a_pitch = rank_padded + 8, b_pitch = kHeadDim + 8, out_pitch = kHeadDim + 8;
  const int64_t layer_index = static_cast<int64_t>(m.seq) * l.num_layers + p.layer;
  Bf16* b_tile = reinterpret_cast<Bf16*>(rebuild_shared);
  Bf16* a_ring = b_tile + rank_padded * b_pitch + warp * 2 * 16 * a_pitch;
  Bf16* out_tile =
      b_tile + rank_padded * b_pitch + kRebuildWarps * 2 * 16 * a_pitch + warp * 16 * out_pitch;
  SkvStageBasis<kHeadDim>(l.basis + layer_index * stride * width + h * kHeadDim, width, rank,
                          b_tile, b_pitch);
  CpAsyncCommit();
  __syncthreads();  // miss lists visible

  const Bf16* coefficients = l.coefficients + layer_index * l.capacity_chunks * chunk_size * stride;
  const int total_rows = count * chunk_size;
  const int num_tiles = (total_rows + 15) / 16;
  auto load_tile = [&](int tile, Bf16* target) {
    SkvLoadCoefficientTile(coefficients, stride, rank, chunk_size, misses.chunks, total_rows,
                           tile, target, a_pitch);
  };
  if (warp < num_tiles) load_tile(warp, a_ring);
  CpAsyncCommit();
  CpAsyncWait<1>();  // this thread's share of B_h has landed (groups complete in order)
  __syncthreads();

  Bf16* keys = l.attn.keys + l.attn.HeadOffset(m.seq, p.layer, h) +
               static_cast<int64_t>(info.gather_base) * kHeadDim;
  int buffer = 0;
  for (int tile = warp; tile < num_tiles; tile += kRebuildWarps, buffer ^= 1) {
    if (tile + kRebuildWarps < num_tiles) {
      load_tile(tile + kRebuildWarps, a_ring + (buffer ^ 1) * 16 * a_pitch);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncwarp();  // this warp's tile has landed
    // RoPE at each row's own position (rows past the last chunk take its position and are not
    // stored), then bf16 into the output tile.
    auto position = [&](int r) {
      const int token_row = tile * 16 + r;
      const int which = min(token_row / chunk_size, count - 1), t = token_row % chunk_size;
      return static_cast<float>(misses.chunks[which] * chunk_size + t);
    };
    SkvRebuildTile<kHeadDim, kHalves>(a_ring + buffer * 16 * a_pitch, a_pitch, b_tile, b_pitch,
                                      rank_padded, misses.inv_freq, position, out_tile,
                                      out_pitch);
    // One 16-byte store per lane and step: whole key rows of the chunk's gather slot.
    for (int i = lane; i < 16 * (kHeadDim / 8); i += 32) {
      const int r = i / (kHeadDim / 8), v = i % (kHeadDim / 8);
      const int token_row = tile * 16 + r;
      if (token_row >= total_rows) continue;
      const int which = token_row / chunk_size, t = token_row % chunk_size;
      *reinterpret_cast<uint4*>(
          keys + (static_cast<int64_t>(misses.slots[which]) * chunk_size + t) * kHeadDim + v * 8) =
          *reinterpret_cast<const uint4*>(out_tile + r * out_pitch + v * 8);
    }
    __syncwarp();
  }
  CpAsyncWait<0>();
}


// ---- key rebuild with the basis in registers (head_dim 128) -----------------------------------
//
// The keys of a chunk, transposed: Kᵀ[d, t] = Σ_k B_h[k, d] · A[t, k], one m16n8k16 product per
// 16 dims and 16 of the rank with the chunk's 8 tokens as the mma's N. Each warp keeps its 32
// dims of B_hᵀ as A-operand fragments in registers for the whole block (kKSteps·8 registers),
// so the basis is read from shared memory once per block instead of once per 16-row tile; the
// chunks' A rows are staged through shared memory in groups of kGroupChunks (cp.async, double
// buffered) and every warp reads them as its B operand. The rotated keys go through a shared
// tile [chunk, token, dim] to one coalesced 16-byte store per piece of a key row.
// Dims per warp: the rotary pairs 16w..16w+15, as the same row of its two m-tiles (kHalves: dims
// i and i + 64; kPairs: dims 2i and 2i + 1), so each lane rotates its own accumulators. The
// fragments are gathered from the staged basis element by element, once per block.
constexpr int kRegWarps = 4;
constexpr int kRegGroupChunks = 8;  // chunks staged and computed together

__host__ __device__ constexpr int RegAPitch(int k_steps) { return k_steps * 16 + 8; }  // bf16
constexpr int kRegOutPitch = 128 + 8;                                                   // bf16

__host__ __device__ constexpr int64_t RegSharedBytes(int k_steps) {
  // The basis [rank_padded, 128 + 8] while fragments are loaded; then two groups of A rows.
  const int64_t basis = int64_t{k_steps} * 16 * (128 + 8) * 2;
  const int64_t staged = 2ll * kRegGroupChunks * 8 * RegAPitch(k_steps) * 2;
  const int64_t out = int64_t{kRegGroupChunks} * 8 * kRegOutPitch * 2;
  return (basis > staged ? basis : staged) + out;
}

template <bool kHalves, int kKSteps, int kSlots>
__global__ void __launch_bounds__(kRegWarps * 32) SkvRebuildRegKernel(SkvDecodeParams p) {
  static_assert(kSlots % 32 == 0 && kSlots <= kRegWarps * 32, "one thread per slot");
  constexpr int kHeadDim = 128;
  constexpr int kAPitch = RegAPitch(kKSteps);
  extern __shared__ __align__(16) unsigned char rebuild_shared[];
  __shared__ MissList<kSlots, kHeadDim> misses;
  const SkvLayout& l = p.layout;
  const int h = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int count = CompactMisses(p, row, h, misses);
  if (count == 0) return;
  __syncthreads();  // the miss list is visible

  const SkvRowMeta m = p.meta[row];
  const SkvSequenceInfo info = l.info[m.seq];
  // The layer's own rank: the products stop at its 16-wide steps (kKSteps is the cap's); A's
  // rows and B keep the stride of l.rank.
  const int width = l.kv_width(), chunk_size = l.chunk_size, rank = l.RankOf(m.seq, p.layer);
  const int64_t stride = l.rank;
  const int steps = SkvRankPadded(rank) / 16;
  const int64_t layer_index = static_cast<int64_t>(m.seq) * l.num_layers + p.layer;
  Bf16* staging = reinterpret_cast<Bf16*>(rebuild_shared);
  Bf16* out_tile = reinterpret_cast<Bf16*>(rebuild_shared + RegSharedBytes(kKSteps) -
                                           int64_t{kRegGroupChunks} * 8 * kRegOutPitch * 2);

  // 1. B_h [rank_padded, 128] into shared (rows past the rank zero), then each warp's fragments.
  {
    constexpr int kBPitch = kHeadDim + 8;
    const Bf16* basis = l.basis + layer_index * stride * width + h * kHeadDim;
    for (int i = threadIdx.x; i < steps * 16 * (kHeadDim / 8); i += blockDim.x) {
      const int k = i / (kHeadDim / 8), v = i % (kHeadDim / 8);
      const bool inside = k < rank;
      CpAsync16(staging + k * kBPitch + v * 8,
                inside ? basis + static_cast<int64_t>(k) * width + v * 8 : basis, inside ? 16 : 0);
    }
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
  }
  // Fragments of B_hᵀ: row r of m-tile mt is dim DimOf(mt, r); element (r, k) = B_h[k, dim].
  auto dim_of = [&](int mt, int r) {
    return kHalves ? 64 * mt + 16 * warp + r : 2 * (16 * warp + r) + mt;
  };
  uint32_t frag[2][kKSteps][4];
  {
    constexpr int kBPitch = kHeadDim + 8;
    const int g = lane / 4, c = lane % 4;
    auto pair = [&](int k, int dim) {
      const uint32_t low = *reinterpret_cast<const uint16_t*>(staging + k * kBPitch + dim);
      const uint32_t high = *reinterpret_cast<const uint16_t*>(staging + (k + 1) * kBPitch + dim);
      return low | (high << 16);
    };
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        if (ks >= steps) break;
        const int k = ks * 16 + 2 * c;
        frag[mt][ks][0] = pair(k, dim_of(mt, g));
        frag[mt][ks][1] = pair(k, dim_of(mt, g + 8));
        frag[mt][ks][2] = pair(k + 8, dim_of(mt, g));
        frag[mt][ks][3] = pair(k + 8, dim_of(mt, g + 8));
      }
    }
  }
  __syncthreads();  // the basis region is reused for the A rows

  const Bf16* coefficients = l.coefficients + layer_index * l.capacity_chunks * chunk_size * stride;
  Bf16* keys = l.attn.keys + l.attn.HeadOffset(m.seq, p.layer, h) +
               static_cast<int64_t>(info.gather_base) * kHeadDim;
  const int groups = (count + kRegGroupChunks - 1) / kRegGroupChunks;
  const int pieces = steps * 2;  // 16-byte pieces of one A row (the layer's padded rank, bf16)
  auto stage = [&](int group) {
    Bf16* target = staging + (group & 1) * kRegGroupChunks * 8 * kAPitch;
    for (int i = threadIdx.x; i < kRegGroupChunks * 8 * pieces; i += blockDim.x) {
      const int r = i / pieces, v = i % pieces;  // r: chunk-in-group * 8 + token
      const int which = group * kRegGroupChunks + r / 8;
      const bool inside = which < count && v * 8 < rank;
      const Bf16* source = coefficients;
      if (inside) {
        source +=
            (static_cast<int64_t>(misses.chunks[which]) * chunk_size + r % 8) * stride + v * 8;
      }
      CpAsync16(target + r * kAPitch + v * 8, source, inside ? 16 : 0);
    }
    CpAsyncCommit();
  };
  stage(0);
  const int g = lane / 4, c = lane % 4;
  for (int group = 0; group < groups; ++group) {
    if (group + 1 < groups) stage(group + 1); else CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();  // group's rows visible; the previous group's stores are done
    const Bf16* rows = staging + (group & 1) * kRegGroupChunks * 8 * kAPitch;
    const int in_group = min(kRegGroupChunks, count - group * kRegGroupChunks);
    for (int j = 0; j < in_group; ++j) {
      const Bf16* a_rows = rows + j * 8 * kAPitch;
      float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        if (ks >= steps) break;
        // B operand: k = 16ks + 2c.., 16ks + 2c + 8.. of token g.
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(a_rows + g * kAPitch + ks * 16 + 2 * c);
        const uint32_t b1 =
            *reinterpret_cast<const uint32_t*>(a_rows + g * kAPitch + ks * 16 + 2 * c + 8);
        MmaBf16(acc[0], frag[0][ks], b0, b1);
        MmaBf16(acc[1], frag[1][ks], b0, b1);
      }
      // acc[mt]: (dim row g, token 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1).
      const int chunk_index = misses.chunks[group * kRegGroupChunks + j];
      Bf16* out = out_tile + j * 8 * kRegOutPitch;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // The pair (dim_of(0, r), dim_of(1, r)) of rotary pair index `pair_index`.
        const int token = 2 * c + (e & 1), r = g + 8 * (e >> 1);
        const int pair_index = 16 * warp + r;
        const float position = static_cast<float>(chunk_index * chunk_size + token);
        float sine, cosine;
        RopeSinCos(position * misses.inv_freq[pair_index], &sine, &cosine);
        const float x0 = acc[0][e], x1 = acc[1][e];
        const float y0 = x0 * cosine - x1 * sine, y1 = x0 * sine + x1 * cosine;
        Bf16* key = out + token * kRegOutPitch;
        if constexpr (kHalves) {
          key[pair_index] = __float2bfloat16(y0);
          key[pair_index + 64] = __float2bfloat16(y1);
        } else {
          *reinterpret_cast<uint32_t*>(key + 2 * pair_index) = PackBf16(y0, y1);
        }
      }
    }
    __syncthreads();  // the group's keys are in the tile
    for (int i = threadIdx.x; i < in_group * 8 * (kHeadDim / 8); i += blockDim.x) {
      const int r = i / (kHeadDim / 8), v = i % (kHeadDim / 8);  // r: chunk-in-group * 8 + token
      const int which = group * kRegGroupChunks + r / 8;
      *reinterpret_cast<uint4*>(
          keys + (static_cast<int64_t>(misses.slots[which]) * chunk_size + r % 8) * kHeadDim + v * 8) =
          *reinterpret_cast<const uint4*>(out_tile + r * kRegOutPitch + v * 8);
    }
  }
  CpAsyncWait<0>();
}

int64_t RebuildFastSharedBytes(int rank, int head_dim) {
  const int rank_padded = SkvRankPadded(rank);
  return 2ll *
         (static_cast<int64_t>(rank_padded) * (head_dim + 8) +
          kRebuildWarps * 2ll * 16 * (rank_padded + 8) + kRebuildWarps * 16ll * (head_dim + 8));
}

template <int kSlots>
const void* RebuildFastKernelOf(int head_dim, bool halves) {
  if (head_dim == 256) {
    return halves ? reinterpret_cast<const void*>(SkvRebuildFastKernel<256, true, kSlots>)
                  : reinterpret_cast<const void*>(SkvRebuildFastKernel<256, false, kSlots>);
  }
  if (head_dim == 96) {
    return halves ? reinterpret_cast<const void*>(SkvRebuildFastKernel<96, true, kSlots>)
                  : reinterpret_cast<const void*>(SkvRebuildFastKernel<96, false, kSlots>);
  }
  if (head_dim == 128) {
    return halves ? reinterpret_cast<const void*>(SkvRebuildFastKernel<128, true, kSlots>)
                  : reinterpret_cast<const void*>(SkvRebuildFastKernel<128, false, kSlots>);
  }
  if (head_dim == 64) {
    return halves ? reinterpret_cast<const void*>(SkvRebuildFastKernel<64, true, kSlots>)
                  : reinterpret_cast<const void*>(SkvRebuildFastKernel<64, false, kSlots>);
  }
  return nullptr;
}

const void* RebuildFastKernel(int head_dim, bool halves, int slots) {
  switch (RebuildSlots(slots)) {
    case 64: return RebuildFastKernelOf<64>(head_dim, halves);
    case 128: return RebuildFastKernelOf<128>(head_dim, halves);
    default: return RebuildFastKernelOf<kRebuildSlotsDefault>(head_dim, halves);
  }
}

// The register-basis kernel for (halves, rank steps), or null where it does not apply: head_dim
// 128, chunks of 8 tokens (the mma's N), rank padded to 80 or 160.
template <int kSlots>
const void* RebuildRegKernelOf(int k_steps, bool halves) {
  switch (k_steps) {
    case 5: return halves ? reinterpret_cast<const void*>(SkvRebuildRegKernel<true, 5, kSlots>)
                          : reinterpret_cast<const void*>(SkvRebuildRegKernel<false, 5, kSlots>);
    case 10: return halves ? reinterpret_cast<const void*>(SkvRebuildRegKernel<true, 10, kSlots>)
                           : reinterpret_cast<const void*>(SkvRebuildRegKernel<false, 10, kSlots>);
    default: return nullptr;
  }
}

const void* RebuildRegKernel(const SkvLayout& l, bool halves, int slots) {
  if (l.head_dim != 128 || l.chunk_size != 8) return nullptr;
  const int k_steps = SkvRankPadded(l.rank) / 16;
  switch (RebuildSlots(slots)) {
    case 64: return RebuildRegKernelOf<64>(k_steps, halves);
    case 128: return RebuildRegKernelOf<128>(k_steps, halves);
    default: return RebuildRegKernelOf<kRebuildSlotsDefault>(k_steps, halves);
  }
}

}  // namespace

bool SkvRebuildFastApplies(const SkvDecodeParams& p) {
  return p.rotary_dim == p.layout.head_dim &&
         RebuildFastKernel(p.layout.head_dim, p.halves, p.rebuild_slots);
}

cudaError_t SkvConfigureRebuildFast(const SkvLayout& l) {
  for (bool halves : {false, true}) {
    for (int slots : {32, 64, 128}) {
      if (const void* rebuild = RebuildRegKernel(l, halves, slots)) {
        const cudaError_t e = AllowDynamicSharedMemory(rebuild, static_cast<int>(RegSharedBytes(SkvRankPadded(l.rank) / 16)));
        if (e != cudaSuccess) return e;
      }
    }
  }
  const int64_t bytes = RebuildFastSharedBytes(l.rank, l.head_dim);
  for (bool halves : {false, true}) {
    for (int slots : {32, 64, 128}) {
      if (const void* rebuild = RebuildFastKernel(l.head_dim, halves, slots)) {
        const cudaError_t e = AllowDynamicSharedMemory(rebuild, static_cast<int>(bytes));
        if (e != cudaSuccess) return e;
      }
    }
  }
  return cudaSuccess;
}

int64_t SkvRebuildFastSharedBytes(int rank, int head_dim) {
  return RebuildFastSharedBytes(rank, head_dim);
}

cudaError_t LaunchSkvRebuildFast(const SkvDecodeParams& p, cudaStream_t stream) {
  const SkvLayout& l = p.layout;
  if (const void* kernel = RebuildRegKernel(l, p.halves, p.rebuild_slots)) {
    const int slots = RebuildSlots(p.rebuild_slots);
    const dim3 grid((l.max_budget + slots - 1) / slots, l.num_kv_heads, p.rows);
    SkvDecodeParams params = p;
    void* args[] = {&params};
    return cudaLaunchKernel(kernel, grid, dim3(kRegWarps * 32), args,
                            static_cast<size_t>(RegSharedBytes(SkvRankPadded(l.rank) / 16)), stream);
  }
  const void* kernel = RebuildFastKernel(l.head_dim, p.halves, p.rebuild_slots);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int slots = RebuildSlots(p.rebuild_slots);
  const dim3 grid((l.max_budget + slots - 1) / slots, l.num_kv_heads, p.rows);
  SkvDecodeParams params = p;
  void* args[] = {&params};
  return cudaLaunchKernel(kernel, grid, dim3(kRebuildWarps * 32), args,
                          static_cast<size_t>(RebuildFastSharedBytes(l.rank, l.head_dim)), stream);
}

}  // namespace shadowkv::cuda
