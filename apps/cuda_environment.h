// The CUDA subcommands' kernel settings: the variant selectors still read from the environment
// (to compare against the defaults), the bench's tuning flags, and the tensor-parallel process
// settings (debugging); the library takes them all as options.
#pragma once

#include "core/status.h"
#include "gpu/model/cuda_model.h"
#include "model/tensor_parallel.h"

namespace shadowkv::app {

#ifdef SHADOWKV_HAVE_CUDA

// The tuning that AddKernelTuningOptions's flags set (options.h: --split-rows/--no-split-rows,
// --split-share, --rebuild-slots, --attention-splits; the library's defaults where they were not
// registered or not given), with the ShadowKV variant selectors SKV_SHADOWKV_KERNELS,
// SKV_SELECT_COARSE and SKV_SELECT_REGISTERS (ops/cuda/NOTES.md) over it; unset or empty ones
// keep the defaults. A value that is not an integer is kInvalidArgument naming the variable.
Result<cuda::CudaKernelOptions> KernelOptionsFromEnvironment();

// SHADOWKV_TP_LOCAL=1 sets tp->local; SHADOWKV_TP_TRACE=1, SHADOWKV_TP_STEP_TIMEOUT_S and
// SHADOWKV_NCCL_LIBRARY go to the process's tensor-parallel settings. Call before any group is
// made.
Status ApplyTensorParallelEnvironment(TensorParallelOptions* tp);

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
