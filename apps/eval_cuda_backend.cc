// `shadowkv eval --device cuda`: the GPU's answers (eval::AnswerBackend) to the runner's
// questions and conversations; the CPU model still synthesises, tokenises and scores.
#include "eval_cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "commands.h"
#include "cuda_environment.h"
#include "kv/policies.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/prefill_record.h"
#include "gpu/model/cuda_model.h"
#include "gpu/model/shadowkv_plan.h"
#endif

namespace shadowkv::app {

#ifdef SHADOWKV_HAVE_CUDA

namespace {

using Clock = std::chrono::steady_clock;

// --device cuda: one prefill per sample on the GPU, then every policy's greedy answer: ShadowKV
// variants compress a copy of the prefilled prompt and decode over it, full attention decodes in
// the prefilled slot itself (last, so nothing needs copying). The other policies (SnapKV, Quest,
// StreamingLLM) have no GPU kernels: they take the GPU's keys and values of the prompt, the CPU
// model runs the prompt's last tokens again to give SnapKV its observation-window queries, and
// they decode on the CPU. Where the GPU's ShadowKV cannot run (a head width or GQA group its
// kernels are not built for, such as the tiny test models' 16-wide heads:
// CudaModel::ShadowKvRunsHere) ShadowKV takes that CPU path too. On a sliding model every policy,
// on either side, keeps the windowed layers exact (their window) beside the global layers'
// compression. Multi-turn NIAH holds one conversation at a time on the GPU (full attention or
// ShadowKV), each prefilled on its own. Tasks, prompts and scoring stay with the CPU model's
// tokenizer.
class CudaEvalBackend final : public eval::AnswerBackend {
 public:
  // `slots`: 2 where fidelity is measured (full attention answers in slot 1 while slot 0 keeps
  // the prompt for the ShadowKV variants to compress again), else 1.
  CudaEvalBackend(std::unique_ptr<cuda::CudaModel> model, CpuModel& cpu_model, int64_t capacity,
                  int prefill_chunk, int slots, bool recompress_followups, bool keep_keys)
      : model_(std::move(model)),
        cpu_model_(cpu_model),
        tokenizer_(cpu_model.tokenizer()),
        capacity_(capacity),
        prefill_chunk_(prefill_chunk),
        slots_(slots),
        shadowkv_on_gpu_(model_->ShadowKvRunsHere().ok()),
        recompress_followups_(recompress_followups),
        keep_keys_(keep_keys) {}

  std::string numerics() const override {
    return cpu_policies_ ? fmt::format("cuda-bf16; {} decode on the CPU ({})",
                                       shadowkv_on_gpu_ ? "snapkv/quest/streaming"
                                                        : "shadowkv/snapkv/quest/streaming",
                                       NumericsName(cpu_model_.numerics()))
                         : !recompress_followups_ ? "cuda-bf16; shadowkv follow-ups decoded"
                         : keep_keys_             ? "cuda-bf16; shadowkv follow-ups from exact keys"
                                                  : "cuda-bf16";
  }

  Status Check(const std::vector<kv::KvPolicyConfig>& policies, bool fidelity,
               bool conversations) const override {
    int full = 0;
    cpu_policies_ = 0;
    for (const kv::KvPolicyConfig& config : policies) {
      if (kv::IsPolicy(config, kv::PolicyKind::kFull)) {
        ++full;
      } else if (OnGpu(config)) {  // ShadowKV on the GPU
        SKV_RETURN_IF_ERROR(model_->ShadowKvBytesPerSequence(config, capacity_).status());
      } else {
        SKV_RETURN_IF_ERROR(kv::MakeKvPolicy(config, cpu_model_.kv_geometry()).status());
        ++cpu_policies_;
      }
    }
    if (full > 1) return Error(ErrorCode::kInvalidArgument, "full attention is listed twice");
    if (conversations && cpu_policies_ > 0) {
      return Error(ErrorCode::kUnsupported,
                   "multi-turn NIAH on the GPU holds each conversation on the GPU: full attention "
                   "and shadowkv{}; {} decode on the CPU, use --device cpu for them",
                   shadowkv_on_gpu_ ? "" : " (not on this model: its heads take the CPU's)",
                   shadowkv_on_gpu_ ? "snapkv, quest and streaming" : "the others");
    }
    if (fidelity) {
      if (!kv::IsPolicy(policies.front(), kv::PolicyKind::kFull)) {
        return Error(ErrorCode::kInvalidArgument,
                     "--fidelity on the GPU follows full attention's answers: list full first");
      }
      if (cpu_policies_ > 0) {
        return Error(ErrorCode::kUnsupported,
                     "--fidelity on the GPU follows the GPU's policies only (full, and shadowkv "
                     "where the GPU runs it); {} decode on the CPU: leave them out",
                     shadowkv_on_gpu_ ? "snapkv, quest and streaming"
                                      : "on this model shadowkv, snapkv, quest and streaming");
      }
      if (slots_ < 2) return Error(ErrorCode::kInternal, "fidelity needs a second cache slot");
    }
    return Status::Ok();
  }

  Status Answer(const std::vector<int32_t>& prompt, int max_new_tokens,
                const std::vector<kv::KvPolicyConfig>& policies, bool fidelity,
                std::vector<eval::BackendAnswer>* answers, double* prefill_seconds) override {
    if (static_cast<int64_t>(prompt.size()) + max_new_tokens > capacity_) {
      return Error(ErrorCode::kOutOfRange,
                   "a prompt of {} tokens plus {} to generate exceeds "
                   "the GPU cache of {} tokens",
                   prompt.size(), max_new_tokens, capacity_);
    }
    const auto start = Clock::now();
    SKV_ASSIGN_OR_RETURN(const int32_t first, Prefill(prompt));
    *prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();

    answers->assign(policies.size(), {});
    SKV_RETURN_IF_ERROR(AnswerOnCpu(prompt, max_new_tokens, policies, answers));
    int full_index = -1;
    // Fidelity: full attention (policy 0, Check made sure) answers first, in a copy of the
    // prompt's slot, keeping its logits at every step for the others to be compared with.
    Reference reference;
    if (fidelity) {
      SKV_RETURN_IF_ERROR(model_->CopySlot(0, 1));
      SKV_RETURN_IF_ERROR(Decode(first, max_new_tokens, nullptr, &(*answers)[0], 1, &reference));
      reference.tokens = (*answers)[0].tokens;
      SKV_RETURN_IF_ERROR(Follow(reference, false, &(*answers)[0].fidelity));
    }
    for (size_t p = 0; p < policies.size(); ++p) {
      if (!OnGpu(policies[p])) continue;
      if (kv::IsPolicy(policies[p], kv::PolicyKind::kFull)) {
        full_index = static_cast<int>(p);
        continue;
      }
      SKV_ASSIGN_OR_RETURN(const Attendance attendance,
                           ShadowKvAttendance(policies[p], static_cast<int64_t>(prompt.size())));
      eval::BackendAnswer& answer = (*answers)[p];
      if (fidelity) {  // first along full attention's answer, from a compression of its own
        SKV_RETURN_IF_ERROR(StartShadowKv(policies[p]));
        SKV_RETURN_IF_ERROR(Follow(reference, true, &answer.fidelity));
        model_->FreeShadowKv();
      }
      SKV_RETURN_IF_ERROR(StartShadowKv(policies[p]));
      model_->ResetShadowKvCounters();
      SKV_RETURN_IF_ERROR(Decode(first, max_new_tokens, &attendance, &answer));
      SKV_RETURN_IF_ERROR(ShadowKvCounts(policies[p], attendance, &answer));
      model_->FreeShadowKv();
    }
    if (full_index >= 0) {
      eval::BackendAnswer& answer = (*answers)[full_index];
      if (!fidelity) SKV_RETURN_IF_ERROR(Decode(first, max_new_tokens, nullptr, &answer));
      FullCacheCounts(fidelity ? 1 : 0, &answer);
    }
    return Status::Ok();
  }

  // Conversations: full attention in slot 0, ShadowKV in sequence 0 compressed from it; later
  // turns' follow-ups go in one decode step per token, as the server continues a held sequence,
  // or with `recompress_followups` ShadowKV's are prefilled with full attention into slot 0,
  // which the held sequence is decompressed into first, and the whole is compressed again.
  Status OpenConversation(const std::vector<int32_t>& tokens, const kv::KvPolicyConfig& policy,
                          int32_t* first, double* prefill_seconds) override {
    CloseConversation();
    if (static_cast<int64_t>(tokens.size()) + 1 > capacity_) {
      return Error(ErrorCode::kOutOfRange, "a conversation of {} tokens fills the GPU cache of {}",
                   tokens.size(), capacity_);
    }
    const auto start = Clock::now();
    SKV_ASSIGN_OR_RETURN(*first, Prefill(tokens));
    conversation_policy_ = policy;
    conversation_carried_ = {};
    if (kv::IsPolicy(policy, kv::PolicyKind::kShadowKv)) {
      SKV_ASSIGN_OR_RETURN(conversation_attendance_,
                           ShadowKvAttendance(policy, static_cast<int64_t>(tokens.size())));
      SKV_RETURN_IF_ERROR(StartShadowKv(policy, keep_keys_));
      model_->ResetShadowKvCounters();
      conversation_ = Conversation::kShadowKv;
    } else {
      conversation_ = Conversation::kFull;
    }
    *prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return Status::Ok();
  }

  Status RunConversation(eval::GreedyStream& stream, eval::BackendAnswer* answer) override {
    if (conversation_ == Conversation::kNone) {
      return Error(ErrorCode::kInternal, "no conversation is open");
    }
    const bool shadowkv = conversation_ == Conversation::kShadowKv;
    if (shadowkv && recompress_followups_ && stream.feed.size() > 1) {
      SKV_RETURN_IF_ERROR(RecompressWith(stream, answer));
    }
    SKV_RETURN_IF_ERROR(Run(stream, shadowkv ? &conversation_attendance_ : nullptr, answer, 0));
    if (shadowkv) {
      SKV_RETURN_IF_ERROR(ShadowKvCounts(conversation_policy_, conversation_attendance_, answer));
      answer->stats.chunk_selections += conversation_carried_.chunk_selections;
      answer->stats.chunk_hits += conversation_carried_.chunk_hits;
      answer->stats.head_steps += conversation_carried_.head_steps;
      answer->stats.head_selections += conversation_carried_.head_selections;
    } else {
      FullCacheCounts(0, answer);
    }
    return Status::Ok();
  }

  void CloseConversation() override {
    if (conversation_ == Conversation::kShadowKv) model_->FreeShadowKv();
    conversation_ = Conversation::kNone;
  }

 private:
  // What a GPU ShadowKV sequence attends per decode query and layer, from the same plan its
  // kernels follow (shadowkv_plan.h): its outlier and budget chunks, then the exact tokens from
  // the first exact position to the new token.
  struct Attendance {
    int64_t selected_tokens = 0;  // (outlier + budget chunks) * chunk size
    int64_t exact_first = 0;      // first exact position right after compression
    int chunk_size = 0;
    int local_window = 0;
    int64_t outlier_chunks = 0;
  };
  Result<Attendance> ShadowKvAttendance(const kv::KvPolicyConfig& config,
                                        int64_t prompt_tokens) const {
    const ModelConfig& c = model_->config();
    SKV_ASSIGN_OR_RETURN(
        const cuda::SkvGeometry geometry,
        cuda::MakeSkvGeometryFor(config, c, c.num_kv_heads, capacity_));
    SKV_ASSIGN_OR_RETURN(const cuda::SkvCompressionPlan plan,
                         cuda::PlanSkvCompression(config, geometry, prompt_tokens));
    Attendance a;
    a.selected_tokens = static_cast<int64_t>(plan.info.outlier_chunks + plan.info.budget_chunks) *
                        geometry.chunk_size;
    a.exact_first = plan.exact_first;
    a.chunk_size = geometry.chunk_size;
    a.local_window = geometry.local_window;
    a.outlier_chunks = plan.info.outlier_chunks;
    return a;
  }

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
      if (!OnGpu(policies[p])) {
        (*answers)[p] = std::move(cpu_answers[next++]);
      }
    }
    return Status::Ok();
  }

  // recompress_followups: the open ShadowKV conversation's sequence into slot 0, the stream's
  // feed prefilled there with full attention (counted as attending every held token), the
  // prediction pushed to the stream, and the slot compressed again into sequence 0.
  Status RecompressWith(eval::GreedyStream& stream, eval::BackendAnswer* answer) {
    const int64_t held = model_->shadowkv_length(0);
    if (held + std::ssize(stream.feed) + 1 > capacity_) return Status::Ok();  // Run truncates
    SKV_RETURN_IF_ERROR(model_->DecompressShadowKv(0, 0));
    std::vector<float> logits(model_->config().vocab_size);
    const std::span<const int32_t> feed(stream.feed);
    for (size_t begin = 0; begin < feed.size(); begin += prefill_chunk_) {
      const size_t count = std::min(feed.size() - begin, static_cast<size_t>(prefill_chunk_));
      const cuda::CudaStepInput input{0, feed.subspan(begin, count),
                                      begin + count == feed.size() ? logits.data() : nullptr};
      SKV_RETURN_IF_ERROR(model_->Forward(std::span<const cuda::CudaStepInput>(&input, 1)));
    }
    const ModelConfig& c = model_->config();
    for (int64_t i = 1; i <= std::ssize(stream.feed); ++i) {
      answer->stats.prepare_calls += c.num_layers;
      answer->stats.context_tokens += (held + i) * c.num_layers;
      answer->stats.attended_tokens += (held + i) * c.num_layers;
    }
    const cuda::CudaShadowKvStats stats = model_->shadowkv_stats();
    conversation_carried_.chunk_selections += stats.chunks_selected;
    conversation_carried_.chunk_hits += stats.chunk_hits;
    conversation_carried_.head_steps += stats.head_steps;
    conversation_carried_.head_selections += stats.head_selections;
    // The same sequence compressed again in place (its buffers and solver kept, as the server's).
    SKV_RETURN_IF_ERROR(model_->FreeShadowKvValues(0));
    SKV_ASSIGN_OR_RETURN(conversation_attendance_,
                         ShadowKvAttendance(conversation_policy_, model_->slot_length(0)));
    SKV_RETURN_IF_ERROR(CompressSlot(keep_keys_));
    model_->ResetShadowKvCounters();
    stream.feed.clear();
    eval::PushToken(stream, Argmax(logits), tokenizer_);
    return Status::Ok();
  }

  // Prefills `prompt` into slot 0 (emptied first); the token it predicts.
  Result<int32_t> Prefill(const std::vector<int32_t>& prompt) {
    model_->ResetSlot(0);
    std::vector<float> logits(model_->config().vocab_size);
    for (size_t begin = 0; begin < prompt.size(); begin += prefill_chunk_) {
      const size_t count = std::min(prompt.size() - begin, static_cast<size_t>(prefill_chunk_));
      const bool last = begin + count == prompt.size();
      const cuda::CudaStepInput input{0, std::span<const int32_t>(prompt).subspan(begin, count),
                                      last ? logits.data() : nullptr};
      SKV_RETURN_IF_ERROR(model_->Forward(std::span<const cuda::CudaStepInput>(&input, 1)));
    }
    return Argmax(logits);
  }

  // The tokens full-cache slot `slot` holds and their bf16 keys and values of every layer.
  void FullCacheCounts(int slot, eval::BackendAnswer* answer) const {
    const ModelConfig& c = model_->config();
    answer->kv_tokens = model_->slot_length(slot);
    answer->memory.fast_bytes =
        int64_t{2} * 2 * c.num_layers * c.num_kv_heads * c.head_dim * answer->kv_tokens;
  }

  // ShadowKV sequence 0's chunk counts since ResetShadowKvCounters, ranks, outliers, bytes and
  // the tokens it holds.
  Status ShadowKvCounts(const kv::KvPolicyConfig& config, const Attendance& attendance,
                        eval::BackendAnswer* answer) const {
    const cuda::CudaShadowKvStats stats = model_->shadowkv_stats();
    answer->stats.chunk_selections = stats.chunks_selected;
    answer->stats.chunk_hits = stats.chunk_hits;
    answer->stats.head_steps = stats.head_steps;  // select_drift only
    answer->stats.head_selections = stats.head_selections;
    answer->rank = stats.rank;
    SKV_ASSIGN_OR_RETURN(const std::vector<int32_t> ranks, model_->ShadowKvLayerRanks(0));
    answer->layer_ranks.assign(ranks.begin(), ranks.end());
    // The first global layer's, as the CPU reports (windowed layers report 0).
    for (int32_t rank : ranks) {
      if (rank > 0) {
        answer->rank = rank;
        break;
      }
    }
    answer->outlier_chunks = attendance.outlier_chunks;
    SKV_ASSIGN_OR_RETURN(const auto bytes, model_->ShadowKvBytesPerSequence(config, capacity_));
    answer->memory = {bytes.first, bytes.second};
    answer->kv_tokens = model_->shadowkv_length(0);
    return Status::Ok();
  }

  // Full attention's answer and its logits at every step ([steps, vocab]), for --fidelity.
  struct Reference {
    std::vector<int32_t> tokens;
    std::vector<float> logits;
  };

  // A fresh ShadowKV sequence 0 of `config` compressed from the prompt in slot 0; with
  // `keep_keys` it keeps the prompt's exact keys for a later turn's recompression.
  Status StartShadowKv(const kv::KvPolicyConfig& config, bool keep_keys = false) {
    SKV_RETURN_IF_ERROR(model_->AllocateShadowKv(config, 1, capacity_));
    return CompressSlot(keep_keys);
  }

  // Sequence 0 (allocated, without values) compressed from slot 0.
  Status CompressSlot(bool keep_keys) {
    SKV_RETURN_IF_ERROR(model_->AllocateShadowKvValues(0, /*on_host=*/false));
    if (keep_keys) SKV_RETURN_IF_ERROR(model_->AllocateShadowKvKeys(0));
    return model_->CompressToShadowKv(0, 0);
  }

  // Feeds the reference's tokens (all but the last) to ShadowKV sequence 0, or without
  // `on_shadowkv` compares the reference with itself, into `fidelity` (eval::RunTeacherForced's
  // measure).
  Status Follow(const Reference& reference, bool on_shadowkv, eval::Fidelity* fidelity) {
    const int64_t vocab = model_->config().vocab_size;
    std::vector<float> logits(vocab);
    const cuda::CudaSampling greedy;
    const int index = 0;
    for (size_t j = 0; j + 1 < reference.tokens.size(); ++j) {
      const std::span<const float> want(reference.logits.data() + j * vocab, vocab);
      if (on_shadowkv) {
        int32_t token = reference.tokens[j];
        SKV_RETURN_IF_ERROR(model_->ShadowKvDecodeStep(
            std::span<const int>(&index, 1), std::span<int32_t>(&token, 1), greedy, logits.data()));
        eval::AddFidelityStep(want, logits, fidelity);
      } else {
        eval::AddFidelityStep(want, want, fidelity);
      }
    }
    return Status::Ok();
  }

  // Greedy decoding from `first` (the prefill's next token) in full-cache slot `slot`, or with
  // `shadowkv` in ShadowKV sequence 0; counts the tokens each step's queries attend. With
  // `record`, each step's logits are appended to record->logits.
  Status Decode(int32_t first, int max_new_tokens, const Attendance* shadowkv,
                eval::BackendAnswer* answer, int slot = 0, Reference* record = nullptr) {
    eval::GreedyStream stream;
    stream.remaining = max_new_tokens;
    eval::PushToken(stream, first, tokenizer_);
    SKV_RETURN_IF_ERROR(Run(stream, shadowkv, answer, slot, record));
    answer->tokens = std::move(stream.generated);
    answer->truncated = stream.truncated;
    return Status::Ok();
  }

  // Runs `stream` until it is done: its feed one token per decode step (only the last one's
  // prediction is kept), then its own greedy tokens. Counts attended tokens into answer->stats.
  Status Run(eval::GreedyStream& stream, const Attendance* shadowkv, eval::BackendAnswer* answer,
             int slot, Reference* record = nullptr) {
    const cuda::CudaSampling greedy;
    const int index = shadowkv ? 0 : slot;
    const int64_t vocab = model_->config().vocab_size;
    const ModelConfig& c = model_->config();
    const int64_t windowed = std::count(c.layer_windowed.begin(), c.layer_windowed.end(), true);
    while (!stream.done()) {
      const int64_t length = shadowkv ? model_->shadowkv_length(0) : model_->slot_length(slot);
      if (length + std::ssize(stream.feed) > capacity_) {
        stream.truncated = true;
        stream.feed.clear();
        break;
      }
      const int64_t held = length + 1;  // the step's own token included
      const int64_t global =
          shadowkv ? shadowkv->selected_tokens + held -
                         cuda::SkvExactFirst(held, shadowkv->exact_first, shadowkv->chunk_size,
                                             shadowkv->local_window)
                   : held;
      // Counted per layer, as the CPU policies count: a sliding-window layer attends its window
      // under every policy.
      answer->stats.prepare_calls += c.num_layers;
      answer->stats.context_tokens += held * c.num_layers;
      answer->stats.attended_tokens += (c.num_layers - windowed) * global +
                                       windowed * std::min<int64_t>(held, c.sliding_window);
      int32_t token = stream.feed.front();
      const std::span<const int> seqs(&index, 1);
      const std::span<int32_t> tokens(&token, 1);
      float* logits = nullptr;
      if (record) {
        record->logits.resize(record->logits.size() + vocab);
        logits = record->logits.data() + record->logits.size() - vocab;
      }
      SKV_RETURN_IF_ERROR(shadowkv ? model_->ShadowKvDecodeStep(seqs, tokens, greedy, logits)
                                   : model_->DecodeStep(seqs, tokens, greedy, logits));
      if (stream.feed.size() > 1) {
        stream.feed.erase(stream.feed.begin());  // a follow-up token: its prediction is not used
      } else {
        eval::PushToken(stream, token, tokenizer_);
      }
    }
    return Status::Ok();
  }

  // Full attention, and ShadowKV where this model's runs on the GPU.
  bool OnGpu(const kv::KvPolicyConfig& config) const {
    return kv::IsPolicy(config, kv::PolicyKind::kFull) ||
           (shadowkv_on_gpu_ && kv::IsPolicy(config, kv::PolicyKind::kShadowKv));
  }

  std::unique_ptr<cuda::CudaModel> model_;
  CpuModel& cpu_model_;
  const Tokenizer& tokenizer_;
  mutable int cpu_policies_ = 0;  // counted by Check
  int64_t capacity_;
  int prefill_chunk_;
  int slots_;
  bool shadowkv_on_gpu_;  // CudaModel::ShadowKvRunsHere
  bool recompress_followups_;
  bool keep_keys_;  // --held-turns exact: recompress from the prompt's kept exact keys
  // The open conversation (OpenConversation .. CloseConversation).
  enum class Conversation { kNone, kFull, kShadowKv };
  Conversation conversation_ = Conversation::kNone;
  kv::KvPolicyConfig conversation_policy_;
  Attendance conversation_attendance_;
  kv::PolicyStats conversation_carried_;  // chunk counts of the sequences recompressed away
};

}  // namespace

Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string& model_path,
                                                                 CpuModel& cpu_model,
                                                                 int64_t max_tokens,
                                                                 int prefill_chunk, bool fidelity,
                                                                 bool recompress_followups,
                                                                 bool keep_keys) {
  cuda::CudaModelOptions options;
  options.max_batch = 1;
  options.max_step_tokens = prefill_chunk;
  options.kernels = KernelOptionsFromFlags();
  SKV_ASSIGN_OR_RETURN(auto model, cuda::CudaModel::Load(model_path, options));
  const int slots = fidelity ? 2 : 1;
  SKV_RETURN_IF_ERROR(model->AllocateKvCache(slots, max_tokens, /*keep_pre_rope_keys=*/true));
  return std::unique_ptr<eval::AnswerBackend>(
      new CudaEvalBackend(std::move(model), cpu_model, max_tokens, prefill_chunk, slots,
                          recompress_followups, keep_keys));
}

#else

Result<std::unique_ptr<eval::AnswerBackend>> MakeCudaEvalBackend(const std::string&, CpuModel&,
                                                                 int64_t, int, bool, bool, bool) {
  return Error(ErrorCode::kUnsupported, "{}", kBuiltWithoutCuda);
}

#endif  // SHADOWKV_HAVE_CUDA

}  // namespace shadowkv::app
