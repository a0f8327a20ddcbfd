// `shadowkv generate --device cuda`: tokenises with the GGUF's tokenizer, prefills on the GPU in
// chunks, then decodes one token per step (graph-replayed, sampled on the GPU) until an
// end-of-generation token or the token limit. ShadowKV compresses the prefilled prompt first.
#include "cmd_generate_cuda.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "cuda_environment.h"
#include "core/status.h"
#include "options.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "format/gguf.h"
#include "format/tokenizer.h"
#include "gpu/tp/cuda_model_group.h"
#include "kv/policies.h"
#endif

namespace shadowkv::app {

#ifndef SHADOWKV_HAVE_CUDA

int RunCudaGenerate(const CudaGenerateOptions&) {
  return Fail(kBuiltWithoutCuda);
}

#else

namespace {

using Clock = std::chrono::steady_clock;

struct Generated {
  std::vector<int32_t> tokens;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  bool stopped = false;  // at an end-of-generation token
};

// Prefill (with pre-RoPE keys and compression for ShadowKV), then decode; `emit` gets every
// new token as it is known.
template <typename Emit>
Result<Generated> Generate(cuda::CudaModelGroup& model, const CudaGenerateOptions& o,
                           const Tokenizer& tokenizer, const std::vector<int32_t>& prompt,
                           Emit emit) {
  const bool shadowkv = kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv);
  const int64_t length = static_cast<int64_t>(prompt.size());
  const int64_t capacity = length + o.max_new_tokens;
  if (capacity > model.config().context_length) {
    return Error(ErrorCode::kOutOfRange, "prompt of {} tokens plus {} new ones exceeds the "
                 "model's context of {}", length, o.max_new_tokens, model.config().context_length);
  }
  Generated g;
  const auto start = Clock::now();
  SKV_RETURN_IF_ERROR(model.AllocateKvCache(1, shadowkv ? length : capacity, shadowkv));
  std::vector<float> logits(model.config().vocab_size);
  for (int64_t done = 0; done < length; done += o.prefill_chunk) {
    const int64_t count = std::min<int64_t>(o.prefill_chunk, length - done);
    cuda::CudaStepInput in;
    in.slot = 0;
    in.tokens = std::span<const int32_t>(prompt.data() + done, count);
    in.logits_out = done + count == length ? logits.data() : nullptr;
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const cuda::CudaStepInput>(&in, 1)));
  }
  if (shadowkv) {
    SKV_RETURN_IF_ERROR(model.AllocateShadowKv(o.kv, 1, capacity));
    SKV_RETURN_IF_ERROR(model.AllocateShadowKvValues(0, false));
    SKV_RETURN_IF_ERROR(model.CompressToShadowKv(0, 0));
    model.FreeKvCache();
  }
  // The first token from the prefill's logits (host sampler), the rest sampled on the GPU.
  Sampler sampler(o.sampling);
  int32_t token = sampler.Sample(logits);
  g.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto decode_start = Clock::now();
  const cuda::CudaSampling sampling{o.sampling.temperature, o.sampling.seed};
  const std::vector<int> slots = {0};
  for (;;) {
    g.tokens.push_back(token);
    emit(token);
    if (!o.ignore_eos && tokenizer.IsEndOfGeneration(token)) {
      g.stopped = true;
      break;
    }
    if (static_cast<int>(g.tokens.size()) >= o.max_new_tokens) break;
    std::vector<int32_t> step = {token};
    SKV_RETURN_IF_ERROR(shadowkv ? model.ShadowKvDecodeStep(slots, step, sampling)
                                 : model.DecodeStep(slots, step, sampling));
    token = step[0];
  }
  g.decode_seconds = std::chrono::duration<double>(Clock::now() - decode_start).count();
  return g;
}

}  // namespace

int RunCudaGenerate(const CudaGenerateOptions& o) {
  cuda::PrepareProcessForTensorParallel(o.tensor_parallel.size);  // before any CUDA call
  if (!kv::IsPolicy(o.kv, kv::PolicyKind::kFull) &&
      !kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv)) {
    return Fail(fmt::format("--device cuda generates with --kv full or shadowkv, not '{}'",
                            o.kv.policy));
  }
  if (o.sampling.top_k != 0 || o.sampling.top_p != 1.0f) {
    return Fail("--device cuda samples with --temp and --seed only (no --top-k / --top-p)");
  }
  if (Status s = o.sampling.Validate(); !s.ok()) return Fail(s.ToString());
  auto file = gguf::GgufFile::Open(o.model_path);
  if (!file.ok()) return Fail(file.status().ToString());
  auto tokenizer = Tokenizer::FromGguf(**file);
  if (!tokenizer.ok()) return Fail(tokenizer.status().ToString());
  auto prompt = GenerationPrompt(**file, **tokenizer, o.text, o.chat, o.system);
  if (!prompt.ok()) return Fail(prompt.status().ToString());
  if (prompt->empty()) return Fail("the prompt has no tokens");

  TensorParallelOptions tensor_parallel = o.tensor_parallel;
  if (Status s = ApplyTensorParallelEnvironment(&tensor_parallel); !s.ok()) {
    return Fail(s.ToString());
  }
  auto kernels = KernelOptionsFromEnvironment();
  if (!kernels.ok()) return Fail(kernels.status().ToString());
  cuda::CudaModelOptions options;
  options.max_batch = 1;
  options.max_step_tokens = std::max(1, o.prefill_chunk);
  options.kernels = *kernels;
  auto model = cuda::CudaModelGroup::Load(o.model_path, options, tensor_parallel);
  if (!model.ok()) return Fail(model.status().ToString());
  if ((*tokenizer)->vocab_size() != (*model)->config().vocab_size) {
    return Fail(fmt::format("the tokenizer has {} tokens, the model {}",
                            (*tokenizer)->vocab_size(), (*model)->config().vocab_size));
  }

  StreamingDecoder decoder(**tokenizer, /*skip_special=*/true);
  auto emit = [&](int32_t token) {
    const std::string piece = decoder.Push(token);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  auto generated = Generate(**model, o, **tokenizer, *prompt, emit);
  const std::string tail = decoder.Flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!generated.ok()) return Fail(generated.status().ToString());
  if (!o.quiet) {
    const Generated& g = *generated;
    const size_t decoded = g.tokens.size() > 0 ? g.tokens.size() - 1 : 0;
    std::fprintf(stderr,
                 "[%s, cuda, %d rank%s] prompt %zu tokens: prefill %.2f s (%.1f tokens/s); "
                 "generated %zu tokens (%s): decode %.1f tokens/s\n",
                 o.kv.policy.c_str(), (*model)->size(), (*model)->size() == 1 ? "" : "s",
                 prompt->size(), g.prefill_seconds,
                 prompt->size() / std::max(g.prefill_seconds, 1e-9), g.tokens.size(),
                 g.stopped ? "end of text" : "token limit",
                 decoded / std::max(g.decode_seconds, 1e-9));
  }
  return 0;
}

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
