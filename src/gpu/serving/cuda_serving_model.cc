#include "gpu/serving/cuda_serving_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "core/host_memory.h"
#include "gpu/tp/cuda_model_group.h"
#include "model/synthetic.h"
#include "ops/cuda/common/cuda_backend.h"

namespace shadowkv::cuda {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Status NotThroughPolicies() {
  return Error(ErrorCode::kUnsupported,
               "a GPU sequence runs only through its CUDA serving model's Forward");
}

}  // namespace

// One served sequence: a full-cache slot while it is prefilled (or for good, when its prompt is
// too short to compress), then a ShadowKV sequence. Gives both back when destroyed.
class CudaServingModel::Sequence final : public kv::SequenceKv {
 public:
  explicit Sequence(CudaServingModel* owner) : owner_(owner) {}
  ~Sequence() override { owner_->Release(*this); }

  Status Append(int, const kv::TokenBlock&) override { return NotThroughPolicies(); }
  Status Prepare(int, const float*, int, kv::AttentionInput*) override {
    return NotThroughPolicies();
  }
  Status FinishPrefill(int) override { return NotThroughPolicies(); }
  int64_t num_tokens() const override { return tokens_; }
  kv::MemoryUsage memory() const override {
    kv::MemoryUsage usage;
    if (slot_ >= 0) usage.fast_bytes += owner_->slot_bytes_;
    if (compressed_) {
      usage.fast_bytes += owner_->skv_bytes_;
      (values_on_host_ ? usage.slow_bytes : usage.fast_bytes) += owner_->skv_value_bytes_;
    }
    return usage;
  }
  // A compressed sequence's chunk counts are the device's, read when asked for (the scheduler
  // reads them as a request ends), not after every step.
  Result<std::unique_ptr<kv::SequenceKv>> Fork() const override { return owner_->Fork(*this); }
  const kv::PolicyStats& stats() const override {
    if (compressed_) {
      if (auto counts = owner_->group_->ShadowKvSequenceCounts(); counts.ok()) {
        CudaChunkCounts c = carried_;
        c += counts->at(static_cast<size_t>(sequence_));
        stats_.chunk_selections = c.selected;
        stats_.chunk_hits = c.hits;
        stats_.head_steps = c.head_steps;  // select_drift only
        stats_.head_selections = c.head_selections;
      }
    }
    return stats_;
  }

 private:
  friend class CudaServingModel;
  CudaServingModel* owner_;
  int slot_ = -1;      // full-cache slot, or -1
  int sequence_ = -1;  // ShadowKV sequence (reserved from the start), or -1
  bool compressed_ = false;
  bool values_on_host_ = false;
  bool recompress_ = false;  // decompressed for a later turn: compressed again after its last row
  CudaChunkCounts carried_;  // chunk counts of the compressions before the current one
  bool has_values_ = false;
  int64_t tokens_ = 0;
  mutable kv::PolicyStats stats_;
};

class CudaServingModel::Policy final : public kv::KvPolicy {
 public:
  Policy(CudaServingModel* owner, kv::KvPolicyConfig config, kv::KvGeometry geometry)
      : KvPolicy(std::move(config), std::move(geometry)), owner_(owner) {}
  std::string_view name() const override { return config_.policy; }
  Result<std::unique_ptr<kv::SequenceKv>> NewSequence() const override {
    return owner_->NewSequence();
  }
  kv::MemoryUsage EstimateMemory(int64_t) const override {
    // Every sequence takes a pool entry of the whole context, whatever its length.
    kv::MemoryUsage usage;
    usage.fast_bytes =
        owner_->shadowkv() ? owner_->skv_bytes_ + owner_->skv_value_bytes_ : owner_->slot_bytes_;
    return usage;
  }

 private:
  CudaServingModel* owner_;
};

namespace {

Status CheckServingOptions(const CudaServingOptions& o) {
  if (!kv::IsPolicy(o.kv, kv::PolicyKind::kFull) &&
      !kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv)) {
    return Error(ErrorCode::kUnsupported,
                 "--device cuda serves --kv full or shadowkv, not '{}' (the other policies run "
                 "on the CPU)",
                 o.kv.policy);
  }
  SKV_RETURN_IF_ERROR(o.kv.Validate());
  if (o.max_batch < 0 || o.max_batch > kMaxStepBatch || o.prefill_chunk < 1 || o.sequences < 0 ||
      o.prefill_slots < 0 || o.context < 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "batch ({}) must be in [0, {}], prefill chunk ({}) positive, sequences ({}), "
                 "prefill slots ({}) and context ({}) not negative",
                 o.max_batch, kMaxStepBatch, o.prefill_chunk, o.sequences, o.prefill_slots,
                 o.context);
  }
  return Status::Ok();
}

}  // namespace

template <typename MakeGroup>
Result<std::unique_ptr<CudaServingModel>> CudaServingModel::Assemble(
    const CudaServingOptions& o, std::unique_ptr<gguf::GgufFile> file,
    std::unique_ptr<Tokenizer> tokenizer, const ModelConfig& config, MakeGroup make_group) {
  if (tokenizer->vocab_size() != config.vocab_size) {
    return Error(ErrorCode::kCorrupt, "the tokenizer has {} tokens, the model {}",
                 tokenizer->vocab_size(), config.vocab_size);
  }
  if (o.context > config.context_length) {
    return Error(ErrorCode::kInvalidArgument, "a context of {} tokens is beyond the model's {}",
                 o.context, config.context_length);
  }
  const int64_t context = o.context > 0 ? o.context : config.context_length;
  const bool shadowkv = kv::IsPolicy(o.kv, kv::PolicyKind::kShadowKv);
  // The step buffers and graphs are sized for the batch: with the batch following a pool sized
  // from memory, for the most sequences that could fit (the pool is known only once the weights
  // are in).
  int batch = o.max_batch;
  if (batch == 0 && o.sequences > 0) batch = std::min(o.sequences, kMaxStepBatch);
  if (batch == 0) {
    // The pool keeps every compressed sequence's values on the device (MakePool).
    SKV_ASSIGN_OR_RETURN(const int64_t least,
                         LeastSequenceBytes(config, context, shadowkv ? &o.kv : nullptr,
                                            /*host_values=*/false, o.tensor_parallel));
    SKV_ASSIGN_OR_RETURN(batch, BatchBoundBeforeLoad(least));
  }
  CudaModelOptions model_options;
  model_options.max_batch = batch;
  model_options.max_step_tokens = o.prefill_chunk + batch;
  model_options.kernels = o.kernels;
  std::unique_ptr<CudaServingModel> m(new CudaServingModel());
  m->options_ = o;
  m->file_ = std::move(file);
  m->tokenizer_ = std::move(tokenizer);
  SKV_ASSIGN_OR_RETURN(m->group_, make_group(model_options));
  m->config_ = m->group_->config();
  m->config_.context_length = context;
  SKV_RETURN_IF_ERROR(m->MakePool());
  m->max_batch_ = o.max_batch > 0 ? o.max_batch : std::min(m->sequences_, batch);
  return m;
}

Result<std::unique_ptr<CudaServingModel>> CudaServingModel::Load(
    const std::string& path, const CudaServingOptions& options) {
  SKV_RETURN_IF_ERROR(CheckServingOptions(options));
  SKV_ASSIGN_OR_RETURN(auto file, gguf::GgufFile::Open(path));
  SKV_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::FromGguf(*file));
  SKV_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfig::FromGguf(*file));
  return Assemble(options, std::move(file), std::move(tokenizer), config,
                  [&](const CudaModelOptions& model_options) {
                    return CudaModelGroup::Load(path, model_options, options.tensor_parallel);
                  });
}

Result<std::unique_ptr<CudaServingModel>> CudaServingModel::CreateSynthetic(
    const ModelConfig& config, const CudaServingOptions& options) {
  SKV_RETURN_IF_ERROR(CheckServingOptions(options));
  SKV_ASSIGN_OR_RETURN(auto file, SyntheticVocabularyFile(config.vocab_size));
  SKV_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::FromGguf(*file));
  ModelConfig shaped = config;
  shaped.context_length = std::max(config.context_length, options.context);
  return Assemble(options, std::move(file), std::move(tokenizer), shaped,
                  [&](const CudaModelOptions& model_options) {
                    return CudaModelGroup::CreateSynthetic(shaped, /*seed=*/1, model_options,
                                                           options.tensor_parallel);
                  });
}

Status CudaServingModel::MakePool() {
  const int64_t context = config_.context_length;
  // Keys and values, and for ShadowKV the pre-RoPE keys too (half as much again).
  const int64_t per_token = group_->KvBytesPerToken();
  slot_bytes_ = (shadowkv() ? per_token + per_token / 2 : per_token) * context;
  if (shadowkv()) {
    SKV_ASSIGN_OR_RETURN(auto bytes, group_->ShadowKvBytesPerSequence(options_.kv, context));
    skv_bytes_ = bytes.first;
    skv_value_bytes_ = bytes.second;
  }
  int sequences = options_.sequences;
  int slots = shadowkv() && options_.prefill_slots > 0 ? options_.prefill_slots : sequences;
  if (sequences == 0) {
    // From memory, per GPU (each holds its ranks' share): full attention, every sequence a
    // slot; ShadowKV, the prompt slots first, then compressed sequences whose values all fit in
    // device memory (pinned host memory stays the fallback when fragmentation says otherwise).
    SKV_ASSIGN_OR_RETURN(const int64_t free_bytes, group_->FreeDeviceBytes());
    SKV_ASSIGN_OR_RETURN(const DeviceInfo device, QueryDevice());
    const int64_t devices = group_->num_devices();
    const int64_t room = free_bytes - kPoolReserveBytes;
    const int64_t slot_share = slot_bytes_ / devices;
    int64_t fits = 0;
    if (!shadowkv()) {
      fits = room > 0 ? room / slot_share : 0;
    } else {
      if (options_.prefill_slots == 0) slots = kDefaultPrefillSlots;
      const int64_t left = room - slots * slot_share;
      fits = left > 0 ? left / ((skv_bytes_ + skv_value_bytes_) / devices) : 0;
    }
    if (fits < 1) {
      return Error(ErrorCode::kResourceExhausted,
                   "no sequence of {} tokens fits in the {:.1f} GiB of device memory left after "
                   "the weights and step buffers (a full-cache slot takes {:.2f} GiB{}, {:.1f} "
                   "GiB stay free); lower --ctx-size{}",
                   context, free_bytes / kGiB, slot_share / kGiB,
                   shadowkv() ? fmt::format(", {} of them, and a ShadowKV sequence {:.2f} GiB",
                                            slots, (skv_bytes_ + skv_value_bytes_) / devices / kGiB)
                              : "",
                   kPoolReserveBytes / kGiB, shadowkv() ? " or --prefill-slots" : "");
    }
    sequences = static_cast<int>(std::min<int64_t>(fits, std::numeric_limits<int>::max() / 2));
    bound_ = MemoryBoundText(sequences, "sequences", free_bytes, device.total_bytes);
  }
  // Full attention: every sequence is a slot (sized from memory above, or given).
  if (!shadowkv()) slots = sequences;
  slots = std::min(slots, sequences);
  sequences_ = sequences;
  num_slots_ = slots;
  auto advice = [&](const Status& s) {
    return Error(s.code(),
                 "the GPU pool of {} sequences of {} tokens does not fit ({}); lower "
                 "--max-seqs{} or --ctx-size",
                 sequences, context, s.message(), shadowkv() ? ", --prefill-slots" : "");
  };
  if (Status s = group_->AllocateKvCache(slots, context, shadowkv()); !s.ok()) return advice(s);
  if (shadowkv()) {
    if (Status s = group_->AllocateShadowKv(options_.kv, sequences, context); !s.ok()) {
      return advice(s);
    }
    for (int i = sequences - 1; i >= 0; --i) free_sequences_.push_back(i);
    key_copy_bytes_ = per_token / 2 * context;
    kept_keys_limit_ = options_.kept_keys_limit_bytes >= 0 ? options_.kept_keys_limit_bytes
                                                           : HostAvailableBytes() / 4;
    keys_kept_.assign(static_cast<size_t>(sequences), false);
    // The prompt-key copies are pinned here, as many as the limit holds: pinning one (0.2 GiB
    // at Qwen2.5-0.5B's 32K, 7.7 GiB at Llama-3-8B's 122K) takes tens of milliseconds or more,
    // which inside the loop every request queued behind the first use of an index waited for.
    // Sequence indices are handed out lowest first, so these are the ones used.
    if (options_.recompress_turns && options_.keep_prompt_keys && key_copy_bytes_ > 0) {
      const int64_t copies = std::min<int64_t>(sequences, kept_keys_limit_ / key_copy_bytes_);
      for (int i = 0; i < copies; ++i) {
        const Status pinned = group_->AllocateShadowKvKeys(i);
        if (pinned.code() == ErrorCode::kResourceExhausted) break;  // a first use tries again
        if (!pinned.ok()) return advice(pinned);
      }
    }
  }
  for (int i = slots - 1; i >= 0; --i) free_slots_.push_back(i);
  return Status::Ok();
}

Result<bool> CudaServingModel::KeepPromptKeys(int index) {
  if (!options_.recompress_turns || !options_.keep_prompt_keys) return false;
  const auto at = static_cast<size_t>(index);
  if (!keys_kept_[at]) {
    const int64_t copies = std::count(keys_kept_.begin(), keys_kept_.end(), true);
    if ((copies + 1) * key_copy_bytes_ > kept_keys_limit_) return false;
  }
  const Status kept = group_->AllocateShadowKvKeys(index);
  if (kept.code() == ErrorCode::kResourceExhausted) return false;
  SKV_RETURN_IF_ERROR(kept);
  keys_kept_[at] = true;  // the copy stays with the index
  return true;
}

Status CudaServingModel::RemakePool(const kv::KvPolicyConfig& kv, int sequences, int prefill_slots,
                                    int64_t context) {
  {
    std::lock_guard lock(mutex_);
    const size_t held_slots = static_cast<size_t>(num_slots_) - free_slots_.size();
    const size_t held_sequences =
        shadowkv() ? static_cast<size_t>(sequences_) - free_sequences_.size() : 0;
    if (held_slots != 0 || held_sequences != 0) {
      return Error(ErrorCode::kInvalidArgument,
                   "the GPU pool is remade only when no sequence is alive ({} slots and {} "
                   "ShadowKV sequences are)",
                   held_slots, held_sequences);
    }
  }
  CudaServingOptions remade = options_;
  remade.kv = kv;
  remade.sequences = sequences;
  remade.prefill_slots = prefill_slots;
  remade.context = context;
  SKV_RETURN_IF_ERROR(CheckServingOptions(remade));
  if (context < 1 || context > group_->config().context_length) {
    return Error(ErrorCode::kInvalidArgument,
                 "a pool of {} tokens per sequence: the context must be in [1, {}]", context,
                 group_->config().context_length);
  }
  group_->FreeKvCache();
  group_->FreeShadowKv();
  free_slots_.clear();
  free_sequences_.clear();
  bound_.clear();
  options_ = remade;
  config_.context_length = context;
  SKV_RETURN_IF_ERROR(MakePool());
  if (options_.max_batch == 0) max_batch_ = std::min(sequences_, group_->options().max_batch);
  return Status::Ok();
}

Status CudaServingModel::WarmUp() {
  if (!shadowkv()) return Status::Ok();
  // Long enough to compress at the served budget (its chunks, the outliers and the window need
  // a little more than the budget), within the context.
  const int64_t length = std::min<int64_t>(
      config_.context_length - 1, 2 * options_.kv.BudgetTokens(config_.context_length) + 1024);
  if (length < 1) return Status::Ok();
  SKV_ASSIGN_OR_RETURN(auto sequence, NewSequence());
  const std::vector<int32_t> prompt(static_cast<size_t>(length), 0);
  const SamplingParams greedy;
  int32_t next = 0;
  for (int64_t first = 0; first < length; first += options_.prefill_chunk) {
    engine::StepRow row;
    row.kv = sequence.get();
    row.tokens = std::span<const int32_t>(prompt).subspan(
        first, std::min<int64_t>(options_.prefill_chunk, length - first));
    row.finish_prefill = first + std::ssize(row.tokens) == length;
    row.sampling = row.finish_prefill ? &greedy : nullptr;
    SKV_RETURN_IF_ERROR(Step(std::span(&row, 1), std::span(&next, 1)));
  }
  engine::StepRow decode;
  decode.kv = sequence.get();
  decode.tokens = std::span<const int32_t>(&next, 1);
  decode.sampling = &greedy;
  int32_t after = 0;
  return Step(std::span(&decode, 1), std::span(&after, 1));
}

Result<int> CudaServingModel::SequencesWithDeviceValues() {
  if (!shadowkv() || skv_value_bytes_ <= 0) return sequences_;
  SKV_ASSIGN_OR_RETURN(const int64_t free_bytes, group_->FreeDeviceBytes());
  const int64_t share = skv_value_bytes_ / group_->num_devices();
  const int64_t room = free_bytes - kPoolReserveBytes;
  return static_cast<int>(std::clamp<int64_t>(room / share, 0, sequences_));
}

CudaServingModel::~CudaServingModel() = default;

bool CudaServingModel::synthetic() const { return group_->synthetic(); }

std::string CudaServingModel::device() const {
  const int ranks = group_->size();
  if (ranks == 1) return "cuda";
  return fmt::format("cuda, {} ranks on {} GPU{} ({})", ranks, group_->num_devices(),
                     group_->num_devices() == 1 ? "" : "s", group_->communicator());
}

std::string CudaServingModel::Describe() const {
  const int64_t context = config_.context_length;
  std::string text = fmt::format(
      "{} sequences of up to {} tokens, {} full-cache slots ({:.2f} "
      "GiB each)",
      sequences_, context, num_slots_, slot_bytes_ / kGiB);
  if (shadowkv()) {
    text += fmt::format("; ShadowKV sequences {:.2f} GiB each plus {:.2f} GiB of values{} ({})",
                        skv_bytes_ / kGiB, skv_value_bytes_ / kGiB,
                        options_.kv.exact_keys != 0 ? " and exact keys" : "",
                        options_.kv.RerankReadsStore()
                            ? "device memory only: the re-rank reads the stored keys"
                            : "device memory while it lasts, then pinned host memory");
    if (options_.recompress_turns && options_.keep_prompt_keys) {
      text += fmt::format(
          "; later turns from the prompt's exact keys, kept in pinned host memory ({:.2f} GiB a "
          "sequence, {} sequence(s) within {:.1f} GiB; rank-r keys past that)",
          key_copy_bytes_ / kGiB,
          key_copy_bytes_ > 0 ? std::min<int64_t>(sequences_, kept_keys_limit_ / key_copy_bytes_)
                              : 0,
          kept_keys_limit_ / kGiB);
    } else if (options_.recompress_turns) {
      text += "; later turns from rank-r keys";
    }
  }
  text += fmt::format("; batch {}", max_batch_);
  if (!bound_.empty()) text += fmt::format(" ({})", bound_);
  return text;
}

Result<std::unique_ptr<kv::KvPolicy>> CudaServingModel::MakePolicy(
    const kv::KvPolicyConfig& config) const {
  if (config.policy != options_.kv.policy || config.budget_tokens != options_.kv.budget_tokens) {
    return Error(ErrorCode::kInvalidArgument,
                 "--device cuda serves one KV setting, the server's (policy {}, budget {}); "
                 "this request asks for policy {}, budget {}",
                 options_.kv.policy, options_.kv.budget_tokens, config.policy,
                 config.budget_tokens);
  }
  return std::unique_ptr<kv::KvPolicy>(
      new Policy(const_cast<CudaServingModel*>(this), config, KvGeometryOf(config_)));
}

Result<std::unique_ptr<kv::SequenceKv>> CudaServingModel::NewSequence() {
  std::lock_guard lock(mutex_);
  if (free_slots_.empty() || (shadowkv() && free_sequences_.empty())) {
    return Error(ErrorCode::kResourceExhausted, "every GPU sequence slot is in use");
  }
  auto sequence = std::make_unique<Sequence>(this);
  sequence->slot_ = free_slots_.back();
  free_slots_.pop_back();
  if (shadowkv()) {
    sequence->sequence_ = free_sequences_.back();
    free_sequences_.pop_back();
  }
  return std::unique_ptr<kv::SequenceKv>(std::move(sequence));
}

void CudaServingModel::Release(Sequence& s) {
  // Runs on the scheduler's thread between steps. A failure here leaves the entry out of the
  // pool rather than handing out a sequence in an unknown state.
  bool sequence_free = s.sequence_ >= 0;
  if (s.has_values_) sequence_free = group_->FreeShadowKvValues(s.sequence_).ok();
  if (s.slot_ >= 0) group_->ResetSlot(s.slot_);
  std::lock_guard lock(mutex_);
  if (s.slot_ >= 0) free_slots_.push_back(s.slot_);
  if (sequence_free) free_sequences_.push_back(s.sequence_);
}

void CudaServingModel::GiveBackSlot(Sequence& s) {
  group_->ResetSlot(s.slot_);
  std::lock_guard lock(mutex_);
  free_slots_.push_back(s.slot_);
  s.slot_ = -1;
}

Result<std::unique_ptr<kv::SequenceKv>> CudaServingModel::Fork(const Sequence& s) {
  // Values in host memory stay with their one sequence: copying them would double the slowest
  // tier for a state that is cheap to prefill again by comparison.
  if (s.compressed_ && s.values_on_host_) {
    return Error(ErrorCode::kUnsupported, "a sequence with values in host memory is not copied");
  }
  SKV_ASSIGN_OR_RETURN(auto fresh, NewSequence());
  auto& copy = static_cast<Sequence&>(*fresh);
  if (s.compressed_) {
    SKV_RETURN_IF_ERROR(group_->AllocateShadowKvValues(copy.sequence_, /*on_host=*/false));
    copy.has_values_ = true;
    SKV_RETURN_IF_ERROR(group_->CopyShadowKvSequence(s.sequence_, copy.sequence_));
    copy.compressed_ = true;
    GiveBackSlot(copy);  // a compressed sequence needs no full-cache slot
  } else {
    SKV_RETURN_IF_ERROR(group_->CopySlot(s.slot_, copy.slot_));
  }
  copy.tokens_ = s.tokens_;
  copy.stats_ = s.stats_;
  copy.recompress_ = s.recompress_;
  copy.carried_ = s.carried_;
  return fresh;
}

Status CudaServingModel::Compress(Sequence& s) {
  Status placed = group_->AllocateShadowKvValues(s.sequence_, /*on_host=*/false);
  s.values_on_host_ = false;
  // With exact keys scored by the re-rank (no rerank_rank) every selection reads each
  // candidate's stored keys: from pinned host memory that is a PCIe read the whole batch waits
  // for (docs/PERF.md), so such a store stays on the device or is not made. Scored from the
  // factors, the store is read only for the chunks a step misses, as values are.
  if (placed.code() == ErrorCode::kResourceExhausted && !options_.kv.RerankReadsStore()) {
    placed = group_->AllocateShadowKvValues(s.sequence_, /*on_host=*/true);
    s.values_on_host_ = true;
  }
  // No room for the values anywhere: the sequence stays exact in its slot rather than failing
  // the step (and the other sequences in it).
  if (placed.code() == ErrorCode::kResourceExhausted) return Status::Ok();
  SKV_RETURN_IF_ERROR(placed);
  s.has_values_ = true;
  // A later turn recompresses from the prompt's exact keys where they could be kept (pinned
  // host memory, kept with the pool's sequence index); else from the rank-r ones.
  SKV_RETURN_IF_ERROR(KeepPromptKeys(s.sequence_).status());
  const auto start = std::chrono::steady_clock::now();
  const Status compressed = group_->CompressToShadowKv(s.slot_, s.sequence_);
  s.stats_.compress_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (compressed.code() == ErrorCode::kUnsupported) {
    // Too short for the budget: the sequence keeps its slot and full attention.
    s.has_values_ = false;
    return group_->FreeShadowKvValues(s.sequence_);
  }
  SKV_RETURN_IF_ERROR(compressed);
  s.compressed_ = true;
  GiveBackSlot(s);
  return Status::Ok();
}

Result<bool> CudaServingModel::Decompress(Sequence& s) {
  int slot = -1;
  {
    std::lock_guard lock(mutex_);
    if (free_slots_.empty()) return false;
    slot = free_slots_.back();
    free_slots_.pop_back();
  }
  s.slot_ = slot;
  const Status back = group_->DecompressShadowKv(s.sequence_, slot);
  if (!back.ok()) {
    GiveBackSlot(s);
    return back.code() == ErrorCode::kUnsupported ? Result<bool>(false) : Result<bool>(back);
  }
  // The device counters restart with the next compression: what they hold so far is carried.
  if (auto counts = group_->ShadowKvSequenceCounts(); counts.ok()) {
    s.carried_ += counts->at(static_cast<size_t>(s.sequence_));
  }
  SKV_RETURN_IF_ERROR(group_->FreeShadowKvValues(s.sequence_));
  s.has_values_ = false;
  s.compressed_ = false;
  s.recompress_ = true;
  return true;
}

namespace {

CudaSampling DeviceSampling(const engine::StepRow& row) {
  const SamplingParams& p = *row.sampling;
  return CudaSampling{p.temperature, p.top_k, p.top_p, p.seed, row.draw};
}

}  // namespace

Status CudaServingModel::Step(std::span<const engine::StepRow> rows,
                              std::span<int32_t> next_tokens) {
  if (next_tokens.size() != rows.size()) {
    return Error(ErrorCode::kInvalidArgument, "{} token slots for {} rows", next_tokens.size(),
                 rows.size());
  }
  std::vector<Sequence*> sequences(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const engine::StepRow& row = rows[i];
    auto* s = dynamic_cast<Sequence*>(row.kv);
    if (!s || s->owner_ != this) {
      return Error(ErrorCode::kInvalidArgument, "row {} holds no sequence of this model", i);
    }
    if (row.tokens.empty()) return Error(ErrorCode::kInvalidArgument, "row {} has no tokens", i);
    if (s->tokens_ + std::ssize(row.tokens) > config_.context_length) {
      return Error(ErrorCode::kOutOfRange, "{} tokens after {} exceed the context of {}",
                   row.tokens.size(), s->tokens_, config_.context_length);
    }
    sequences[i] = s;
  }
  // A later turn of a held compressed sequence: back into a prompt slot for its new tokens.
  if (options_.recompress_turns) {
    for (size_t i = 0; i < rows.size(); ++i) {
      if (sequences[i]->compressed_ && rows[i].tokens.size() > 1) {
        SKV_RETURN_IF_ERROR(Decompress(*sequences[i]).status());
      }
    }
  }
  // Rows of sequences in a full-cache slot: one (graph-replayed) decode step when every one is a
  // single token after a prefilled sequence, else one mixed forward. Rows of compressed
  // sequences: one ShadowKV decode step. Every sampled row draws its token on the device.
  std::vector<size_t> full, sparse;
  bool all_decode_rows = true;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (sequences[i]->compressed_) {
      sparse.push_back(i);
    } else {
      full.push_back(i);
      all_decode_rows &=
          rows[i].tokens.size() == 1 && sequences[i]->tokens_ > 0 && rows[i].sampling != nullptr;
    }
  }
  std::vector<int> ids;
  std::vector<int32_t> tokens;
  std::vector<CudaSampling> sampling;
  // A batched decode step's logits come back only when a row asks for them.
  const int64_t vocab = config_.vocab_size;
  auto logits_wanted = [&](std::span<const size_t> which) {
    for (size_t i : which) {
      if (rows[i].logits_out) {
        logits_.resize(which.size() * vocab);
        return logits_.data();
      }
    }
    return static_cast<float*>(nullptr);
  };
  auto hand_out = [&](std::span<const size_t> which, const float* logits) {
    for (size_t k = 0; k < which.size(); ++k) {
      const size_t i = which[k];
      if (rows[i].sampling) next_tokens[i] = tokens[k];
      if (logits && rows[i].logits_out) {
        std::copy_n(logits + k * vocab, vocab, rows[i].logits_out);
      }
    }
  };
  if (!full.empty() && all_decode_rows) {
    for (size_t i : full) {
      ids.push_back(sequences[i]->slot_);
      tokens.push_back(rows[i].tokens[0]);
      sampling.push_back(rows[i].sampling ? DeviceSampling(rows[i]) : CudaSampling{});
    }
    float* logits = logits_wanted(full);
    SKV_RETURN_IF_ERROR(group_->DecodeStep(ids, tokens, sampling, logits));
    hand_out(full, logits);
  } else if (!full.empty()) {
    sampling.reserve(full.size());  // the inputs point into it
    std::vector<CudaStepInput> step;
    for (size_t i : full) {
      CudaStepInput in{sequences[i]->slot_, rows[i].tokens, rows[i].logits_out};
      if (rows[i].sampling) {
        sampling.push_back(DeviceSampling(rows[i]));
        in.sample = &sampling.back();
        in.token_out = &next_tokens[i];
      }
      step.push_back(in);
    }
    SKV_RETURN_IF_ERROR(group_->Forward(step));
  }
  for (size_t i : full) sequences[i]->tokens_ += std::ssize(rows[i].tokens);

  // The tokens of a longer row of a compressed sequence (a later turn continuing a held
  // sequence) go in one step each before the batched step.
  ids.clear();
  tokens.clear();
  sampling.clear();
  std::vector<size_t> owners;
  for (size_t i : sparse) {
    Sequence& s = *sequences[i];
    const auto span = rows[i].tokens;
    for (size_t t = 0; t + 1 < span.size(); ++t) {
      int32_t token = span[t];
      SKV_RETURN_IF_ERROR(group_->ShadowKvDecodeStep(
          std::span<const int>(&s.sequence_, 1), std::span<int32_t>(&token, 1), CudaSampling{}));
      ++s.tokens_;
    }
    ids.push_back(s.sequence_);
    tokens.push_back(span.back());
    sampling.push_back(rows[i].sampling ? DeviceSampling(rows[i]) : CudaSampling{});
    owners.push_back(i);
  }
  if (!ids.empty()) {
    float* logits = logits_wanted(owners);
    SKV_RETURN_IF_ERROR(group_->ShadowKvDecodeStep(ids, tokens, sampling, logits));
    for (size_t i : owners) ++sequences[i]->tokens_;
    hand_out(owners, logits);
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    kv::PolicyStats& stats = sequences[i]->stats_;
    stats.prepare_calls += config_.num_layers;
    stats.context_tokens += config_.num_layers * sequences[i]->tokens_;
  }
  // Prompts complete in this step are compressed (ShadowKV) after their last chunk, and so are
  // decompressed sequences after their turn's last new tokens (the row that samples).
  if (shadowkv()) {
    for (size_t i : full) {
      Sequence& s = *sequences[i];
      if (rows[i].finish_prefill || (s.recompress_ && rows[i].sampling)) {
        s.recompress_ = false;
        SKV_RETURN_IF_ERROR(Compress(s));
      }
    }
  }
  return Status::Ok();
}

}  // namespace shadowkv::cuda
