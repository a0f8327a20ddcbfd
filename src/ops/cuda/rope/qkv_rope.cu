// QKV/RoPE kernel: one thread per (row, head, pair of elements); blocks of 256 threads along a
// row's pairs, so a decode step's few rows still spread over many multiprocessors. A head's
// pairs lie in whole warps of one block (or, for heads of up to 32 dims, in an aligned part of
// one warp), so the QK norm reduces over those warps (or lanes).
#include "ops/cuda/rope/qkv_rope.cuh"

#include "ops/cuda/common/device_utils.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) QkvRopeKernel(QkvRopeParams p) {
  const int row = blockIdx.x;
  const int index = blockIdx.y * kThreads + threadIdx.x;
  const int d = p.head_dim;
  const int half_dim = d / 2;
  const int rotary_half = p.rotary_dim / 2;
  const int num_heads = p.num_query_heads + 2 * p.num_kv_heads;  // q heads, k heads, v heads
  const int width = num_heads * d;
  const float* in = p.qkv + static_cast<int64_t>(row) * width;
  const int position = p.positions[row];
  const int slot = p.slots[row];
  const int cache_row = p.cache_rows ? p.cache_rows[row] : position;

  const bool active = index < num_heads * half_dim;
  {
    const int head = active ? index / half_dim : 0;
    const int pair = index % half_dim;
    const bool rotating_head = head < p.num_query_heads + p.num_kv_heads;  // q or k
    const bool rotates = rotating_head && pair < rotary_half;
    int a, b;  // the two elements of the head this thread handles
    if (rotates && p.halves) {
      a = pair;
      b = pair + rotary_half;
    } else if (rotating_head && p.halves) {  // pass-through tail [rotary_dim, head_dim)
      a = p.rotary_dim + 2 * (pair - rotary_half);
      b = a + 1;
    } else {
      a = 2 * pair;
      b = 2 * pair + 1;
    }
    const int column = head * d;
    float x0 = active ? in[column + a] : 0.0f;
    float x1 = active ? in[column + b] : 0.0f;
    if (p.bias && active) {
      x0 += p.bias[column + a];
      x1 += p.bias[column + b];
    }
    if (p.q_norm) {  // uniform over the grid, so every thread of the block reaches the barrier
      __shared__ float warp_sums[kThreads / 32];
      float sum = rotating_head && active ? x0 * x0 + x1 * x1 : 0.0f;
      float total = 0.0f;
      if (half_dim < 32) {
        // A head is an aligned group of half_dim lanes of one warp (half_dim divides 32).
        for (int offset = half_dim / 2; offset > 0; offset >>= 1) {
          sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        total = sum;
      } else {
        for (int offset = 16; offset > 0; offset >>= 1) {
          sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        const int warp = threadIdx.x / 32;
        if (threadIdx.x % 32 == 0) warp_sums[warp] = sum;
        __syncthreads();
        const int warps_per_head = half_dim / 32;
        const int first_warp = warp / warps_per_head * warps_per_head;
        for (int w = 0; w < warps_per_head; ++w) total += warp_sums[first_warp + w];
      }
      if (rotating_head) {
        const float* weight = head < p.num_query_heads ? p.q_norm : p.k_norm;
        const float inv = rsqrtf(total / static_cast<float>(d) + p.norm_eps);
        x0 *= inv * weight[a];
        x1 *= inv * weight[b];
      }
    }
    if (!active) return;
    if (p.keys_pre && head >= p.num_query_heads && head < p.num_query_heads + p.num_kv_heads) {
      const int pre_row = p.keys_pre_rows ? p.keys_pre_rows[row] : position;
      const int kv_width = p.num_kv_heads * d;
      __nv_bfloat16* pre =
          p.keys_pre +
          ((static_cast<int64_t>(slot) * p.cache.num_layers + p.layer) * p.keys_pre_capacity +
           pre_row) * kv_width +
          (head - p.num_query_heads) * d;
      pre[a] = __float2bfloat16(x0);
      pre[b] = __float2bfloat16(x1);
    }
    if (rotates) {
      // The angle is formed in fp32 exactly as the CPU Rope does; large positions keep their
      // precision (RopeSinCos reduces it exactly enough before the fast sincos).
      const float angle = static_cast<float>(position) * p.inv_freq[pair];
      float sine, cosine;
      RopeSinCos(angle, &sine, &cosine);
      const float r0 = x0 * cosine - x1 * sine;
      const float r1 = x0 * sine + x1 * cosine;
      x0 = r0;
      x1 = r1;
    }
    if (head < p.num_query_heads) {
      __nv_bfloat16* q = p.queries + static_cast<int64_t>(row) * p.num_query_heads * d + column;
      q[a] = __float2bfloat16(x0);
      q[b] = __float2bfloat16(x1);
    } else {
      const bool is_key = head < p.num_query_heads + p.num_kv_heads;
      const int kv_head = head - p.num_query_heads - (is_key ? 0 : p.num_kv_heads);
      __nv_bfloat16* dest = (is_key ? p.cache.keys : p.cache.values) +
                            p.cache.HeadOffset(slot, p.layer, kv_head) +
                            static_cast<int64_t>(cache_row) * d;
      dest[a] = __float2bfloat16(x0);
      dest[b] = __float2bfloat16(x1);
    }
  }
}

}  // namespace

bool QkvRopeNormSupports(int head_dim) {
  // A head's sum within one warp (half_dim a power of two below 32) or over whole warps of one
  // block (a multiple of 32 that divides the block).
  const int half_dim = head_dim / 2;
  if (head_dim <= 0 || head_dim % 2 != 0) return false;
  return half_dim < 32 ? 32 % half_dim == 0 : half_dim % 32 == 0 && kThreads % half_dim == 0;
}

cudaError_t LaunchQkvRope(const QkvRopeParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.rows < 0 || params.head_dim <= 0 || params.head_dim % 2 != 0 ||
      params.rotary_dim < 0 || params.rotary_dim % 2 != 0 || params.rotary_dim > params.head_dim) {
    return cudaErrorInvalidValue;
  }
  if ((params.q_norm == nullptr) != (params.k_norm == nullptr) ||
      (params.q_norm && !QkvRopeNormSupports(params.head_dim))) {
    return cudaErrorInvalidValue;
  }
  const int pairs = (params.num_query_heads + 2 * params.num_kv_heads) * (params.head_dim / 2);
  const dim3 grid(params.rows, (pairs + kThreads - 1) / kThreads);
  QkvRopeKernel<<<grid, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
