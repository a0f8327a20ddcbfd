// The NCCL communicator: one rank per GPU, all ranks threads of this process. libnccl is opened
// at run time (it is hundreds of MB and not every GPU machine has it where the loader looks), so
// the binary needs it only when tensor parallelism over several GPUs is asked for. The header
// is taken from the CUDA toolkit at build time (SHADOWKV_HAVE_NCCL_HEADER); without it this
// file builds a stub that says so.
#include <dlfcn.h>
#include <glob.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <type_traits>
#include <utility>

#include "core/group_barrier.h"
#include "gpu/tp/communicator.h"
#include "ops/cuda/common/cuda_check.h"

#if SHADOWKV_HAVE_NCCL_HEADER
#include <nccl.h>
#endif

namespace shadowkv::cuda::tp {

#if !SHADOWKV_HAVE_NCCL_HEADER

bool NcclAvailable(std::string* why) {
  if (why) *why = "this shadowkv was built without nccl.h (not found in the CUDA toolkit)";
  return false;
}

Result<Communicators> CreateNcclCommunicators(const std::vector<int>&) {
  std::string why;
  NcclAvailable(&why);
  return Error(ErrorCode::kUnsupported, "tensor parallelism over several GPUs needs NCCL: {}", why);
}

#else

namespace {

// The NCCL entry points used, resolved from the library once (typed from nccl.h's own
// declarations, so a mismatch is a compile error).
struct NcclApi {
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclCommInitAll) CommInitAll = nullptr;
  decltype(&ncclCommFinalize) CommFinalize = nullptr;  // NCCL >= 2.14; may be missing
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  std::string error;  // why it could not be loaded, or empty
  int version = 0;
};

// Where libnccl may be: ProcessSettings::nccl_library, the loader's path, the CUDA toolkit, and the
// wheel PyTorch installs (nvidia-nccl-*).
std::vector<std::string> CandidateLibraries() {
  std::vector<std::string> names;
  if (!Settings().nccl_library.empty()) names.push_back(Settings().nccl_library);
  names.insert(names.end(), {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2",
                             "/usr/local/cuda/lib/libnccl.so.2"});
  for (const char* pattern : {"/usr/local/lib/python3*/*-packages/nvidia/nccl/lib/libnccl.so.2",
                              "/usr/lib/python3*/*-packages/nvidia/nccl/lib/libnccl.so.2",
                              "/opt/*/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"}) {
    glob_t found{};
    if (glob(pattern, 0, nullptr, &found) == 0) {
      for (size_t i = 0; i < found.gl_pathc; ++i) names.emplace_back(found.gl_pathv[i]);
    }
    globfree(&found);
  }
  return names;
}

const NcclApi& Api() {
  static const NcclApi api = [] {
    NcclApi a;
    void* handle = nullptr;
    std::string tried;
    for (const std::string& name : CandidateLibraries()) {
      handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle) break;
      tried += (tried.empty() ? "" : ", ") + name;
    }
    if (!handle) {
      a.error = "libnccl could not be loaded (tried " + tried +
                "; set SHADOWKV_NCCL_LIBRARY to its path)";
      return a;
    }
    auto bind = [&](auto& function, const char* symbol) {
      using Pointer = std::remove_reference_t<decltype(function)>;
      function = reinterpret_cast<Pointer>(dlsym(handle, symbol));
    };
    bind(a.GetVersion, "ncclGetVersion");
    bind(a.CommInitAll, "ncclCommInitAll");
    bind(a.CommFinalize, "ncclCommFinalize");
    bind(a.CommDestroy, "ncclCommDestroy");
    bind(a.CommAbort, "ncclCommAbort");
    bind(a.AllReduce, "ncclAllReduce");
    bind(a.GroupStart, "ncclGroupStart");
    bind(a.GroupEnd, "ncclGroupEnd");
    bind(a.GetErrorString, "ncclGetErrorString");
    if (!a.GetVersion || !a.CommInitAll || !a.CommDestroy || !a.CommAbort || !a.AllReduce ||
        !a.GroupStart || !a.GroupEnd || !a.GetErrorString) {
      a.error = "the libnccl found lacks an entry point this build uses";
      return a;
    }
    if (a.GetVersion(&a.version) != ncclSuccess) a.version = 0;
    return a;
  }();
  return api;
}

Status NcclStatus(ncclResult_t result, const char* call) {
  if (result == ncclSuccess) return Status::Ok();
  return Error(ErrorCode::kInternal, "{} failed: {}", call, Api().GetErrorString(result));
}

// The communicators of one group, made and torn down together.
struct NcclShared {
  std::vector<ncclComm_t> comms;
  std::vector<int> devices;
  // Enqueueing collectives (shared) against aborting (exclusive): ncclCommAbort frees the
  // communicators, so none may be in use by another thread then.
  std::shared_mutex mutex;
  bool aborted = false;
  std::unique_ptr<GroupBarrier> barrier;  // the ranks' host threads (HostBarrier)

  void Abort() {
    barrier->Abort();
    std::unique_lock<std::shared_mutex> lock(mutex);
    if (aborted) return;
    aborted = true;
    for (ncclComm_t comm : comms) (void)Api().CommAbort(comm);
  }

  ~NcclShared() {
    if (aborted) return;
    const NcclApi& api = Api();
    // Finalising is collective: from one thread, the calls go in one group.
    if (api.CommFinalize) {
      (void)api.GroupStart();
      for (ncclComm_t comm : comms) (void)api.CommFinalize(comm);
      (void)api.GroupEnd();
    }
    for (ncclComm_t comm : comms) (void)api.CommDestroy(comm);
  }
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclShared> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}
  int size() const override { return static_cast<int>(shared_->comms.size()); }
  int rank() const override { return rank_; }
  int device() const override { return shared_->devices[rank_]; }
  const char* kind() const override { return "nccl"; }
  Status Reserve(int64_t) override { return Status::Ok(); }  // NCCL keeps its own buffers
  Status HostBarrier() override { return shared_->barrier->Arrive(); }
  void Abort() override { shared_->Abort(); }

  Status AllReduceSum(void* buffer, int64_t count, ReduceType type,
                      cudaStream_t stream) override {
    const ncclDataType_t data = type == ReduceType::kFloat32 ? ncclFloat32 : ncclBfloat16;
    const int64_t call = CountIssued();
    if (TraceEnabled()) Trace(rank_, fmt::format("nccl all-reduce {} of {} elements", call, count));
    std::shared_lock<std::shared_mutex> lock(shared_->mutex);
    if (shared_->aborted) {
      return Error(ErrorCode::kInternal, "the tensor-parallel group was aborted");
    }
    return NcclStatus(Api().AllReduce(buffer, buffer, static_cast<size_t>(count), data, ncclSum,
                                      shared_->comms[rank_], stream),
                      "ncclAllReduce");
  }

 private:
  std::shared_ptr<NcclShared> shared_;
  int rank_;
};

}  // namespace

bool NcclAvailable(std::string* why) {
  const NcclApi& api = Api();
  if (why) *why = api.error;
  return api.error.empty();
}

Result<Communicators> CreateNcclCommunicators(const std::vector<int>& devices) {
  // NVLink multicast (NVLS) stays off: on shared hosts it can take the GPUs out of service.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  // Every connection is made at initialisation, not at a communicator's first collective: that
  // one may be inside a CUDA graph capture (the first decode step), where NCCL cannot set up.
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  std::string why;
  if (!NcclAvailable(&why)) {
    return Error(ErrorCode::kUnsupported, "tensor parallelism over several GPUs needs NCCL: {}",
                 why);
  }
  int count = 0;
  SKV_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count) {
      return Error(ErrorCode::kUnsupported, "tensor parallelism over {} GPUs needs GPU {}; this "
                   "machine has {} (to run the ranks on one GPU, use the local communicator)",
                   devices.size(), devices[i], count);
    }
    for (size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        return Error(ErrorCode::kInvalidArgument, "GPU {} is named twice: NCCL runs one rank per "
                     "GPU", devices[i]);
      }
    }
  }
  auto shared = std::make_shared<NcclShared>();
  shared->devices = devices;
  shared->barrier = std::make_unique<GroupBarrier>(static_cast<int>(devices.size()));
  shared->comms.assign(devices.size(), nullptr);
  int previous = 0;
  SKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  const ncclResult_t made = Api().CommInitAll(shared->comms.data(),
                                              static_cast<int>(devices.size()), devices.data());
  (void)cudaSetDevice(previous);
  if (made != ncclSuccess) {
    shared->comms.clear();  // nothing to tear down
    return NcclStatus(made, "ncclCommInitAll");
  }
  Communicators ranks;
  for (size_t r = 0; r < devices.size(); ++r) {
    ranks.push_back(std::make_unique<NcclCommunicator>(shared, static_cast<int>(r)));
  }
  return Result<Communicators>(std::move(ranks));
}

#endif  // SHADOWKV_HAVE_NCCL_HEADER

}  // namespace shadowkv::cuda::tp
