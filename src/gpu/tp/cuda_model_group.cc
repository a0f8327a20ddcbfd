// CudaModelGroup: rank threads, the communicators, and every CudaModel call fanned out to the
// ranks. The ranks' host-side state (slot lengths, sequence bookkeeping) evolves identically, so
// queries read rank 0's.
#include "gpu/tp/cuda_model_group.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <utility>

#include "core/rank_threads.h"
#include "format/gguf.h"
#include "gpu/tp/communicator.h"
#include "model/tensor_parallel.h"
#include "ops/cuda/common/cuda_backend.h"
#include "ops/cuda/common/cuda_check.h"

namespace shadowkv::cuda {
namespace {

Status Ok() { return Status::Ok(); }

std::chrono::milliseconds CollectiveTimeout() {
  return std::chrono::milliseconds(1000ll * tp::Settings().step_timeout_s);
}

// task(rank), written to the trace (tp::ProcessSettings::trace) as it starts and ends.
Status Traced(int rank, const std::function<Status(int)>& task) {
  if (!tp::TraceEnabled()) return task(rank);
  static std::atomic<uint64_t> counter{0};
  const uint64_t id = ++counter;
  tp::Trace(rank, fmt::format("task {} starts", id));
  Status status = task(rank);
  tp::Trace(rank, fmt::format("task {} ends: {}", id, status.ToString()));
  return status;
}

}  // namespace

tp::ProcessSettings& tp::MutableProcessSettings() {
  static ProcessSettings settings;
  return settings;
}

void PrepareProcessForTensorParallel(int size) {
  if (size > 1) {
    setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  }
}

struct CudaModelGroup::State {
  ModelConfig config;  // the whole model
  CudaModelOptions options;
  std::vector<int> devices;
  bool local = false;
  tp::Communicators communicators;
  std::vector<std::unique_ptr<CudaModel>> models;
  std::unique_ptr<RankThreads> threads;  // null for one rank: calls run on the caller's thread
  double compress_seconds = 0;
  // Where ranks other than 0 put the logits and sampled tokens of a Forward (kept across calls),
  // per rank.
  std::vector<std::vector<float>> logit_scratch;
  std::vector<std::vector<int32_t>> token_scratch;

  int size() const { return static_cast<int>(devices.size()); }
  // fn(model, rank) on every rank; the first failure. A group that was aborted refuses.
  using RankFn = std::function<Status(CudaModel&, int)>;
  Status Each(const RankFn& fn) { return OnRanks(fn, false); }
  // The same for work with collectives (forward and decode steps): a rank that fails there
  // leaves the others waiting for it in an all-reduce, so its failure (or a step that never
  // ends) aborts the communicators, and the group: its caches' contents are unknown from then on.
  Status Collective(const RankFn& fn) { return OnRanks(fn, true); }

  Status OnRanks(const RankFn& fn, bool collective) {
    if (!threads) return fn(*models[0], 0);
    SKV_RETURN_IF_ERROR(aborted);
    const auto task = [&](int rank) {
      return Traced(rank, [&](int r) { return fn(*models[r], r); });
    };
    if (!collective) return threads->Run(task);
    const auto abort = [&] {
      for (auto& communicator : communicators) communicator->Abort();
    };
    const Status status = threads->Run(task, abort, CollectiveTimeout());
    if (!status.ok()) {
      // Where each rank's host had got to: the all-reduces it issued (in a process's life).
      std::string issued;
      for (const auto& communicator : communicators) {
        issued += fmt::format("{}{}", issued.empty() ? "" : ", ", communicator->issued());
      }
      const std::string failure =
          fmt::format("{} (all-reduces issued by rank 0, 1, ...: {})", status.message(), issued);
      aborted = Error(status.code(), "the tensor-parallel group stopped after a rank failed ({}); "
                      "load the model again", failure);
      return Error(status.code(), "{}", failure);
    }
    return status;
  }
  Status aborted = Status::Ok();

  // A decode step on every rank: rank 0 samples into `tokens` and writes `logits_out`; the
  // other ranks compute the same step into copies of the tokens.
  using StepFn = std::function<Status(CudaModel&, std::span<int32_t>, float*)>;
  Status Step(std::span<int32_t> tokens, float* logits_out, const StepFn& step) {
    if (!threads) return step(*models[0], tokens, logits_out);
    std::vector<std::vector<int32_t>> copies(size(),
                                             std::vector<int32_t>(tokens.begin(), tokens.end()));
    return Collective([&](CudaModel& m, int rank) {
      return rank == 0 ? step(m, tokens, logits_out) : step(m, copies[rank], nullptr);
    });
  }
  // The same for a profiled step; rank 0's breakdown.
  using ProfileFn = std::function<Result<StepBreakdown>(CudaModel&, std::span<int32_t>)>;
  Result<StepBreakdown> Profile(std::span<int32_t> tokens, const ProfileFn& profile) {
    StepBreakdown breakdown;
    SKV_RETURN_IF_ERROR(Step(tokens, nullptr, [&](CudaModel& m, std::span<int32_t> t, float*) {
      SKV_ASSIGN_OR_RETURN(StepBreakdown b, profile(m, t));
      if (t.data() == tokens.data()) breakdown = b;
      return Status::Ok();
    }));
    return breakdown;
  }

  ~State() {
    // Each shard is freed on its own thread (its GPU current), then the communicators.
    if (threads) {
      (void)threads->Run([&](int rank) {
        models[rank].reset();
        return Status::Ok();
      });
    }
    models.clear();
    communicators.clear();
  }
};

namespace {

using Factory = std::function<Result<std::unique_ptr<CudaModel>>(const CudaModelOptions&)>;

Result<std::unique_ptr<CudaModelGroup::State>> MakeState(const ModelConfig& config,
                                                         const CudaModelOptions& options,
                                                         const TensorParallelOptions& tp,
                                                         const Factory& factory) {
  std::string why;
  if (!CudaAvailable(&why)) return Error(ErrorCode::kUnsupported, "no usable CUDA GPU: {}", why);
  SKV_RETURN_IF_ERROR(CheckTensorParallel(config, tp.size));
  auto state = std::make_unique<CudaModelGroup::State>();
  state->config = config;
  state->options = options;
  state->options.communicator = nullptr;
  if (tp.size == 1) {
    int device = 0;
    SKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    state->devices = {device};
    SKV_ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, factory(state->options));
    state->models.push_back(std::move(model));
    return state;
  }
  state->local = tp.local;
  if (state->local) {
    int device = 0;
    SKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    state->devices.assign(tp.size, device);
    SKV_ASSIGN_OR_RETURN(state->communicators, tp::CreateLocalCommunicators(tp.size, device));
  } else {
    for (int r = 0; r < tp.size; ++r) state->devices.push_back(r);
    SKV_ASSIGN_OR_RETURN(state->communicators, tp::CreateNcclCommunicators(state->devices));
  }
  state->models.resize(tp.size);
  state->logit_scratch.resize(tp.size);
  state->token_scratch.resize(tp.size);
  state->threads = std::make_unique<RankThreads>(tp.size, [&devices = state->devices](int rank) {
    return CudaStatus(cudaSetDevice(devices[rank]), "cudaSetDevice", __FILE__, __LINE__);
  });
  SKV_RETURN_IF_ERROR(state->threads->Run([&](int rank) -> Status {
    CudaModelOptions rank_options = state->options;
    rank_options.communicator = state->communicators[rank].get();
    SKV_ASSIGN_OR_RETURN(state->models[rank], factory(rank_options));
    return Status::Ok();
  }));
  return state;
}

}  // namespace

CudaModelGroup::CudaModelGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaModelGroup::~CudaModelGroup() = default;

Result<std::unique_ptr<CudaModelGroup>> CudaModelGroup::Load(const std::string& path,
                                                             const CudaModelOptions& options,
                                                             const TensorParallelOptions& tp) {
  // The whole model's shapes first, to check the split before any rank loads.
  SKV_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file, gguf::GgufFile::Open(path));
  SKV_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfig::FromGguf(*file));
  file.reset();
  SKV_ASSIGN_OR_RETURN(auto state,
                       MakeState(config, options, tp, [&](const CudaModelOptions& o) {
                         return CudaModel::Load(path, o);
                       }));
  return std::unique_ptr<CudaModelGroup>(new CudaModelGroup(std::move(state)));
}

Result<std::unique_ptr<CudaModelGroup>> CudaModelGroup::CreateSynthetic(
    const ModelConfig& config, uint64_t seed, const CudaModelOptions& options,
    const TensorParallelOptions& tp) {
  SKV_ASSIGN_OR_RETURN(auto state,
                       MakeState(config, options, tp, [&](const CudaModelOptions& o) {
                         return CudaModel::CreateSynthetic(config, seed, o);
                       }));
  return std::unique_ptr<CudaModelGroup>(new CudaModelGroup(std::move(state)));
}

int CudaModelGroup::size() const { return state_->size(); }
int CudaModelGroup::num_devices() const { return state_->local ? 1 : state_->size(); }
std::string CudaModelGroup::communicator() const {
  return state_->communicators.empty() ? "none" : state_->communicators[0]->kind();
}
CudaModel& CudaModelGroup::rank(int i) { return *state_->models.at(i); }
const ModelConfig& CudaModelGroup::config() const { return state_->config; }
const CudaModelOptions& CudaModelGroup::options() const { return state_->options; }
bool CudaModelGroup::synthetic() const { return state_->models[0]->synthetic(); }

namespace {
template <typename Get>
int64_t Sum(const std::vector<std::unique_ptr<CudaModel>>& models, Get get) {
  int64_t total = 0;
  for (const auto& model : models) total += get(*model);
  return total;
}
}  // namespace

int64_t CudaModelGroup::weight_bytes() const {
  return Sum(state_->models, [](const CudaModel& m) { return m.weight_bytes(); });
}
int64_t CudaModelGroup::decode_weight_bytes() const {
  return Sum(state_->models, [](const CudaModel& m) { return m.decode_weight_bytes(); });
}
int64_t CudaModelGroup::activation_bytes() const {
  return Sum(state_->models, [](const CudaModel& m) { return m.activation_bytes(); });
}
int64_t CudaModelGroup::KvBytesPerToken() const {
  return Sum(state_->models, [](const CudaModel& m) { return m.KvBytesPerToken(); });
}

Result<int64_t> CudaModelGroup::FreeDeviceBytes() {
  std::vector<int64_t> free(state_->size(), 0);
  SKV_RETURN_IF_ERROR(state_->Each([&](CudaModel&, int rank) -> Status {
    SKV_ASSIGN_OR_RETURN(DeviceInfo device, QueryDevice());
    free[rank] = device.free_bytes;
    return Status::Ok();
  }));
  return *std::min_element(free.begin(), free.end());
}

Status CudaModelGroup::AllocateKvCache(int num_slots, int64_t capacity, bool keep_pre_rope_keys) {
  const Status status = state_->Each([&](CudaModel& m, int) {
    return m.AllocateKvCache(num_slots, capacity, keep_pre_rope_keys);
  });
  if (!status.ok()) FreeKvCache();  // no rank keeps a cache the others lack
  return status;
}

void CudaModelGroup::FreeKvCache() {
  (void)state_->Each([](CudaModel& m, int) {
    m.FreeKvCache();
    return Ok();
  });
}

int CudaModelGroup::num_slots() const { return state_->models[0]->num_slots(); }
int64_t CudaModelGroup::slot_capacity() const { return state_->models[0]->slot_capacity(); }
int64_t CudaModelGroup::slot_length(int slot) const { return state_->models[0]->slot_length(slot); }

void CudaModelGroup::ResetSlot(int slot) {
  for (auto& model : state_->models) model->ResetSlot(slot);  // host bookkeeping only
}

Status CudaModelGroup::CopySlot(int from, int to) {
  return state_->Each([&](CudaModel& m, int) { return m.CopySlot(from, to); });
}

Status CudaModelGroup::Forward(std::span<const CudaStepInput> inputs) {
  if (state_->size() == 1) return state_->models[0]->Forward(inputs);
  // Every rank computes the same logits into buffers of its own (every rank must run the same
  // GEMMs: see CudaModel::Impl::Gemm); only rank 0's reach the caller.
  const size_t vocab = static_cast<size_t>(state_->config.vocab_size);
  std::vector<std::vector<CudaStepInput>> per_rank(state_->size());
  for (int rank = 1; rank < state_->size(); ++rank) {
    std::vector<float>& scratch = state_->logit_scratch[rank];
    if (scratch.size() < inputs.size() * vocab) scratch.resize(inputs.size() * vocab);
    std::vector<int32_t>& tokens = state_->token_scratch[rank];
    if (tokens.size() < inputs.size()) tokens.resize(inputs.size());
    per_rank[rank].assign(inputs.begin(), inputs.end());
    for (size_t i = 0; i < inputs.size(); ++i) {
      CudaStepInput& in = per_rank[rank][i];
      if (in.logits_out != nullptr) in.logits_out = &scratch[i * vocab];
      if (in.token_out != nullptr) in.token_out = &tokens[i];
    }
  }
  return state_->Collective([&](CudaModel& m, int rank) {
    return rank == 0 ? m.Forward(inputs) : m.Forward(per_rank[rank]);
  });
}

Status CudaModelGroup::DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                                  std::span<const CudaSampling> sampling, float* logits_out) {
  return state_->Step(tokens, logits_out, [&](CudaModel& m, std::span<int32_t> t, float* out) {
    return m.DecodeStep(slots, t, sampling, out);
  });
}

Status CudaModelGroup::DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                                  const CudaSampling& sampling, float* logits_out) {
  return state_->Step(tokens, logits_out, [&](CudaModel& m, std::span<int32_t> t, float* out) {
    return m.DecodeStep(slots, t, sampling, out);
  });
}

Result<StepBreakdown> CudaModelGroup::ProfileDecodeStep(std::span<const int> slots,
                                                        std::span<int32_t> tokens) {
  return state_->Profile(tokens, [&](CudaModel& m, std::span<int32_t> t) {
    return m.ProfileDecodeStep(slots, t);
  });
}

Status CudaModelGroup::AllocateShadowKv(const kv::KvPolicyConfig& config, int num_sequences,
                                        int64_t capacity) {
  const kv::KvPolicyConfig shard = ShardKvPolicy(config, state_->size());
  const Status status = state_->Each([&](CudaModel& m, int) {
    return m.AllocateShadowKv(shard, num_sequences, capacity);
  });
  if (!status.ok()) FreeShadowKv();
  return status;
}

void CudaModelGroup::FreeShadowKv() {
  (void)state_->Each([](CudaModel& m, int) {
    m.FreeShadowKv();
    return Ok();
  });
}

Result<std::pair<int64_t, int64_t>> CudaModelGroup::ShadowKvBytesPerSequence(
    const kv::KvPolicyConfig& config, int64_t capacity) const {
  const kv::KvPolicyConfig shard = ShardKvPolicy(config, state_->size());
  std::pair<int64_t, int64_t> total{0, 0};
  for (const auto& model : state_->models) {
    SKV_ASSIGN_OR_RETURN(auto bytes, model->ShadowKvBytesPerSequence(shard, capacity));
    total.first += bytes.first;
    total.second += bytes.second;
  }
  return total;
}

Status CudaModelGroup::AllocateShadowKvValues(int seq, bool on_host) {
  const Status status =
      state_->Each([&](CudaModel& m, int) { return m.AllocateShadowKvValues(seq, on_host); });
  if (status.code() == ErrorCode::kResourceExhausted && state_->size() > 1) {
    // Ranks that got their values give them back: the caller may retry on the host.
    (void)state_->Each([&](CudaModel& m, int) { return m.FreeShadowKvValues(seq); });
  }
  return status;
}

Status CudaModelGroup::FreeShadowKvValues(int seq) {
  return state_->Each([&](CudaModel& m, int) { return m.FreeShadowKvValues(seq); });
}

Status CudaModelGroup::CompressToShadowKv(int full_slot, int seq) {
  // One rank after the other: each factorisation already spreads its layers over every CPU
  // core (and adjusts OpenBLAS's global thread count while it runs).
  const auto start = std::chrono::steady_clock::now();
  std::mutex one_at_a_time;
  SKV_RETURN_IF_ERROR(state_->Each([&](CudaModel& m, int) {
    std::lock_guard<std::mutex> lock(one_at_a_time);
    return m.CompressToShadowKv(full_slot, seq);
  }));
  state_->compress_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Status::Ok();
}

Status CudaModelGroup::AllocateShadowKvKeys(int seq) {
  return state_->Each([&](CudaModel& m, int) { return m.AllocateShadowKvKeys(seq); });
}

Status CudaModelGroup::DecompressShadowKv(int seq, int full_slot) {
  return state_->Each([&](CudaModel& m, int) { return m.DecompressShadowKv(seq, full_slot); });
}

Status CudaModelGroup::CopyShadowKvSequence(int from, int to) {
  return state_->Each([&](CudaModel& m, int) { return m.CopyShadowKvSequence(from, to); });
}

Result<CudaShadowKvGroupSnapshot> CudaModelGroup::SaveShadowKvSequence(int seq) {
  CudaShadowKvGroupSnapshot snapshot;
  snapshot.ranks.resize(state_->size());
  SKV_RETURN_IF_ERROR(state_->Each([&](CudaModel& m, int rank) -> Status {
    SKV_ASSIGN_OR_RETURN(snapshot.ranks[rank], m.SaveShadowKvSequence(seq));
    return Status::Ok();
  }));
  return snapshot;
}

Status CudaModelGroup::RestoreShadowKvSequence(const CudaShadowKvGroupSnapshot& snapshot, int seq) {
  if (static_cast<int>(snapshot.ranks.size()) != state_->size()) {
    return Error(ErrorCode::kInvalidArgument, "a snapshot of {} ranks for a group of {}",
                 snapshot.ranks.size(), state_->size());
  }
  return state_->Each([&](CudaModel& m, int rank) {
    return m.RestoreShadowKvSequence(snapshot.ranks[rank], seq);
  });
}

int64_t CudaModelGroup::shadowkv_length(int seq) const {
  return state_->models[0]->shadowkv_length(seq);
}

Status CudaModelGroup::ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                                          std::span<const CudaSampling> sampling,
                                          float* logits_out) {
  return state_->Step(tokens, logits_out, [&](CudaModel& m, std::span<int32_t> t, float* out) {
    return m.ShadowKvDecodeStep(seqs, t, sampling, out);
  });
}

Status CudaModelGroup::ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                                          const CudaSampling& sampling, float* logits_out) {
  return state_->Step(tokens, logits_out, [&](CudaModel& m, std::span<int32_t> t, float* out) {
    return m.ShadowKvDecodeStep(seqs, t, sampling, out);
  });
}

Result<StepBreakdown> CudaModelGroup::ProfileShadowKvDecodeStep(std::span<const int> seqs,
                                                                std::span<int32_t> tokens) {
  return state_->Profile(tokens, [&](CudaModel& m, std::span<int32_t> t) {
    return m.ProfileShadowKvDecodeStep(seqs, t);
  });
}

CudaShadowKvStats CudaModelGroup::shadowkv_stats() const {
  if (state_->size() == 1) return state_->models[0]->shadowkv_stats();
  std::vector<CudaShadowKvStats> each(state_->size());
  (void)state_->Each([&](CudaModel& m, int rank) {
    each[rank] = m.shadowkv_stats();
    return Ok();
  });
  CudaShadowKvStats total = each[0];
  for (size_t r = 1; r < each.size(); ++r) {
    total.rank += each[r].rank;
    total.device_bytes += each[r].device_bytes;
    total.host_bytes += each[r].host_bytes;
    total.chunks_selected += each[r].chunks_selected;
    total.chunk_hits += each[r].chunk_hits;
    total.head_steps += each[r].head_steps;
    total.head_selections += each[r].head_selections;
    for (size_t i = 0; i < total.compress_phase_seconds.size(); ++i) {
      total.compress_phase_seconds[i] += each[r].compress_phase_seconds[i];
    }
  }
  total.compress_seconds = state_->compress_seconds;
  return total;
}

Result<std::vector<CudaChunkCounts>> CudaModelGroup::ShadowKvSequenceCounts() const {
  if (state_->size() == 1) return state_->models[0]->ShadowKvSequenceCounts();
  std::vector<std::vector<CudaChunkCounts>> each(state_->size());
  SKV_RETURN_IF_ERROR(state_->Each([&](CudaModel& m, int rank) -> Status {
    SKV_ASSIGN_OR_RETURN(each[rank], m.ShadowKvSequenceCounts());
    return Ok();
  }));
  std::vector<CudaChunkCounts> total = each[0];
  for (size_t r = 1; r < each.size(); ++r) {
    for (size_t i = 0; i < total.size() && i < each[r].size(); ++i) {
      total[i] += each[r][i];
    }
  }
  return total;
}

void CudaModelGroup::ResetShadowKvCounters() {
  (void)state_->Each([](CudaModel& m, int) {
    m.ResetShadowKvCounters();
    return Ok();
  });
}

Result<std::vector<int32_t>> CudaModelGroup::ShadowKvGatheredChunks(int seq, int layer,
                                                                    int kv_head) {
  const int per_rank = state_->config.num_kv_heads / state_->size();
  if (kv_head < 0 || kv_head >= state_->config.num_kv_heads) {
    return Error(ErrorCode::kInvalidArgument, "KV head {} is outside [0, {})", kv_head,
                 state_->config.num_kv_heads);
  }
  std::vector<int32_t> chunks;
  SKV_RETURN_IF_ERROR(state_->Each([&](CudaModel& m, int rank) -> Status {
    if (rank != kv_head / per_rank) return Status::Ok();
    SKV_ASSIGN_OR_RETURN(chunks, m.ShadowKvGatheredChunks(seq, layer, kv_head % per_rank));
    return Status::Ok();
  }));
  return chunks;
}

}  // namespace shadowkv::cuda
