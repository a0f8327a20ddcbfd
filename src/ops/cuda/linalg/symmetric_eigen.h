// Every eigenpair of a batch of small symmetric fp32 matrices on the GPU, in one call that stays
// on its stream (no host synchronisation): cuSOLVER's batched symmetric eigensolver. ShadowKV
// fits each layer's key basis with it (the top eigenvectors of the layer's Gram matrix).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "core/status.h"

namespace shadowkv::cuda {

class BatchedSymmetricEigen {
 public:
  // A solver for `batch` matrices of n x n on `stream`, with its workspace (device and host)
  // allocated here. kInvalidArgument for n or batch < 1 or a batch past cuSOLVER's 32-bit
  // element count; kResourceExhausted where the workspace does not fit.
  static Result<std::unique_ptr<BatchedSymmetricEigen>> Create(int n, int batch,
                                                               cudaStream_t stream);
  ~BatchedSymmetricEigen();
  BatchedSymmetricEigen(const BatchedSymmetricEigen&) = delete;
  BatchedSymmetricEigen& operator=(const BatchedSymmetricEigen&) = delete;

  int n() const;
  int batch() const;
  // Device bytes the workspace holds (for memory accounting).
  int64_t workspace_bytes() const;

  // matrices: device [batch, n, n], each symmetric (only its lower triangle, column-major, is
  // read; for a symmetric matrix row- and column-major are the same), overwritten by its
  // eigenvectors: column j of matrix b (column-major) belongs to values[b * n + j].
  // values: device [batch, n], each matrix's eigenvalues in ascending order.
  // info: device [batch], 0 where the matrix converged (read it after the stream reaches here).
  // Stream-ordered; the call itself returns at once.
  Status Run(float* matrices, float* values, int32_t* info);

 private:
  struct State;
  explicit BatchedSymmetricEigen(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace shadowkv::cuda
