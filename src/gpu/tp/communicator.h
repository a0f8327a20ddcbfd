// The tensor-parallel communicator seam: the one collective the sharded model needs (an in-place
// sum all-reduce of a device buffer, enqueued on a stream and capturable into a CUDA graph), with
// two implementations. Ranks are threads of one process, one communicator each.
//  - NCCL: one GPU per rank (devices 0..N-1), the communicators made together by ncclCommInitAll.
//    NCCL is loaded at run time (dlopen), so a binary without it still runs everything else.
//  - local: every rank on one device (NCCL refuses two ranks on one GPU), for testing and
//    measuring the sharded model on a single GPU. Each rank stages its buffer and sums every
//    rank's staged copy in rank order: outside graph capture in two kernels ordered by events
//    (the call returns once every rank has enqueued its stage), in a graph as one kernel that
//    meets the other ranks' kernels through flags in device memory.
// Every rank must issue the same collectives in the same order with the same sizes.
// Internal to the CUDA backend (CUDA types).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace shadowkv::cuda::tp {

enum class ReduceType { kFloat32, kBfloat16 };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  virtual int device() const = 0;     // the CUDA device this rank runs on
  virtual const char* kind() const = 0;  // "nccl" or "local"
  // Makes room for all-reduces of up to `bytes` (call on every rank before the first
  // all-reduce, outside any graph capture).
  virtual Status Reserve(int64_t bytes) = 0;
  // buffer[i] = sum over ranks of their buffer[i], for i < count, on every rank; enqueued on
  // `stream` (asynchronous, capturable).
  virtual Status AllReduceSum(void* buffer, int64_t count, ReduceType type,
                              cudaStream_t stream) = 0;
  // Returns once every rank has called it (host threads only; no GPU work), or with an error
  // once the group is aborted. Used where no rank may go on before all are there: after a graph
  // capture (the local communicator: no rank's graph may start, and spin in its all-reduce,
  // while another rank still captures or instantiates on the same GPU), and around a rank's
  // first GEMM of a shape (CudaModel::Impl::Gemm: cuBLAS loads kernels then).
  virtual Status HostBarrier() = 0;
  // Ends the collectives of every rank of the group, those in flight included, without their
  // result; later ones fail at once. For a rank that failed, so that the others, waiting for it
  // in an all-reduce, stop instead of hanging. Any thread; the group is unusable afterwards.
  virtual void Abort() = 0;

  // All-reduces this rank's host thread has issued so far (one captured into a graph counts
  // once, at capture). Any thread: after a step that stopped, the ranks' counts say which rank
  // is behind and where.
  int64_t issued() const { return issued_.load(std::memory_order_relaxed); }

 protected:
  int64_t CountIssued() { return issued_.fetch_add(1, std::memory_order_relaxed) + 1; }

 private:
  std::atomic<int64_t> issued_{0};
};

using Communicators = std::vector<std::unique_ptr<Communicator>>;

// `size` ranks all on device `device`. Always available.
Result<Communicators> CreateLocalCommunicators(int size, int device);

// One rank per device of `devices` (distinct). kUnsupported where NCCL cannot be loaded (the
// message says why) or fewer GPUs are present. Sets NCCL_NVLS_ENABLE=0 first: NVLink multicast
// stays off.
Result<Communicators> CreateNcclCommunicators(const std::vector<int>& devices);

// Whether NCCL can be loaded here; `why` (if not null) says why not.
bool NcclAvailable(std::string* why);

// Process-wide settings of tensor parallelism, set before any group is made (apps/ takes them
// from SHADOWKV_TP_TRACE, SHADOWKV_TP_STEP_TIMEOUT_S and SHADOWKV_NCCL_LIBRARY).
struct ProcessSettings {
  // Every rank's tasks and collectives written to stderr as they are issued (for finding where a
  // group stops).
  bool trace = false;
  // How long one forward or decode step of a group may take before it is taken for a hang and
  // the group aborted: far beyond a real step (seconds for a 70B prefill chunk at 244K), so it
  // never cuts one short. 0: wait forever.
  int step_timeout_s = 300;
  std::string nccl_library;  // tried first where libnccl is loaded (empty: the usual places)
};
ProcessSettings& MutableProcessSettings();
inline const ProcessSettings& Settings() { return MutableProcessSettings(); }

inline bool TraceEnabled() { return Settings().trace; }
inline void Trace(int rank, const std::string& what) {
  std::fprintf(stderr, "[tp] rank %d: %s\n", rank, what.c_str());
  std::fflush(stderr);
}

}  // namespace shadowkv::cuda::tp
