// BatchedSymmetricEigen on cuSOLVER's 64-bit batched syev (fp32 data, fp32 compute).
#include "ops/cuda/linalg/symmetric_eigen.h"

#include <cusolverDn.h>

#include <limits>
#include <vector>

#include "ops/cuda/common/device_buffer.h"

namespace shadowkv::cuda {
namespace {

Status SolverStatus(cusolverStatus_t status, const char* call) {
  if (status == CUSOLVER_STATUS_SUCCESS) return Status::Ok();
  const ErrorCode code = status == CUSOLVER_STATUS_ALLOC_FAILED ? ErrorCode::kResourceExhausted
                                                                : ErrorCode::kInternal;
  return Error(code, "{} failed: cuSOLVER status {}", call, static_cast<int>(status));
}

#define SKV_SOLVER_RETURN_IF_ERROR(expr) SKV_RETURN_IF_ERROR(SolverStatus((expr), #expr))

}  // namespace

struct BatchedSymmetricEigen::State {
  int n = 0;
  int batch = 0;
  cusolverDnHandle_t handle = nullptr;
  cusolverDnParams_t params = nullptr;
  DeviceBuffer<uint8_t> device_work;
  std::vector<uint8_t> host_work;

  ~State() {
    if (params) (void)cusolverDnDestroyParams(params);
    if (handle) (void)cusolverDnDestroy(handle);
  }
};

BatchedSymmetricEigen::BatchedSymmetricEigen(std::unique_ptr<State> state)
    : state_(std::move(state)) {}
BatchedSymmetricEigen::~BatchedSymmetricEigen() = default;

int BatchedSymmetricEigen::n() const { return state_->n; }
int BatchedSymmetricEigen::batch() const { return state_->batch; }
int64_t BatchedSymmetricEigen::workspace_bytes() const { return state_->device_work.size(); }

Result<std::unique_ptr<BatchedSymmetricEigen>> BatchedSymmetricEigen::Create(int n, int batch,
                                                                             cudaStream_t stream) {
  // cuSOLVER's batched syev indexes the whole batch with 32-bit integers.
  if (n < 1 || batch < 1 ||
      static_cast<int64_t>(n) * n * batch > std::numeric_limits<int32_t>::max()) {
    return Error(ErrorCode::kInvalidArgument,
                 "batched eigensolver: {} matrices of {} x {} are out of its range", batch, n, n);
  }
  auto state = std::make_unique<State>();
  state->n = n;
  state->batch = batch;
  SKV_SOLVER_RETURN_IF_ERROR(cusolverDnCreate(&state->handle));
  SKV_SOLVER_RETURN_IF_ERROR(cusolverDnSetStream(state->handle, stream));
  SKV_SOLVER_RETURN_IF_ERROR(cusolverDnCreateParams(&state->params));
  size_t device_bytes = 0, host_bytes = 0;
  SKV_SOLVER_RETURN_IF_ERROR(cusolverDnXsyevBatched_bufferSize(
      state->handle, state->params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
      CUDA_R_32F, nullptr, n, CUDA_R_32F, nullptr, CUDA_R_32F, &device_bytes, &host_bytes,
      batch));
  SKV_RETURN_IF_ERROR(state->device_work.Allocate(static_cast<int64_t>(device_bytes)));
  state->host_work.resize(host_bytes);
  return std::unique_ptr<BatchedSymmetricEigen>(new BatchedSymmetricEigen(std::move(state)));
}

Status BatchedSymmetricEigen::Run(float* matrices, float* values, int32_t* info) {
  State& s = *state_;
  SKV_SOLVER_RETURN_IF_ERROR(cusolverDnXsyevBatched(
      s.handle, s.params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, s.n, CUDA_R_32F,
      matrices, s.n, CUDA_R_32F, values, CUDA_R_32F, s.device_work.get(),
      static_cast<size_t>(s.device_work.size()), s.host_work.empty() ? nullptr : s.host_work.data(),
      s.host_work.size(), info, s.batch));
  return Status::Ok();
}

}  // namespace shadowkv::cuda
