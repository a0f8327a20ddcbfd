// Next-token choice on the GPU, with each row's own settings: greedy argmax, or a draw at a
// temperature, optionally truncated to the top-k logits and the top-p nucleus.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowkv::cuda {

// One row's settings. Lives in device memory so that a captured decode graph reads fresh values
// at every replay.
struct SamplingControl {
  float temperature = 0.0f;  // 0: argmax (lowest id on ties, NaN never chosen); cuts ignored
  int32_t top_k = 0;         // 0 (or >= vocab): no limit
  float top_p = 1.0f;        // nucleus mass in (0, 1]; 1: no limit
  uint32_t unused = 0;
  uint64_t seed = 0;
  uint64_t draw = 0;  // the noise of a draw is a function of (seed, draw, id) only
};

struct SamplingParams {
  const float* logits = nullptr;              // [rows, vocab]
  const SamplingControl* controls = nullptr;  // device [rows]
  int32_t* tokens = nullptr;                  // [rows] chosen ids
  int rows = 0;
  int vocab = 0;
};

// With temperature T > 0 a row picks argmax_v(logit_v / T + g_v) over its surviving ids, g_v the
// Gumbel(0, 1) noise of (seed, draw, v) (core/draw_noise.h, as the CPU Sampler's SampleAt): an
// exact draw from softmax(logits / T) renormalised over the survivors. A row without top-k or
// top-p is one pass over its logits. With them, the cut is a threshold on the logit found by a
// binary search over the float's ordered bit pattern, one pass per bit: the largest t with at
// least k logits >= t (top-k), then the largest t whose logits >= t (within the top-k set) hold
// top_p of its softmax mass at T (top-p, summed in fp32). Survivors are the logits >= the
// threshold, so ids tied with the one at the cut are all kept: the set may be a few ids larger
// than the CPU Sampler's, which breaks such ties by id.
cudaError_t LaunchSampling(const SamplingParams& params, cudaStream_t stream);

}  // namespace shadowkv::cuda
