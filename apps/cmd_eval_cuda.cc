// `shadowkv eval --device cuda`: one prefill per sample on the GPU, then every policy's greedy
// answer: ShadowKV variants compress a copy of the prefilled prompt and decode over it, full
// attention decodes in the prefilled slot itself (last, so nothing needs copying).
#include "cmd_eval_cuda.h"

#include <chrono>
#include <vector>

#ifdef SHADOWKV_HAVE_CUDA
#include "engine/sampler.h"
#include "eval/greedy.h"
#include "ops/cuda/cuda_model.h"
#endif

namespace shadowkv::app {

#ifndef SHADOWKV_HAVE_CUDA

Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string&,
                                                                 const Tokenizer&, int64_t, int) {
  return Error(ErrorCode::kUnsupported,
               "this shadowkv was built without CUDA (configure with -DSHADOWKV_CUDA=ON)");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

class CudaEvalBackend final : public eval::AnswerBackend {
 public:
  CudaEvalBackend(std::unique_ptr<cuda::CudaModel> model, const Tokenizer& tokenizer,
                  int64_t capacity, int prefill_chunk)
      : model_(std::move(model)),
        tokenizer_(tokenizer),
        capacity_(capacity),
        prefill_chunk_(prefill_chunk) {}

  std::string numerics() const override { return "cuda-bf16"; }

  Status Check(const std::vector<kv::KvPolicyConfig>& policies) const override {
    int full = 0;
    for (const kv::KvPolicyConfig& config : policies) {
      if (config.policy == "full") {
        ++full;
      } else if (config.policy == "shadowkv") {
        SKV_RETURN_IF_ERROR(model_->ShadowKvBytesPerSequence(config, capacity_).status());
      } else {
        return Error(ErrorCode::kUnsupported,
                     "on the GPU the eval runs full and shadowkv; {} runs on the CPU (--device "
                     "cpu)",
                     config.policy);
      }
    }
    if (full > 1) return Error(ErrorCode::kInvalidArgument, "full attention is listed twice");
    return Status::Ok();
  }

  Status Answer(const std::vector<int32_t>& prompt, int max_new_tokens,
                const std::vector<kv::KvPolicyConfig>& policies,
                std::vector<eval::BackendAnswer>* answers, double* prefill_seconds) override {
    if (static_cast<int64_t>(prompt.size()) + max_new_tokens > capacity_) {
      return Error(ErrorCode::kOutOfRange, "a prompt of {} tokens plus {} to generate exceeds "
                   "the GPU cache of {} tokens", prompt.size(), max_new_tokens, capacity_);
    }
    const auto start = Clock::now();
    model_->ResetSlot(0);
    std::vector<float> logits(model_->config().vocab_size);
    for (size_t begin = 0; begin < prompt.size(); begin += prefill_chunk_) {
      const size_t count = std::min(prompt.size() - begin, static_cast<size_t>(prefill_chunk_));
      const bool last = begin + count == prompt.size();
      const cuda::CudaStepInput input{
          0, std::span<const int32_t>(prompt).subspan(begin, count), last ? logits.data() : nullptr};
      SKV_RETURN_IF_ERROR(model_->Forward(std::span<const cuda::CudaStepInput>(&input, 1)));
    }
    const int32_t first = Argmax(logits);
    *prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();

    answers->assign(policies.size(), {});
    int full_index = -1;
    for (size_t p = 0; p < policies.size(); ++p) {
      if (policies[p].policy == "full") {
        full_index = static_cast<int>(p);
        continue;
      }
      SKV_RETURN_IF_ERROR(model_->AllocateShadowKv(policies[p], 1, capacity_));
      SKV_RETURN_IF_ERROR(model_->AllocateShadowKvValues(0, /*on_host=*/false));
      SKV_RETURN_IF_ERROR(model_->CompressToShadowKv(0, 0));
      model_->ResetShadowKvCounters();
      SKV_RETURN_IF_ERROR(Decode(first, max_new_tokens, /*shadowkv=*/true, &(*answers)[p]));
      const cuda::CudaShadowKvStats stats = model_->shadowkv_stats();
      (*answers)[p].stats.chunk_selections = stats.chunks_selected;
      (*answers)[p].stats.chunk_hits = stats.chunk_hits;
      (*answers)[p].rank = stats.rank;
      model_->FreeShadowKv();
    }
    if (full_index >= 0) {
      SKV_RETURN_IF_ERROR(Decode(first, max_new_tokens, /*shadowkv=*/false, &(*answers)[full_index]));
    }
    return Status::Ok();
  }

 private:
  // Greedy decoding from `first` (the prefill's next token) in the prefilled slot or in
  // ShadowKV sequence 0.
  Status Decode(int32_t first, int max_new_tokens, bool shadowkv, eval::BackendAnswer* answer) {
    eval::GreedyStream stream;
    stream.remaining = max_new_tokens;
    eval::PushToken(stream, first, tokenizer_);
    const cuda::CudaSampling greedy;
    const int index = 0;
    while (!stream.done()) {
      const int64_t length = shadowkv ? model_->shadowkv_length(0) : model_->slot_length(0);
      if (length + 1 > capacity_) {
        stream.truncated = true;
        break;
      }
      int32_t token = stream.feed.front();
      const std::span<const int> seqs(&index, 1);
      const std::span<int32_t> tokens(&token, 1);
      SKV_RETURN_IF_ERROR(shadowkv ? model_->ShadowKvDecodeStep(seqs, tokens, greedy)
                                   : model_->DecodeStep(seqs, tokens, greedy));
      eval::PushToken(stream, token, tokenizer_);
    }
    answer->tokens = std::move(stream.generated);
    answer->truncated = stream.truncated;
    return Status::Ok();
  }

  std::unique_ptr<cuda::CudaModel> model_;
  const Tokenizer& tokenizer_;
  int64_t capacity_;
  int prefill_chunk_;
};

}  // namespace

Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string& model_path,
                                                                 const Tokenizer& tokenizer,
                                                                 int64_t max_tokens,
                                                                 int prefill_chunk) {
  cuda::CudaModelOptions options;
  options.max_batch = 1;
  options.max_step_tokens = prefill_chunk;
  SKV_ASSIGN_OR_RETURN(auto model, cuda::CudaModel::Load(model_path, options));
  SKV_RETURN_IF_ERROR(model->AllocateKvCache(1, max_tokens, /*keep_pre_rope_keys=*/true));
  return std::unique_ptr<eval::AnswerBackend>(
      new CudaEvalBackend(std::move(model), tokenizer, max_tokens, prefill_chunk));
}

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
