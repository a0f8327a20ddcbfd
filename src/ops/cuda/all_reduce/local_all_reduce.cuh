// The single-device all-reduce kernel (see local_all_reduce.cu) behind the local communicator.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda::tp {

constexpr int kLocalAllReduceBlocks = 32;  // per rank; the flags hold one slot per block
constexpr int kLocalAllReduceMaxRanks = 64;

// What one launch does. kWhole: stage, publish, wait on the device for every rank's block, sum
// (capturable into a graph, but a rendezvous that spins: see local_communicator.cc). kStage:
// stage and publish only; kSum: sum what every rank staged at this rank's last published
// generation, once stream-ordered events say every rank's kStage has run.
enum class LocalReducePhase : int { kWhole, kStage, kSum };

struct LocalReduceParams {
  void* buffer;            // this rank's [count] fp32 or bf16, summed in place
  int64_t count;
  unsigned char* staging;  // [2][size][capacity_bytes], shared by the ranks
  int64_t capacity_bytes;
  unsigned int* flags;     // [size][kLocalAllReduceBlocks] last generation each block published
  int size;
  int rank;
  const volatile int* abort;  // host-mapped; non-zero: stop waiting and leave the buffer as is
  LocalReducePhase phase;
};

// Every rank launches it on its own stream with the same count; with kWhole it returns (on the
// device) when all ranks' kernels have met.
cudaError_t LaunchLocalAllReduce(const LocalReduceParams& params, bool bf16, cudaStream_t stream);

// Loads both kernel instances into the current context now (see CreateLocalCommunicators).
cudaError_t PreloadLocalAllReduce();

}  // namespace shadowkv::cuda::tp
