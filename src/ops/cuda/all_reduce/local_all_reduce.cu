// The single-device all-reduce: N ranks (threads with their own streams) on one GPU. An
// all-reduce is one kernel per rank; block b of every rank's kernel handles the same elements:
// it copies them into its rank's staging area, publishes a generation number, waits until block
// b of every other rank has published the same generation, then sums the staged copies in rank
// order (so every rank gets bit-identical sums) into its own buffer.
//
// Staging is double-buffered by generation parity. A rank can only start generation g + 2 (and
// overwrite the parity-g area) after its block b passed the barrier of generation g + 1, which
// every other rank's block b reaches only after it finished reading generation g: one barrier per
// all-reduce suffices. The waiting blocks spin, so the grid is kept small (kBlocks per rank) to
// leave the device to the kernels the other ranks still run before their all-reduce.
//
// Outside graph capture the same kernel runs in two launches instead (kStage, then kSum once
// events say every rank staged), and nothing spins: the parity argument is the same, with the
// events in place of the flags' barrier (a rank's kStage of g + 1 follows its kSum of g on its
// stream, and every kSum of g + 1 waits on every kStage of g + 1).
#include <cuda_bf16.h>

#include "ops/cuda/all_reduce/local_all_reduce.cuh"

namespace shadowkv::cuda::tp {
namespace {

constexpr int kBlocks = kLocalAllReduceBlocks;
constexpr int kThreads = 256;
// A rank that failed makes the group abort (the waiting blocks see p.abort); one that has not
// arrived after this long and did not abort never will (a bug elsewhere): trap rather than hang
// the device forever.
constexpr unsigned long long kTimeoutNs = 60ull * 1000 * 1000 * 1000;

__device__ __forceinline__ unsigned long long GlobalNanoseconds() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) LocalAllReduceKernel(LocalReduceParams p) {
  __shared__ unsigned int generation;
  unsigned int* own_flag = p.flags + p.rank * kBlocks + blockIdx.x;
  const bool stage = p.phase != LocalReducePhase::kSum;
  // kSum: the generation this rank's kStage published, earlier on the same stream.
  if (threadIdx.x == 0) {
    generation = *reinterpret_cast<volatile unsigned int*>(own_flag) + (stage ? 1u : 0u);
  }
  __syncthreads();
  const unsigned int gen = generation;
  auto stage_of = [&](int rank) {
    return reinterpret_cast<T*>(p.staging +
                                ((gen & 1u) * p.size + rank) * p.capacity_bytes);
  };
  T* buffer = static_cast<T*>(p.buffer);
  T* own_stage = stage_of(p.rank);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(kBlocks) * kThreads;
  if (stage) {
    for (int64_t i = first; i < p.count; i += stride) own_stage[i] = buffer[i];
    __threadfence();  // the staged values are visible device-wide before the flag says so
    __syncthreads();
    if (threadIdx.x == 0) atomicExch(own_flag, gen);
    if (p.phase == LocalReducePhase::kStage) return;
  }
  __shared__ int aborted;
  if (threadIdx.x == 0) aborted = 0;
  __syncthreads();
  if (p.phase == LocalReducePhase::kWhole && threadIdx.x < p.size) {
    const volatile unsigned int* flag = p.flags + threadIdx.x * kBlocks + blockIdx.x;
    const unsigned long long start = GlobalNanoseconds();
    // Wrap-safe "flag < gen".
    while (static_cast<int>(*flag - gen) < 0) {
      __nanosleep(64);
      if (*p.abort != 0) {
        aborted = 1;
        break;
      }
      if (GlobalNanoseconds() - start > kTimeoutNs) __trap();
    }
  }
  __syncthreads();
  if (aborted) return;
  __threadfence();
  for (int64_t i = first; i < p.count; i += stride) {
    float sum = 0.0f;
    for (int r = 0; r < p.size; ++r) sum += static_cast<float>(__ldcg(stage_of(r) + i));
    buffer[i] = static_cast<T>(sum);  // bf16: round to nearest even
  }
}

}  // namespace

cudaError_t LaunchLocalAllReduce(const LocalReduceParams& params, bool bf16,
                                 cudaStream_t stream) {
  if (params.size < 1 || params.size > kLocalAllReduceMaxRanks || params.count < 0) {
    return cudaErrorInvalidValue;
  }
  if (bf16) {
    LocalAllReduceKernel<__nv_bfloat16><<<kBlocks, kThreads, 0, stream>>>(params);
  } else {
    LocalAllReduceKernel<float><<<kBlocks, kThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

cudaError_t PreloadLocalAllReduce() {
  cudaFuncAttributes attributes;
  cudaError_t e = cudaFuncGetAttributes(&attributes, LocalAllReduceKernel<float>);
  if (e != cudaSuccess) return e;
  return cudaFuncGetAttributes(&attributes, LocalAllReduceKernel<__nv_bfloat16>);
}

}  // namespace shadowkv::cuda::tp
