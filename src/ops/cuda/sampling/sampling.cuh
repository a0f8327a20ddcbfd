// Next-token choice on the GPU: greedy argmax, or temperature sampling by the Gumbel-max trick.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

// Lives in device memory so that a captured decode graph reads fresh values at every replay.
struct SamplingControl {
  float temperature = 0.0f;  // 0: argmax (lowest id on ties, NaN never chosen)
  uint32_t unused = 0;
  uint64_t seed = 0;
  uint64_t step = 0;  // the random stream of (seed, step, row) is fixed: reproducible runs
};

struct SamplingParams {
  const float* logits = nullptr;  // [rows, vocab]
  const SamplingControl* control = nullptr;  // device pointer
  int32_t* tokens = nullptr;      // [rows] chosen ids
  int rows = 0;
  int vocab = 0;
};

// With temperature T > 0 each row picks argmax_v(logit_v / T + g_v), g_v independent Gumbel(0, 1)
// noise: an exact draw from softmax(logits / T). (top-k and top-p stay on the CPU sampler.)
cudaError_t LaunchSampling(const SamplingParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
