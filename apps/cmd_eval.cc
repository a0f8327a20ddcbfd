// `shadowkv eval`: RULER-style long-context tasks, the NIAH depth grid and multi-turn NIAH under
// several KV policies at once (one shared prefill per sample), with tables, JSON, CSV and plots;
// answered on the CPU, or with --device cuda by full attention and ShadowKV on the GPU.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "commands.h"
#include "cuda_environment.h"
#include "eval/haystack.h"
#include "eval/report.h"
#include "eval/runner.h"
#include "format/chat_template.h"
#include "kv/policies.h"
#include "model/cpu_model.h"
#include "options.h"

#ifdef SHADOWKV_HAVE_CUDA
#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/prefill_record.h"
#include "gpu/model/cuda_model.h"
#include "gpu/model/shadowkv_plan.h"
#endif

namespace shadowkv::app {
namespace {

using Clock = std::chrono::steady_clock;

struct EvalOptions {
  ModelOptions model;
  kv::KvPolicyConfig kv;
  std::string tasks = "all";
  std::string lengths = "4k";
  int samples = 4;
  uint64_t seed = 42;
  double depth = -1.0;
  std::string haystack;
  bool niah_grid = false;
  int grid_depths = 10;
  int multi_turn = 0;
  bool fresh_turns = false;
  std::string held_turns;  // --held-turns (GPU ShadowKV conversations; empty: recompress)
  bool fidelity = false;
  int prefill_chunk = 512;
  Device device = Device::kCpu;  // with cuda, full and shadowkv are answered on the GPU
  bool plain = false;
  bool quiet = false;
  std::string json_path;
  std::string csv_path;
  std::string png_path;
};

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// "4k" = 4096, "1.5k" = 1536, "128K", "1m", or a plain token count.
Result<int64_t> ParseLength(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix = end ? std::string(end) : "";
  if (suffix == "k" || suffix == "K") {
    scale = 1024;
  } else if (suffix == "m" || suffix == "M") {
    scale = 1024 * 1024;
  } else if (!suffix.empty()) {
    return Error(ErrorCode::kInvalidArgument, "cannot read context length '{}'", text);
  }
  const auto tokens = static_cast<int64_t>(std::llround(value * scale));
  if (end == text.c_str() || tokens < 64) {
    return Error(ErrorCode::kInvalidArgument, "context length '{}' is not a length of at least 64",
                 text);
  }
  return tokens;
}

std::string FormatDuration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// sha256 of the model file through sha256sum, or "" where that is not available.
std::string FileSha256(const std::string& path) {
  std::string quoted = "'";
  for (char c : path) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  FILE* pipe = popen(("sha256sum -- " + quoted + " 2>/dev/null").c_str(), "r");
  if (!pipe) return "";
  char buffer[128] = {};
  const size_t got = std::fread(buffer, 1, 64, pipe);
  pclose(pipe);
  return got == 64 ? std::string(buffer, 64) : "";
}

// The report of a run still going to `json_path`, through a temporary file renamed over it so a
// reader never sees half a file. A failure only costs the partial copy: it is not reported.
void WritePartialReport(const eval::EvalReport& partial, const std::string& model_path,
                        const std::string& json_path) {
  eval::EvalReport report = partial;
  report.model_path = model_path;
  const std::string temporary = json_path + ".partial";
  {
    std::ofstream out(temporary);
    out << eval::ReportToJson(report).dump(1) << "\n";
    if (!out) return;
  }
  std::rename(temporary.c_str(), json_path.c_str());
}

bool NeedsCorpus(const eval::EvalSettings& settings) {
  if (settings.mode == eval::EvalMode::kMultiTurn) return true;
  for (const std::string& task : settings.tasks) {
    if (task != "niah_single_1" && task != "niah_multikey_2" && task != "niah_multikey_3" &&
        task != "vt" && task != "fwe" && task != "passkey") {
      return true;
    }
  }
  return false;
}

#ifdef SHADOWKV_HAVE_CUDA

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
      answer.memory.fast_bytes = FullCacheBytes(fidelity ? 1 : 0);
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
      answer->kv_tokens = model_->shadowkv_length(0);
    } else {
      answer->memory.fast_bytes = FullCacheBytes(0);
      answer->kv_tokens = model_->slot_length(0);
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

  // bf16 keys and values of every layer for the tokens full-cache slot `slot` holds.
  int64_t FullCacheBytes(int slot) const {
    const ModelConfig& c = model_->config();
    return int64_t{2} * 2 * c.num_layers * c.num_kv_heads * c.head_dim * model_->slot_length(slot);
  }

  // ShadowKV sequence 0's chunk counts since ResetShadowKvCounters, ranks, outliers and bytes.
  Status ShadowKvCounts(const kv::KvPolicyConfig& config, const Attendance& attendance,
                        eval::BackendAnswer* answer) const {
    const cuda::CudaShadowKvStats stats = model_->shadowkv_stats();
    answer->stats.chunk_selections = stats.chunks_selected;
    answer->stats.chunk_hits = stats.chunk_hits;
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

// Loads `model_path` onto the GPU for prompts of up to `max_tokens` (prompt + answer);
// `cpu_model` (the same file) decodes the policies that have no GPU kernels.
// kUnsupported without a CUDA build or GPU, or for a model the CUDA backend cannot run.
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

int RunEvalCommand(const EvalOptions& o) {
  eval::EvalSettings settings;
  settings.mode = o.niah_grid    ? eval::EvalMode::kNiahGrid
                  : o.multi_turn ? eval::EvalMode::kMultiTurn
                                 : eval::EvalMode::kTasks;
  if (o.niah_grid && o.multi_turn) return Fail("--niah-grid and --multi-turn are separate modes");
  if (!o.held_turns.empty() && o.device != Device::kCuda) {
    return Fail("--held-turns chooses the GPU's way (--device cuda); the CPU's policies take "
                "follow-ups in their own sequences");
  }
  if (o.tasks == "all") {
    if (settings.mode == eval::EvalMode::kNiahGrid) {
      settings.tasks = {"niah_single_2"};
    } else {
      for (const auto& task : eval::AllTasks()) settings.tasks.push_back(task.name);
    }
  } else {
    settings.tasks = SplitList(o.tasks);
    for (const std::string& task : settings.tasks) {
      if (!eval::FindTask(task)) {
        return Fail(fmt::format("unknown task '{}' ({})", task, eval::kUnavailableTasksNote));
      }
    }
  }
  for (const std::string& text : SplitList(o.lengths)) {
    auto length = ParseLength(text);
    if (!length.ok()) return Fail(length.status().ToString());
    settings.lengths.push_back(*length);
  }
  settings.samples = o.samples;
  settings.seed = o.seed;
  settings.depth = o.depth;
  settings.turns = o.multi_turn;
  settings.fresh_turns = o.fresh_turns;
  settings.fidelity = o.fidelity;
  settings.prefill_chunk = o.prefill_chunk;
  for (int i = 0; i < o.grid_depths; ++i) {
    settings.grid_depths.push_back(
        o.grid_depths == 1 ? 50.0 : std::round(1000.0 * i / (o.grid_depths - 1)) / 10.0);
  }
  for (const std::string& name : SplitList(o.kv.policy)) {
    auto config = kv::ParseKvVariant(name, o.kv);
    if (!config.ok()) return Fail(config.status().ToString());
    settings.policies.push_back(*config);
  }

  const std::string model_path = ResolveModelPath(o.model);
  auto model_or = LoadModel(o.model);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  CpuModel& model = **model_or;
  eval::PromptFormat format = eval::PromptFormat::Plain();
  if (!o.plain) {
    auto chat_template = DetectChatTemplate(model.file());
    if (!chat_template.ok()) {
      return Fail(chat_template.status().ToString() + " (use --plain for no chat template)");
    }
    format = eval::PromptFormat::Chat(*chat_template);
  }
  eval::EssayCorpus corpus;
  std::vector<std::string> vocabulary;
  if (NeedsCorpus(settings) || !o.haystack.empty()) {
    auto loaded = eval::LoadEssayCorpus(o.haystack);
    if (!loaded.ok()) return Fail(loaded.status().ToString());
    corpus = std::move(loaded).value();
    vocabulary = eval::CorpusVocabulary(corpus);
  }
  const eval::TaskContext tasks =
      eval::MakeTaskContext(model, format, corpus.words.empty() ? nullptr : &corpus, &vocabulary);

  std::unique_ptr<eval::AnswerBackend> backend;
  if (o.device == Device::kCuda) {
    int64_t longest = 0;
    for (int64_t length : settings.lengths) longest = std::max(longest, length);
    auto made =
        MakeCudaEvalBackend(model_path, model, std::min(longest, model.config().context_length),
                            o.prefill_chunk, settings.fidelity, o.held_turns != "decode",
                            o.held_turns == "exact");
    if (!made.ok()) return Fail(made.status().ToString());
    backend = std::move(made).value();
    // Before the header line: a policy the backend cannot run fails here, and the numerics it
    // reports depend on the policies.
    if (Status checked = backend->Check(settings.policies, settings.fidelity,
                                       settings.mode == eval::EvalMode::kMultiTurn);
        !checked.ok()) {
      return Fail(checked.ToString());
    }
  }

  std::fprintf(stderr, "eval: %s; model %s (%s; %s numerics); prompts: %s; policies:",
               eval::EvalModeName(settings.mode), model_path.c_str(),
               model.config().Summary().c_str(),
               backend ? backend->numerics().c_str() : NumericsName(model.numerics()),
               format.name().c_str());
  for (const auto& config : settings.policies) {
    std::fprintf(stderr, " %s", config.display_name().c_str());
    if (kv::IsPolicy(config, kv::PolicyKind::kFull)) continue;
    std::string budgets;
    for (int64_t length : settings.lengths) {
      budgets += fmt::format("{}{}", budgets.empty() ? "" : "/", config.BudgetTokens(length));
    }
    std::fprintf(stderr, "(budget %s)", budgets.c_str());
  }
  std::fprintf(stderr, "\n");

  std::string json_path = o.json_path;
  if (json_path.empty() && !o.png_path.empty()) json_path = "eval.json";
  const bool terminal = isatty(STDERR_FILENO) && !o.quiet;
  const auto start = Clock::now();
  auto last_line = start, last_partial = start;
  auto progress = [&](const eval::EvalProgress& p) {
    // Every 30 s the questions answered so far go to the JSON file ("complete": false), so a run
    // stopped before its end leaves what it did; the finished report replaces it.
    if (!json_path.empty() && p.partial && p.done > 0 && !p.current.empty() &&
        std::chrono::duration<double>(Clock::now() - last_partial).count() >= 30.0) {
      WritePartialReport(*p.partial, model_path, json_path);
      last_partial = Clock::now();
    }
    if (o.quiet) return;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    std::string eta = "?";
    if (p.done_weight > 0) {
      eta = FormatDuration(elapsed / p.done_weight * (p.total_weight - p.done_weight));
    }
    const std::string line =
        fmt::format("[eval] {}/{} done | {} elapsed, ETA {} | {}", p.done, p.total,
                    FormatDuration(elapsed), eta, p.current.empty() ? "finished" : p.current);
    if (terminal) {
      std::fprintf(stderr, "\r%s\033[K", line.c_str());
      if (p.current.empty()) std::fprintf(stderr, "\n");
    } else if (p.current.empty() || p.done == 0 ||
               std::chrono::duration<double>(Clock::now() - last_line).count() >= 30.0) {
      std::fprintf(stderr, "%s\n", line.c_str());
      last_line = Clock::now();
    }
  };
  auto report_or = eval::RunEval(model, format, tasks, settings, progress, backend.get());
  if (terminal) std::fprintf(stderr, "\n");
  if (!report_or.ok()) return Fail(report_or.status().ToString());
  eval::EvalReport& report = *report_or;
  report.model_path = model_path;
  report.model_sha256 = FileSha256(model_path);

  std::fputs(eval::FormatTables(report).c_str(), stdout);
  std::printf("%zu questions in %s\n", report.questions.size(),
              FormatDuration(report.seconds).c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << eval::ReportToJson(report).dump(1) << "\n";
    if (!out) return Fail(fmt::format("cannot write '{}'", json_path));
    std::printf("JSON written to %s\n", json_path.c_str());
  }
  if (!o.csv_path.empty()) {
    std::ofstream out(o.csv_path);
    out << eval::ReportToCsv(report);
    if (!out) return Fail(fmt::format("cannot write '{}'", o.csv_path));
    std::printf("CSV written to %s\n", o.csv_path.c_str());
  }
  if (!o.png_path.empty()) {
    std::fflush(stdout);
    const std::string command = fmt::format("python3 '{}/scripts/plot_eval.py' '{}' '{}'",
                                            SHADOWKV_SOURCE_DIR, json_path, o.png_path);
    if (std::system(command.c_str()) != 0)
      return Fail("plotting failed (needs python3-matplotlib)");
  }
  return 0;
}

}  // namespace

Command AddEvalCommand(CLI::App& app) {
  auto options = std::make_shared<EvalOptions>();
  options->kv.policy = "full,shadowkv,snapkv,quest,streaming";
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Long-context accuracy (RULER-style tasks, NIAH grid, multi-turn NIAH) per KV policy");
  AddModelOptions(*cmd, options->model);
  AddKvOptions(*cmd, options->kv);
  cmd->get_option("--kv")->description(
      "KV policies to compare, comma-separated: full, shadowkv, snapkv, quest, streaming; a "
      "variant takes its own settings, e.g. shadowkv:rank=64:budget=512");
  cmd->add_option("--tasks", options->tasks,
                  "comma-separated tasks or 'all': niah_single_1..3, niah_multikey_1..3, "
                  "niah_multivalue, niah_multiquery, vt, cwe, fwe, passkey")
      ->capture_default_str();
  cmd->add_option("--lengths", options->lengths,
                  "context lengths (prompt + answer), e.g. 2k,4k,8192")
      ->capture_default_str();
  cmd->add_option("--samples", options->samples, "samples per task and length (per grid cell)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", options->seed, "seed of the task synthesis")->capture_default_str();
  cmd->add_option("--depth", options->depth,
                  "needle depth in percent of the haystack (default: random per sample)")
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--haystack", options->haystack,
                  "essay haystack text file (.gz allowed; default: the Jargon File of Debian's "
                  "jargon-text)");
  auto* grid = cmd->add_flag("--niah-grid", options->niah_grid,
                             "NIAH grid: context lengths x needle depths (task: niah_single_2, "
                             "or the one given with --tasks)");
  cmd->add_option("--grid-depths", options->grid_depths, "needle depths of the grid, 0..100%")
      ->capture_default_str()
      ->check(CLI::Range(1, 101));
  auto* turns =
      cmd->add_option("--multi-turn", options->multi_turn,
                      "multi-turn NIAH: N needles, asked one per turn in one conversation")
          ->check(CLI::Range(1, 40))
          ->excludes(grid);
  cmd->add_flag("--fresh-turns", options->fresh_turns,
                "multi-turn: prefill each policy's whole conversation again for every turn "
                "instead of reusing its KV (the reference for reuse)")
      ->needs(turns);
  cmd->add_option("--held-turns", options->held_turns,
                  "multi-turn with --device cuda: how a held ShadowKV conversation takes a later "
                  "turn's follow-up, as `serve --held-turns` does: recompress (the sequence "
                  "decompressed into a full-cache slot, the follow-up prefilled there with full "
                  "attention, the whole compressed again; the default), exact (the same from a "
                  "copy of the prompt's exact keys kept at compression) or decode (one decode "
                  "step per token)")
      ->check(CLI::IsMember({"decode", "recompress", "exact"}))
      ->needs(turns);
  cmd->add_flag("--fidelity", options->fidelity,
                "tasks and grid: after the answers every policy also follows the first "
                "policy's answer token by token; the table footer gives how often its top token "
                "is the first policy's and the mean KL divergence from it (with --device cuda: "
                "full first, GPU policies only)")
      ->excludes(turns);
  cmd->add_option("--prefill-chunk", options->prefill_chunk, "prompt tokens per forward step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  AddDeviceOption(
      *cmd, options->device,
      "cpu | cuda: with cuda, full attention and ShadowKV answer on the GPU (bf16), the "
      "other policies (and ShadowKV where its kernels do not take the model's heads) decode on "
      "the CPU from the GPU's prefill; --multi-turn holds full attention's and ShadowKV's "
      "conversations on the GPU, one policy after another");
  cmd->add_flag("--plain", options->plain, "no chat template: the task text as is");
  cmd->add_flag("-q,--quiet", options->quiet, "no progress lines");
  cmd->add_option("--json", options->json_path,
                  "write the full report as JSON (while the run goes on, every 30 s the questions "
                  "answered so far, with \"complete\": false)");
  cmd->add_option("--csv", options->csv_path, "write the scores as CSV");
  cmd->add_option("--png", options->png_path,
                  "plot (scripts/plot_eval.py): heatmaps for --niah-grid, per-turn accuracy for "
                  "--multi-turn, bars otherwise");
  return [options] { return RunEvalCommand(*options); };
}

}  // namespace shadowkv::app
