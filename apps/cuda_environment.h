// The CUDA subcommands' kernel settings: the bench's tuning flags (the library's defaults
// elsewhere) and the tensor-parallel process settings from the environment (debugging); the
// library takes them all as options.
#pragma once

#include "core/status.h"
#include "gpu/model/cuda_model.h"
#include "model/tensor_parallel.h"

namespace shadowkv::app {

#ifdef SHADOWKV_HAVE_CUDA

// What AddKernelTuningOptions's flags set (options.h: --split-rows/--no-split-rows,
// --split-share, --rebuild-slots, --attention-splits, --shadowkv-kernels, --coarse-select,
// --select-registers; ops/cuda/NOTES.md), the library's defaults where they were not registered
// or not given.
cuda::CudaKernelOptions KernelOptionsFromFlags();

// SHADOWKV_TP_LOCAL=1 sets tp->local; SHADOWKV_TP_TRACE=1, SHADOWKV_TP_STEP_TIMEOUT_S and
// SHADOWKV_NCCL_LIBRARY go to the process's tensor-parallel settings. Call before any group is
// made.
Status ApplyTensorParallelEnvironment(TensorParallelOptions* tp);

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
