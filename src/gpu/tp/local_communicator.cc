// The single-device communicator: the ranks' shared staging area and flags, and each rank's
// all-reduce (the kernel is in local_all_reduce.cu).

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/group_barrier.h"
#include "gpu/tp/communicator.h"
#include "ops/cuda/all_reduce/local_all_reduce.cuh"
#include "ops/cuda/common/device_buffer.h"

namespace shadowkv::cuda::tp {
namespace {

// What the ranks of one group share.
struct LocalShared {
  int size = 0;
  int device = 0;
  std::mutex mutex;
  DeviceBuffer<unsigned char> staging;
  int64_t capacity_bytes = 0;
  DeviceBuffer<unsigned int> flags;
  // The abort word, in mapped pinned memory: the host sets it while kernels spin.
  volatile int* abort_host = nullptr;
  const volatile int* abort_device = nullptr;
  bool used = false;  // an all-reduce was enqueued: the staging area can no longer move
  std::unique_ptr<GroupBarrier> barrier;  // the ranks' host threads
  std::vector<cudaEvent_t> staged;        // per rank: its last kStage launch (eager all-reduces)
  ~LocalShared() {
    for (cudaEvent_t event : staged) (void)cudaEventDestroy(event);
    if (abort_host) (void)cudaFreeHost(const_cast<int*>(abort_host));
  }
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalShared> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}
  int size() const override { return shared_->size; }
  int rank() const override { return rank_; }
  int device() const override { return shared_->device; }
  const char* kind() const override { return "local"; }

  Status Reserve(int64_t bytes) override {
    LocalShared& s = *shared_;
    std::lock_guard<std::mutex> lock(s.mutex);
    const int64_t rounded = (bytes + 255) / 256 * 256;
    if (rounded <= s.capacity_bytes) return Status::Ok();
    if (s.used) {
      return Error(ErrorCode::kInternal, "local all-reduce of {} bytes after the staging area "
                   "({} bytes) was put to use", bytes, s.capacity_bytes);
    }
    SKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.device));
    SKV_RETURN_IF_ERROR(s.staging.Allocate(2 * s.size * rounded));
    s.capacity_bytes = rounded;
    return Status::Ok();
  }

  Status HostBarrier() override { return shared_->barrier->Arrive(); }

  void Abort() override {
    *shared_->abort_host = 1;
    shared_->barrier->Abort();
  }

  Status AllReduceSum(void* buffer, int64_t count, ReduceType type,
                      cudaStream_t stream) override {
    LocalShared& s = *shared_;
    if (*s.abort_host != 0) {
      return Error(ErrorCode::kInternal, "the tensor-parallel group was aborted");
    }
    const int64_t element = type == ReduceType::kFloat32 ? 4 : 2;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (count < 0 || count * element > s.capacity_bytes) {
        return Error(ErrorCode::kInternal, "local all-reduce of {} elements exceeds the {} bytes "
                     "reserved", count, s.capacity_bytes);
      }
      s.used = true;
    }
    const int64_t call = CountIssued();
    if (TraceEnabled()) Trace(rank_, fmt::format("local all-reduce {} of {} elements", call, count));
    LocalReduceParams p{buffer, count, s.staging.get(), s.capacity_bytes, s.flags.get(),
                        s.size, rank_, s.abort_device, LocalReducePhase::kWhole};
    const bool bf16 = type == ReduceType::kBfloat16;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) {
      // Into a graph: the one kernel that meets the others on the device.
      SKV_CUDA_RETURN_IF_ERROR(LaunchLocalAllReduce(p, bf16, stream));
      return Status::Ok();
    }
    // Eager: a rendezvous that spins on the device stops the group whenever a rank's kernel
    // waits in the same hardware queue behind work that waits on the all-reduce (the driver puts
    // the streams of a process on at most 32 queues). Stream-ordered events cannot stop it: a
    // wait only ever names a record already enqueued, which is ahead of it in any queue.
    p.phase = LocalReducePhase::kStage;
    SKV_CUDA_RETURN_IF_ERROR(LaunchLocalAllReduce(p, bf16, stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.staged[rank_], stream));
    SKV_RETURN_IF_ERROR(s.barrier->Arrive());  // every rank's stage is enqueued
    for (int r = 0; r < s.size; ++r) {
      if (r != rank_) SKV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, s.staged[r], 0));
    }
    p.phase = LocalReducePhase::kSum;
    SKV_CUDA_RETURN_IF_ERROR(LaunchLocalAllReduce(p, bf16, stream));
    return Status::Ok();
  }

 private:
  std::shared_ptr<LocalShared> shared_;
  int rank_;
};

}  // namespace

Result<Communicators> CreateLocalCommunicators(int size, int device) {
  if (size < 1 || size > kLocalAllReduceMaxRanks) {
    return Error(ErrorCode::kInvalidArgument, "{} local ranks (1 to {})", size,
                 kLocalAllReduceMaxRanks);
  }
  int previous = 0;
  SKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  struct RestoreDevice {
    int device;
    ~RestoreDevice() { (void)cudaSetDevice(device); }
  } restore{previous};
  SKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  auto shared = std::make_shared<LocalShared>();
  shared->size = size;
  shared->device = device;
  shared->barrier = std::make_unique<GroupBarrier>(size);
  SKV_RETURN_IF_ERROR(shared->flags.Allocate(static_cast<int64_t>(size) * kLocalAllReduceBlocks));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(shared->flags.get(), 0, shared->flags.bytes()));
  shared->staged.resize(size, nullptr);
  for (cudaEvent_t& event : shared->staged) {
    SKV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  void* abort_word = nullptr;
  SKV_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&abort_word, sizeof(int), cudaHostAllocMapped));
  shared->abort_host = static_cast<volatile int*>(abort_word);
  *shared->abort_host = 0;
  void* abort_mapped = nullptr;
  SKV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&abort_mapped, abort_word, 0));
  shared->abort_device = static_cast<const volatile int*>(abort_mapped);
  SKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  // Load the kernels now: with lazy module loading, a first launch may wait for the context to
  // go idle, which never happens while another rank's all-reduce spins.
  SKV_CUDA_RETURN_IF_ERROR(PreloadLocalAllReduce());
  Communicators ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<LocalCommunicator>(shared, r));
  return Result<Communicators>(std::move(ranks));
}

}  // namespace shadowkv::cuda::tp
