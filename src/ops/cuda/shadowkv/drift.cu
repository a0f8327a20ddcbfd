// ShadowKV selection reuse by query drift (kv::KvPolicyConfig select_drift): before a layer's
// scoring, each (decode row, KV head) decides whether it selects at this step or keeps the chunks
// its gather slots hold, by the CPU policy's rule (ShadowKvSequenceImpl::SelectsOnDrift): it
// selects where it never selected since the compression, where its last selection is
// select_interval decode steps old, or where one of its query heads' queries, taken back to
// position 0 (the rotary embedding undone), has a cosine below the sequence's threshold
// (SkvSequenceInfo::select_drift) with the query that head selected with last.
#include <cuda_bf16.h>

#include "ops/cuda/common/device_utils.cuh"
#include "ops/cuda/shadowkv/score_select_rebuild.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kDriftThreads = 128;
constexpr int kDriftWarps = kDriftThreads / 32;
constexpr int kDriftMaxWidth = kSkvMaxGroup * 256;  // the group's queries: heads × head_dim

// One block per (KV head, row). The group's queries are unrotated into shared memory (fp32, the
// pairs rotated back by the row's position as SkvRotatePair rotates them forward); each warp
// takes query heads w, w + 4, ...; the block's decision is the OR of theirs. A selecting head
// records its step and its unrotated queries; the counters count the head's step and, where it
// selects, its selection.
__global__ void __launch_bounds__(kDriftThreads) SkvDriftKernel(SkvDecodeParams p) {
  __shared__ float unrotated[kDriftMaxWidth];
  const SkvLayout& l = p.layout;
  const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const SkvRowMeta m = p.meta[row];
  const int d = l.head_dim, group = l.group, pairs = d / 2;
  const int64_t head = l.HeadIndex(m.seq, p.layer, h);
  const int step = m.position - l.info[m.seq].decode_origin;
  const int last = l.drift_step[head];
  const bool due = last < 0 || step - last >= p.select_interval;  // a compression sets -1

  const __nv_bfloat16* queries =
      p.queries + (static_cast<int64_t>(row) * l.num_kv_heads + h) * group * d;
  for (int i = tid; i < group * pairs; i += kDriftThreads) {
    const int g = i / pairs, pair = i % pairs;
    int a, b;
    SkvRopePairDims(pair, p.rotary_dim, p.halves, &a, &b);
    float x0 = __bfloat162float(queries[g * d + a]), x1 = __bfloat162float(queries[g * d + b]);
    if (pair < p.rotary_dim / 2) {
      SkvRotatePair(-static_cast<int64_t>(m.position), p.inv_freq[pair], &x0, &x1);
    }
    unrotated[g * d + a] = x0;
    unrotated[g * d + b] = x1;
  }
  __syncthreads();

  float* last_queries = l.drift_queries + head * group * d;
  int turned = 0;
  if (!due) {
    for (int g = warp; g < group; g += kDriftWarps) {
      float dot = 0.0f, now = 0.0f, then = 0.0f;
      for (int i = lane; i < d; i += 32) {
        const float a = unrotated[g * d + i], b = last_queries[g * d + i];
        dot += a * b;
        now += a * a;
        then += b * b;
      }
      dot = WarpSum(dot);
      now = WarpSum(now);
      then = WarpSum(then);
      const float cosine = now > 0.0f && then > 0.0f ? dot * rsqrtf(now * then) : 1.0f;
      turned |= cosine < l.info[m.seq].select_drift;
    }
  }
  const bool selects = __syncthreads_or(due || turned) != 0;
  if (selects) {
    for (int i = tid; i < group * d; i += kDriftThreads) last_queries[i] = unrotated[i];
  }
  if (tid == 0) {
    if (selects) l.drift_step[head] = step;
    p.head_keeps[static_cast<int64_t>(row) * l.num_kv_heads + h] = selects ? 0 : 1;
    if (unsigned long long* counters = l.SequenceCounters(m.seq)) {
      atomicAdd(&counters[2], 1ull);
      if (selects) atomicAdd(&counters[3], 1ull);
    }
  }
}

}  // namespace

cudaError_t LaunchSkvDrift(const SkvDecodeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const SkvLayout& l = p.layout;
  if (!p.head_keeps || !l.drift_step || !l.drift_queries || !p.inv_freq || p.select_interval < 1 ||
      l.group < 1 || l.group > kSkvMaxGroup || l.head_dim % 2 != 0 ||
      l.group * l.head_dim > kDriftMaxWidth) {
    return cudaErrorInvalidValue;
  }
  SkvDriftKernel<<<dim3(l.num_kv_heads, p.rows), kDriftThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace shadowkv::cuda
