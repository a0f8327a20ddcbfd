// `shadowkv eval --device cuda`: one prefill per sample on the GPU, then every policy's greedy
// answer: ShadowKV variants compress a copy of the prefilled prompt and decode over it, full
// attention decodes in the prefilled slot itself (last, so nothing needs copying). The other
// policies (SnapKV, Quest, StreamingLLM) have no GPU kernels: they take the GPU's keys and
// values of the prompt, the CPU model runs the prompt's last tokens again to give SnapKV its
// observation-window queries, and they decode on the CPU.
#include "cmd_eval_cuda.h"

#include <chrono>
#include <vector>

#include "commands.h"
#include "cuda_environment.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/prefill_record.h"
#include "gpu/model/cuda_model.h"
#include "kv/policies.h"
#endif

namespace shadowkv::app {

#ifndef SHADOWKV_HAVE_CUDA

Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string&, CpuModel&,
                                                                 int64_t, int) {
  return Error(ErrorCode::kUnsupported, "{}", kBuiltWithoutCuda);
}

#else

namespace {

using Clock = std::chrono::steady_clock;

bool OnGpu(const kv::KvPolicyConfig& config) {
  return kv::IsPolicy(config, kv::PolicyKind::kFull) ||
         kv::IsPolicy(config, kv::PolicyKind::kShadowKv);
}

class CudaEvalBackend final : public eval::AnswerBackend {
 public:
  CudaEvalBackend(std::unique_ptr<cuda::CudaModel> model, CpuModel& cpu_model, int64_t capacity,
                  int prefill_chunk)
      : model_(std::move(model)),
        cpu_model_(cpu_model),
        tokenizer_(cpu_model.tokenizer()),
        capacity_(capacity),
        prefill_chunk_(prefill_chunk) {}

  std::string numerics() const override {
    return cpu_policies_ ? fmt::format("cuda-bf16; snapkv/quest/streaming decode on the CPU ({})",
                                       NumericsName(cpu_model_.numerics()))
                         : "cuda-bf16";
  }

  Status Check(const std::vector<kv::KvPolicyConfig>& policies) const override {
    int full = 0;
    cpu_policies_ = 0;
    for (const kv::KvPolicyConfig& config : policies) {
      if (kv::IsPolicy(config, kv::PolicyKind::kFull)) {
        ++full;
      } else if (kv::IsPolicy(config, kv::PolicyKind::kShadowKv)) {
        SKV_RETURN_IF_ERROR(model_->ShadowKvBytesPerSequence(config, capacity_).status());
      } else {
        SKV_RETURN_IF_ERROR(kv::MakeKvPolicy(config, cpu_model_.kv_geometry()).status());
        ++cpu_policies_;
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
    SKV_RETURN_IF_ERROR(AnswerOnCpu(prompt, max_new_tokens, policies, answers));
    int full_index = -1;
    for (size_t p = 0; p < policies.size(); ++p) {
      if (!OnGpu(policies[p])) continue;
      if (kv::IsPolicy(policies[p], kv::PolicyKind::kFull)) {
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
  // The policies without GPU kernels: the GPU's prompt keys and values, all but the last
  // tokens (as many as the widest SnapKV window, at least one), go to the CPU model, which runs
  // those last tokens to record their queries and the next-token logits; then the policies
  // replay that record and decode on the CPU.
  Status AnswerOnCpu(const std::vector<int32_t>& prompt, int max_new_tokens,
                     const std::vector<kv::KvPolicyConfig>& policies,
                     std::vector<eval::BackendAnswer>* answers) {
    std::vector<kv::KvPolicyConfig> cpu;
    int64_t tail = 1;
    for (const kv::KvPolicyConfig& config : policies) {
      if (OnGpu(config)) continue;
      cpu.push_back(config);
      if (kv::IsPolicy(config, kv::PolicyKind::kSnapKv))
        tail = std::max<int64_t>(tail, config.snap_window);
    }
    if (cpu.empty()) return Status::Ok();
    tail = std::min<int64_t>(tail, static_cast<int64_t>(prompt.size()));
    const int64_t handed = static_cast<int64_t>(prompt.size()) - tail;
    eval::PrefillRecord record;
    {
      SKV_ASSIGN_OR_RETURN(cuda::CudaSlotExport part, model_->ExportSlot(0, handed));
      const kv::KvGeometry geometry = cpu_model_.kv_geometry();
      record.num_tokens = handed;
      record.kv_width = geometry.kv_width();
      record.q_width = geometry.q_width();
      record.keys = std::move(part.keys);
      record.values = std::move(part.values);
      record.keys_pre_rope = std::move(part.keys_pre_rope);
      record.queries.resize(geometry.num_layers);
    }
    SKV_RETURN_IF_ERROR(eval::ExtendPrefill(cpu_model_, prompt, &record, prefill_chunk_));
    std::vector<eval::BackendAnswer> cpu_answers;
    SKV_RETURN_IF_ERROR(
        eval::AnswerFromRecord(cpu_model_, record, cpu, max_new_tokens, &cpu_answers));
    for (size_t p = 0, next = 0; p < policies.size(); ++p) {
      if (!OnGpu(policies[p])) (*answers)[p] = std::move(cpu_answers[next++]);
    }
    return Status::Ok();
  }

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
  CpuModel& cpu_model_;
  const Tokenizer& tokenizer_;
  mutable int cpu_policies_ = 0;  // counted by Check
  int64_t capacity_;
  int prefill_chunk_;
};

}  // namespace

Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string& model_path,
                                                                 CpuModel& cpu_model,
                                                                 int64_t max_tokens,
                                                                 int prefill_chunk) {
  cuda::CudaModelOptions options;
  options.max_batch = 1;
  options.max_step_tokens = prefill_chunk;
  SKV_ASSIGN_OR_RETURN(options.kernels, KernelOptionsFromEnvironment());
  SKV_ASSIGN_OR_RETURN(auto model, cuda::CudaModel::Load(model_path, options));
  SKV_RETURN_IF_ERROR(model->AllocateKvCache(1, max_tokens, /*keep_pre_rope_keys=*/true));
  return std::unique_ptr<eval::AnswerBackend>(
      new CudaEvalBackend(std::move(model), cpu_model, max_tokens, prefill_chunk));
}

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
