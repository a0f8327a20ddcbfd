// The environment variables the CUDA subcommands honour (kernel variants to compare against the
// defaults, tensor-parallel debugging), read here only: the library takes them as options.
#pragma once

#ifdef SHADOWKV_HAVE_CUDA

#include "core/status.h"
#include "gpu/model/cuda_model.h"
#include "model/tensor_parallel.h"

namespace shadowkv::app {

// SKV_DECODE_VARIANT, SKV_PREFILL_VARIANT, SKV_GEMM_VARIANT, SKV_SHADOWKV_KERNELS,
// SKV_SELECT_COARSE, SKV_SELECT_REGISTERS, SKV_SPLIT_ROWS, SKV_SPLIT_SHARE, SKV_REBUILD_SLOTS and
// SKV_ATTN_SPLITS (ops/cuda/NOTES.md); unset or empty ones keep the defaults. A value that is not
// an integer is kInvalidArgument naming the variable.
Result<cuda::CudaKernelOptions> KernelOptionsFromEnvironment();

// SHADOWKV_TP_LOCAL=1 sets tp->local; SHADOWKV_TP_TRACE=1, SHADOWKV_TP_STEP_TIMEOUT_S and
// SHADOWKV_NCCL_LIBRARY go to the process's tensor-parallel settings. Call before any group is
// made.
Status ApplyTensorParallelEnvironment(TensorParallelOptions* tp);

}  // namespace shadowkv::app

#endif  // SHADOWKV_HAVE_CUDA
