// CudaModel's ShadowKV sequences: allocation, copies, snapshots and statistics. The compression
// of a prefilled full-cache slot is in shadowkv_compress.cc, the decode step in
// shadowkv_decode.cc.
#include <algorithm>
#include <cstring>

#include "gpu/model/cuda_model_impl.h"

namespace shadowkv::cuda {

ShadowKvState::~ShadowKvState() {
  DropGraphs();
  for (Bf16* pointer : host_values) {
    if (pointer) (void)cudaFreeHost(pointer);
  }
  for (Bf16* pointer : host_keys) {
    if (pointer) (void)cudaFreeHost(pointer);
  }
  if (host_meta_block) (void)cudaFreeHost(host_meta_block);
  for (cudaEvent_t event : {fork, join, half.start, half.fork, half.join, half.done}) {
    if (event) (void)cudaEventDestroy(event);
  }
  for (cudaEvent_t event : compress_marks) {
    if (event) (void)cudaEventDestroy(event);
  }
  for (cudaStream_t other : {side_stream, half.stream, half.fetch_stream}) {
    if (other) (void)cudaStreamDestroy(other);
  }
}

Status NeedShadowKv(const CudaModel::Impl& m) {
  if (!m.skv) return Error(ErrorCode::kInvalidArgument, "no ShadowKV sequences: AllocateShadowKv");
  return Status::Ok();
}

Status CheckSeq(const ShadowKvState& s, int seq) {
  if (seq < 0 || seq >= s.num_sequences) {
    return Error(ErrorCode::kInvalidArgument, "ShadowKV sequence {} is outside [0, {})", seq,
                 s.num_sequences);
  }
  return Status::Ok();
}

void ShadowKvState::DropGraphs() {
  for (auto& [batch, exec] : graphs) (void)cudaGraphExecDestroy(exec);
  graphs.clear();
}

namespace {

// Pushes the value pointers to the device table.
Status UploadValueTable(ShadowKvState& s, cudaStream_t stream) {
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.value_table.get(), s.value_pointers.data(),
                                           s.value_pointers.size() * sizeof(Bf16*),
                                           cudaMemcpyHostToDevice, stream));
  return cudaStreamSynchronize(stream) == cudaSuccess
             ? Status::Ok()
             : Error(ErrorCode::kInternal, "value table upload failed");
}

}  // namespace

// The GPU's ShadowKV scoring and select kernels hold a GQA group's query heads in mma tiles of 8
// columns, built for groups of 1 to 8 and 16 (GLM-4-9B), so other groups take only the full
// cache here; the CPU backend serves them with ShadowKV, and `eval --device cuda` decodes
// ShadowKV there. On sliding-window models (gemma3, Mistral-style llama) the global layers are
// compressed and the windowed layers keep their window exactly (MakeSkvGeometryFor), as the CPU
// policy does (kv/sliding_split_policy.cc).
Status CudaModel::ShadowKvRunsHere() const {
  const ModelConfig& c = impl_->config;
  const int group = c.num_query_heads / c.num_kv_heads;
  if (!SkvGroupSupported(group)) {
    return Error(ErrorCode::kUnsupported,
                 "KV policy 'shadowkv' has no CUDA path for this model: it has {} query heads per "
                 "KV head and the GPU's ShadowKV kernels take 1 to 8 or {}; ShadowKV on it runs "
                 "on the CPU backend (--device cpu; `eval --device cuda` decodes it there from "
                 "the GPU's prompt), full attention runs here",
                 group, kSkvMaxGroup);
  }
  if (!SkvHeadDimSupported(c.head_dim)) {
    return Error(ErrorCode::kUnsupported,
                 "KV policy 'shadowkv' has no CUDA path for this model: its head_dim {} is not "
                 "one the GPU's ShadowKV kernels take (64, 96, 128 or 256); ShadowKV on it runs on the CPU "
                 "backend (--device cpu; `eval --device cuda` decodes it there from the GPU's "
                 "prompt), full attention runs here",
                 c.head_dim);
  }
  return Status::Ok();
}

Result<std::pair<int64_t, int64_t>> CudaModel::ShadowKvBytesPerSequence(
    const kv::KvPolicyConfig& requested, int64_t capacity) const {
  const ModelConfig& c = impl_->config;
  const kv::KvPolicyConfig config = kv::WithPaperSettings(requested);  // as the CPU policy does
  SKV_RETURN_IF_ERROR(ShadowKvRunsHere());
  SKV_ASSIGN_OR_RETURN(SkvGeometry g, MakeSkvGeometryFor(config, c, c.num_kv_heads, capacity));
  return std::pair<int64_t, int64_t>{g.DeviceBytesPerSequence(), g.StoreBytesPerSequence()};
}

Status CudaModel::AllocateShadowKv(const kv::KvPolicyConfig& requested, int num_sequences,
                                   int64_t capacity) {
  Impl& m = *impl_;
  // A config made in code with paper=1 gets the forced settings, as the CPU policy gives it.
  const kv::KvPolicyConfig config = kv::WithPaperSettings(requested);
  const ModelConfig& c = m.config;
  FreeShadowKv();
  SKV_RETURN_IF_ERROR(ShadowKvRunsHere());
  if (num_sequences < 1) {
    return Error(ErrorCode::kInvalidArgument, "{} ShadowKV sequences", num_sequences);
  }
  SKV_ASSIGN_OR_RETURN(SkvGeometry g, MakeSkvGeometryFor(config, c, c.num_kv_heads, capacity));
  auto s = std::make_unique<ShadowKvState>();
  const bool fast = ShadowKvDecodeSettings(m.options.kernels).kernel_variant == kSkvKernelsFast;
  if (config.select_successors != 0 && !fast) {
    return Error(ErrorCode::kUnsupported, "ShadowKV successor selection (successors=1) needs "
                 "the fast decode kernels (kernel option shadowkv_kernels = 1, the default)");
  }
  if (c.num_query_heads / c.num_kv_heads > kSkvMaxGroupFirst && !fast) {
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV with more than {} query heads per KV head needs the fast decode kernels "
                 "(kernel option shadowkv_kernels = 1, the default)",
                 kSkvMaxGroupFirst);
  }
  if (!SkvHeadDimFirstKernels(c.head_dim) && !fast) {
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV at head_dim {} needs the fast decode kernels (kernel option "
                 "shadowkv_kernels = 1, the default); the first kernels take 64 and 128",
                 c.head_dim);
  }
  if (config.fp8_landmarks != 0 && !fast) {
    return Error(ErrorCode::kUnsupported, "ShadowKV FP8 landmarks (fp8_landmarks=1) need the "
                 "fast decode kernels (kernel option shadowkv_kernels = 1, the default)");
  }
  s->config = config;
  s->geometry = g;
  s->num_sequences = num_sequences;
  const int64_t n = num_sequences, layers = g.num_layers, heads = c.num_kv_heads;
  const int64_t d = c.head_dim, width = g.kv_width();
  const int64_t chunked_rows = static_cast<int64_t>(g.capacity_chunks) * g.chunk_size;
  auto sized = [&](Status status) -> Status {
    if (status.ok()) return status;
    return Error(status.code(), "ShadowKV state of {} sequences x {} tokens ({:.2f} GiB): {}",
                 num_sequences, capacity,
                 static_cast<double>(n * g.DeviceBytesPerSequence()) / (1 << 30),
                 status.message());
  };
  SKV_RETURN_IF_ERROR(sized(s->attn_keys.Allocate(n * layers * heads * g.attn_capacity * d)));
  SKV_RETURN_IF_ERROR(sized(s->attn_values.Allocate(n * layers * heads * g.attn_capacity * d)));
  SKV_RETURN_IF_ERROR(sized(s->keys_pre.Allocate(n * layers * g.recent_capacity * width)));
  SKV_RETURN_IF_ERROR(sized(s->coefficients.Allocate(n * layers * chunked_rows * g.rank)));
  SKV_RETURN_IF_ERROR(sized(s->basis.Allocate(n * layers * g.rank * width)));
  const int64_t landmarks = n * layers * heads * g.capacity_chunks;
  if (g.fp8_landmarks) {
    SKV_RETURN_IF_ERROR(sized(s->landmark_codes.Allocate(landmarks * d)));
    SKV_RETURN_IF_ERROR(sized(s->landmark_scales.Allocate(landmarks)));
  } else {
    SKV_RETURN_IF_ERROR(sized(s->landmarks.Allocate(landmarks * d)));
  }
  SKV_RETURN_IF_ERROR(sized(s->outlier.Allocate(n * layers * heads * g.capacity_chunks)));
  SKV_RETURN_IF_ERROR(sized(s->slot_chunk.Allocate(n * layers * heads * g.max_budget)));
  if (g.max_sample > 0) {
    SKV_RETURN_IF_ERROR(sized(s->slot_log_weight.Allocate(n * layers * heads * g.max_budget)));
  }
  SKV_RETURN_IF_ERROR(sized(s->layer_rank.Allocate(n * layers)));
  SKV_RETURN_IF_ERROR(sized(s->info.Allocate(n)));
  SKV_RETURN_IF_ERROR(sized(s->value_table.Allocate(n)));
  SKV_RETURN_IF_ERROR(sized(s->counters.Allocate(kSkvCounters * n)));
  if (g.drift()) {
    SKV_RETURN_IF_ERROR(sized(s->drift_step.Allocate(n * layers * heads)));
    SKV_RETURN_IF_ERROR(sized(s->drift_queries.Allocate(n * layers * heads * g.group * d)));
  }
  s->parts = SkvLayerPartsOf(c);
  if (g.window_layers > 0) {
    const int64_t ring = n * g.window_layers * heads * g.window_rows * d;
    SKV_RETURN_IF_ERROR(sized(s->window_keys.Allocate(ring)));
    SKV_RETURN_IF_ERROR(sized(s->window_values.Allocate(ring)));
    s->window.keys = s->window_keys.get();
    s->window.values = s->window_values.get();
    s->window.num_slots = num_sequences;
    s->window.num_layers = g.window_layers;
    s->window.num_kv_heads = c.num_kv_heads;
    s->window.head_dim = c.head_dim;
    s->window.capacity = g.window_rows;
  }
  const int64_t batch = m.options.max_batch;
  SKV_RETURN_IF_ERROR(sized(s->logits.Allocate(batch * c.num_query_heads * g.capacity_chunks)));
  SKV_RETURN_IF_ERROR(sized(s->softmax_partials.Allocate(
      batch * c.num_query_heads * SkvScoreBlocks(static_cast<int>(g.capacity_chunks)) * 2)));
  SKV_RETURN_IF_ERROR(sized(s->miss_chunk.Allocate(batch * heads * g.max_budget)));
  if (g.drift()) SKV_RETURN_IF_ERROR(sized(s->head_keeps.Allocate(batch * heads)));
  if (g.max_candidates > 0) {
    SKV_RETURN_IF_ERROR(sized(s->candidates.Allocate(batch * heads * g.max_candidates)));
    SKV_RETURN_IF_ERROR(sized(
        s->candidate_lse.Allocate(batch * c.num_query_heads * g.max_candidates)));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->slot_chunk.get(), 0xFF, s->slot_chunk.bytes()));
  if (g.max_sample > 0) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->slot_log_weight.get(), 0, s->slot_log_weight.bytes()));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->counters.get(), 0, s->counters.bytes()));
  if (g.drift()) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->drift_step.get(), 0xFF, s->drift_step.bytes()));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->info.get(), 0, s->info.bytes()));
  {
    const std::vector<int32_t> full_rank(static_cast<size_t>(n * layers), g.rank);
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(s->layer_rank.get(), full_rank.data(),
                                        s->layer_rank.bytes(), cudaMemcpyHostToDevice));
  }

  // Per-row plans: [SkvRowMeta x batch] then six int arrays, one block uploaded per step.
  const int64_t at_rows = 0, at_attn = batch * sizeof(SkvRowMeta), at_pre = at_attn + batch * 4,
                at_last = at_pre + batch * 4, at_window_rows = at_last + batch * 4,
                at_window_last = at_window_rows + batch * 4,
                at_gather_first = at_window_last + batch * 4;
  s->meta_bytes = at_gather_first + batch * 4;
  SKV_RETURN_IF_ERROR(s->meta_block.Allocate(s->meta_bytes));
  void* host_block = nullptr;
  SKV_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host_block, s->meta_bytes, cudaHostAllocDefault));
  s->host_meta_block = static_cast<uint8_t*>(host_block);
  std::memset(s->host_meta_block, 0, s->meta_bytes);
  s->row_meta = reinterpret_cast<SkvRowMeta*>(s->meta_block.get() + at_rows);
  s->attn_rows = reinterpret_cast<int32_t*>(s->meta_block.get() + at_attn);
  s->pre_rows = reinterpret_cast<int32_t*>(s->meta_block.get() + at_pre);
  s->attn_last = reinterpret_cast<int32_t*>(s->meta_block.get() + at_last);
  s->window_rows = reinterpret_cast<int32_t*>(s->meta_block.get() + at_window_rows);
  s->window_last = reinterpret_cast<int32_t*>(s->meta_block.get() + at_window_last);
  s->gather_first = reinterpret_cast<int32_t*>(s->meta_block.get() + at_gather_first);
  for (cudaStream_t* created : {&s->side_stream, &s->half.stream, &s->half.fetch_stream}) {
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(created, cudaStreamNonBlocking));
  }
  for (cudaEvent_t* created :
       {&s->fork, &s->join, &s->half.start, &s->half.fork, &s->half.join, &s->half.done}) {
    SKV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(created, cudaEventDisableTiming));
  }
  for (cudaEvent_t& created : s->compress_marks) {
    SKV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&created));
  }
  if (width <= m.options.kernels.basis_gpu_max_width) {  // compression step 2 on the GPU
    SKV_ASSIGN_OR_RETURN(s->eigen, BatchedSymmetricEigen::Create(static_cast<int>(width),
                                                                 g.num_layers, m.stream));
    SKV_RETURN_IF_ERROR(sized(s->gram.Allocate(layers * width * width)));
    SKV_RETURN_IF_ERROR(sized(s->eigen_values.Allocate(layers * width)));
    SKV_RETURN_IF_ERROR(sized(s->eigen_info.Allocate(layers)));
    // The solver's first run in a process loads its kernels (about 150 ms on an H100): it runs
    // once here, on zero matrices, so that making the pool pays that and not the first
    // request's compression.
    SKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s->gram.get(), 0, s->gram.bytes(), m.stream));
    SKV_RETURN_IF_ERROR(s->eigen->Run(s->gram.get(), s->eigen_values.get(), s->eigen_info.get()));
  }

  s->device_values.resize(n);
  s->host_values.assign(n, nullptr);
  s->value_pointers.assign(n, nullptr);
  s->host_keys.assign(n, nullptr);
  s->host_key_rows.assign(n, 0);
  s->host_info.assign(n, SkvSequenceInfo{});
  s->lengths.assign(n, 0);
  s->exact_first0.assign(n, 0);

  SkvLayout& l = s->layout;
  l.num_layers = g.num_layers;
  l.num_kv_heads = c.num_kv_heads;
  l.head_dim = c.head_dim;
  l.group = c.num_query_heads / c.num_kv_heads;
  l.chunk_size = g.chunk_size;
  l.rank = g.rank;
  l.capacity_chunks = g.capacity_chunks;
  l.max_budget = g.max_budget;
  l.max_candidates = g.max_candidates;
  l.recent_capacity = g.recent_capacity;
  l.attn.keys = s->attn_keys.get();
  l.attn.values = s->attn_values.get();
  l.attn.num_slots = num_sequences;
  l.attn.num_layers = g.num_layers;
  l.attn.num_kv_heads = c.num_kv_heads;
  l.attn.head_dim = c.head_dim;
  l.attn.capacity = g.attn_capacity;
  l.keys_pre = s->keys_pre.get();
  l.coefficients = s->coefficients.get();
  l.basis = s->basis.get();
  l.layer_rank = s->layer_rank.get();
  l.landmarks = s->landmarks.get();
  l.fp8_landmarks = g.fp8_landmarks ? 1 : 0;
  l.landmark_codes = s->landmark_codes.get();
  l.landmark_scales = s->landmark_scales.get();
  l.fp8_values = g.fp8_values ? 1 : 0;
  l.exact_keys = g.exact_keys ? 1 : 0;
  l.fp8_keys = g.fp8_keys ? 1 : 0;
  l.rerank_stored = config.RerankReadsStore() ? 1 : 0;
  l.key_store_offset = g.KeyStoreOffset();
  l.outlier = s->outlier.get();
  l.slot_chunk = s->slot_chunk.get();
  l.slot_log_weight = s->slot_log_weight.get();
  l.max_sample = g.max_sample;
  l.first_head = static_cast<int>(m.shard.kv_heads.begin);
  l.values = s->value_table.get();
  l.info = s->info.get();
  l.counters = s->counters.get();
  l.drift_step = s->drift_step.get();
  l.drift_queries = s->drift_queries.get();
  cudaError_t configured = SkvConfigureKernels(l);
  if (configured == cudaSuccess && g.select_heads) configured = SkvConfigureSelectHeads(l);
  if (configured == cudaErrorInvalidValue) {
    return Error(
        ErrorCode::kUnsupported,
        "ShadowKV kernels do not support this shape (head_dim {}, group {}, rank {}{}, "
        "budget {} chunks, {} chunks of capacity{})",
        c.head_dim, l.group, g.rank,
        g.per_layer_rank() ? " (the per-layer rank's cap: a smaller rank_max may fit)" : "",
        g.max_budget, g.capacity_chunks,
        g.max_candidates > 0 ? fmt::format(", {} re-rank candidates", g.max_candidates)
        : g.select_heads     ? std::string(", per-query-head selection")
                             : std::string());
  }
  SKV_CUDA_RETURN_IF_ERROR(configured);
  SKV_RETURN_IF_ERROR(UploadValueTable(*s, m.stream));
  m.skv = std::move(s);
  return Status::Ok();
}

void CudaModel::FreeShadowKv() { impl_->skv.reset(); }

Status CudaModel::AllocateShadowKvValues(int seq, bool on_host) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  if (s.value_pointers[seq]) return Error(ErrorCode::kInvalidArgument, "sequence {} has values", seq);
  const int64_t bytes = s.geometry.StoreBytesPerSequence();
  if (on_host) {
    void* pointer = nullptr;
    const cudaError_t error = cudaHostAlloc(&pointer, static_cast<size_t>(bytes),
                                            cudaHostAllocMapped | cudaHostAllocPortable);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return Error(ErrorCode::kResourceExhausted, "pinned host memory for the store of a "
                   "ShadowKV sequence ({:.2f} GiB): {}", static_cast<double>(bytes) / (1 << 30),
                   cudaGetErrorString(error));
    }
    void* device_pointer = nullptr;
    SKV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_pointer, pointer, 0));
    s.host_values[seq] = static_cast<Bf16*>(pointer);
    s.value_pointers[seq] = static_cast<Bf16*>(device_pointer);
  } else {
    SKV_RETURN_IF_ERROR(s.device_values[seq].Allocate(bytes / 2));
    s.value_pointers[seq] = s.device_values[seq].get();
  }
  s.DropGraphs();
  return UploadValueTable(s, m.stream);
}

int64_t SkvKeptKeyElementsPerLayer(const SkvGeometry& g) {
  return static_cast<int64_t>(g.capacity_chunks) * g.chunk_size * g.kv_width();
}

Bf16* SkvKeptKeys(const ShadowKvState& s, int seq, int layer) {
  return s.host_keys[seq] + layer * SkvKeptKeyElementsPerLayer(s.geometry);
}

Status CudaModel::AllocateShadowKvKeys(int seq) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  s.host_key_rows[seq] = 0;
  if (s.host_keys[seq]) return Status::Ok();  // kept from an earlier use of the index
  const SkvGeometry& g = s.geometry;
  const int64_t bytes =
      g.num_layers * SkvKeptKeyElementsPerLayer(g) * static_cast<int64_t>(sizeof(Bf16));
  void* pointer = nullptr;
  const cudaError_t error = cudaHostAlloc(&pointer, static_cast<size_t>(bytes),
                                          cudaHostAllocPortable);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return Error(ErrorCode::kResourceExhausted,
                 "pinned host memory for the exact keys of a ShadowKV sequence ({:.2f} GiB): {}",
                 static_cast<double>(bytes) / (1 << 30), cudaGetErrorString(error));
  }
  s.host_keys[seq] = static_cast<Bf16*>(pointer);
  return Status::Ok();
}

Status CudaModel::FreeShadowKvValues(int seq) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  if (!s.value_pointers[seq]) return Status::Ok();
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  s.DropGraphs();  // they may read the table entry
  if (s.host_values[seq]) SKV_CUDA_RETURN_IF_ERROR(cudaFreeHost(s.host_values[seq]));
  s.host_values[seq] = nullptr;
  s.device_values[seq].Reset();
  s.value_pointers[seq] = nullptr;
  s.lengths[seq] = 0;
  s.host_key_rows[seq] = 0;  // the key copy's memory stays with the index for its next use
  return UploadValueTable(s, m.stream);
}

namespace {

// Every per-sequence device buffer of the state, in one fixed order.
template <typename Visit>
Status ForEachSequenceBuffer(ShadowKvState& s, Visit&& visit) {
  auto part = [&](auto& buffer) -> Status {
    if (buffer.size() == 0) return Status::Ok();  // a form not used by these settings
    const int64_t per = buffer.size() / s.num_sequences * sizeof(*buffer.get());
    return visit(reinterpret_cast<uint8_t*>(buffer.get()), per);
  };
  SKV_RETURN_IF_ERROR(part(s.attn_keys));
  SKV_RETURN_IF_ERROR(part(s.attn_values));
  SKV_RETURN_IF_ERROR(part(s.keys_pre));
  SKV_RETURN_IF_ERROR(part(s.coefficients));
  SKV_RETURN_IF_ERROR(part(s.basis));
  SKV_RETURN_IF_ERROR(part(s.landmarks));
  SKV_RETURN_IF_ERROR(part(s.landmark_codes));
  SKV_RETURN_IF_ERROR(part(s.landmark_scales));
  SKV_RETURN_IF_ERROR(part(s.outlier));
  SKV_RETURN_IF_ERROR(part(s.slot_chunk));
  SKV_RETURN_IF_ERROR(part(s.slot_log_weight));
  SKV_RETURN_IF_ERROR(part(s.layer_rank));
  SKV_RETURN_IF_ERROR(part(s.drift_step));
  SKV_RETURN_IF_ERROR(part(s.drift_queries));
  SKV_RETURN_IF_ERROR(part(s.window_keys));
  SKV_RETURN_IF_ERROR(part(s.window_values));
  return part(s.info);
}

struct SnapshotBookkeeping {
  SkvSequenceInfo info;
  int64_t length = 0;
  int64_t exact_first0 = 0;
};

}  // namespace

Status CudaModel::CopyShadowKvSequence(int from, int to) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, from));
  SKV_RETURN_IF_ERROR(CheckSeq(s, to));
  if (from == to) return Status::Ok();
  if (!s.value_pointers[to]) return Error(ErrorCode::kInvalidArgument, "sequence {} has no values", to);
  SKV_RETURN_IF_ERROR(ForEachSequenceBuffer(s, [&](uint8_t* base, int64_t per) -> Status {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(base + to * per, base + from * per, per,
                                             cudaMemcpyDeviceToDevice, m.stream));
    return Status::Ok();
  }));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.value_pointers[to], s.value_pointers[from],
                                           s.geometry.StoreBytesPerSequence(), cudaMemcpyDefault,
                                           m.stream));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  s.host_info[to] = s.host_info[from];
  s.lengths[to] = s.lengths[from];
  s.exact_first0[to] = s.exact_first0[from];
  // The exact-key copy goes along where the target index has room for one.
  s.host_key_rows[to] = 0;
  if (s.host_keys[from] && s.host_keys[to] && s.host_key_rows[from] > 0) {
    const SkvGeometry& g = s.geometry;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::memcpy(SkvKeptKeys(s, to, layer), SkvKeptKeys(s, from, layer),
                  static_cast<size_t>(s.host_key_rows[from]) * g.kv_width() * sizeof(Bf16));
    }
    s.host_key_rows[to] = s.host_key_rows[from];
  }
  return Status::Ok();
}

Result<CudaShadowKvSnapshot> CudaModel::SaveShadowKvSequence(int seq) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  if (!s.value_pointers[seq]) return Error(ErrorCode::kInvalidArgument, "sequence {} has no values", seq);
  CudaShadowKvSnapshot snapshot;
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  SKV_RETURN_IF_ERROR(ForEachSequenceBuffer(s, [&](uint8_t* base, int64_t per) -> Status {
    std::vector<uint8_t>& part = snapshot.device_parts.emplace_back(per);
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(part.data(), base + seq * per, per, cudaMemcpyDeviceToHost));
    return Status::Ok();
  }));
  snapshot.values.resize(s.geometry.StoreBytesPerSequence());
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(snapshot.values.data(), s.value_pointers[seq],
                                      snapshot.values.size(), cudaMemcpyDefault));
  const SnapshotBookkeeping book{s.host_info[seq], s.lengths[seq], s.exact_first0[seq]};
  snapshot.bookkeeping.resize(sizeof(book));
  std::memcpy(snapshot.bookkeeping.data(), &book, sizeof(book));
  return snapshot;
}

Status CudaModel::RestoreShadowKvSequence(const CudaShadowKvSnapshot& snapshot, int seq) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  if (!s.value_pointers[seq]) return Error(ErrorCode::kInvalidArgument, "sequence {} has no values", seq);
  if (snapshot.bookkeeping.size() != sizeof(SnapshotBookkeeping) ||
      static_cast<int64_t>(snapshot.values.size()) != s.geometry.StoreBytesPerSequence()) {
    return Error(ErrorCode::kInvalidArgument, "the snapshot is of other ShadowKV settings");
  }
  size_t index = 0;
  SKV_RETURN_IF_ERROR(ForEachSequenceBuffer(s, [&](uint8_t* base, int64_t per) -> Status {
    if (index >= snapshot.device_parts.size() ||
        static_cast<int64_t>(snapshot.device_parts[index].size()) != per) {
      return Error(ErrorCode::kInvalidArgument, "the snapshot is of other ShadowKV settings");
    }
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(base + seq * per, snapshot.device_parts[index++].data(),
                                        per, cudaMemcpyHostToDevice));
    return Status::Ok();
  }));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(s.value_pointers[seq], snapshot.values.data(),
                                      snapshot.values.size(), cudaMemcpyDefault));
  SnapshotBookkeeping book;
  std::memcpy(&book, snapshot.bookkeeping.data(), sizeof(book));
  s.host_info[seq] = book.info;
  s.lengths[seq] = book.length;
  s.exact_first0[seq] = book.exact_first0;
  s.host_key_rows[seq] = 0;  // a snapshot carries no exact-key copy
  return Status::Ok();
}

int64_t CudaModel::shadowkv_length(int seq) const {
  const Impl& m = *impl_;
  return m.skv && seq >= 0 && seq < m.skv->num_sequences ? m.skv->lengths[seq] : 0;
}

CudaShadowKvStats CudaModel::shadowkv_stats() const {
  CudaShadowKvStats stats;
  const Impl& m = *impl_;
  if (!m.skv) return stats;
  const ShadowKvState& s = *m.skv;
  stats.num_sequences = s.num_sequences;
  stats.rank = s.geometry.rank;
  stats.max_budget_chunks = s.geometry.max_budget;
  stats.device_bytes = s.num_sequences * s.geometry.DeviceBytesPerSequence() + s.logits.bytes() +
                       s.softmax_partials.bytes() + s.miss_chunk.bytes() + s.candidates.bytes() +
                       s.candidate_lse.bytes() + s.head_keeps.bytes();
  for (int i = 0; i < s.num_sequences; ++i) {
    if (s.host_values[i]) {
      ++stats.host_value_sequences;
      stats.host_bytes += s.geometry.StoreBytesPerSequence();
    } else if (s.value_pointers[i]) {
      ++stats.device_value_sequences;
      stats.device_bytes += s.geometry.StoreBytesPerSequence();
    }
  }
  if (auto counts = ShadowKvSequenceCounts(); counts.ok()) {
    CudaChunkCounts all;
    for (const CudaChunkCounts& c : *counts) all += c;
    stats.chunks_selected = all.selected;
    stats.chunk_hits = all.hits;
    stats.head_steps = all.head_steps;
    stats.head_selections = all.head_selections;
  }
  stats.compress_seconds = s.compress_seconds;
  stats.compress_phase_seconds = s.compress_phase_seconds;
  return stats;
}

void CudaModel::ResetShadowKvCounters() {
  if (impl_->skv) (void)cudaMemset(impl_->skv->counters.get(), 0, impl_->skv->counters.bytes());
}

Result<std::vector<CudaChunkCounts>> CudaModel::ShadowKvSequenceCounts() const {
  const Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  const ShadowKvState& s = *m.skv;
  std::vector<unsigned long long> counters(s.counters.size());
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(counters.data(), s.counters.get(), s.counters.bytes(),
                                      cudaMemcpyDeviceToHost));
  std::vector<CudaChunkCounts> counts(s.num_sequences);
  for (int i = 0; i < s.num_sequences; ++i) {
    const unsigned long long* of = counters.data() + kSkvCounters * static_cast<int64_t>(i);
    counts[i].selected = static_cast<int64_t>(of[0]);
    counts[i].hits = static_cast<int64_t>(of[1]);
    counts[i].head_steps = static_cast<int64_t>(of[2]);
    counts[i].head_selections = static_cast<int64_t>(of[3]);
  }
  return counts;
}

Result<std::vector<int32_t>> CudaModel::ShadowKvLayerRanks(int seq) const {
  const Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  const ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  std::vector<int32_t> compressed(s.geometry.num_layers);
  SKV_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(compressed.data(), s.layer_rank.get() + static_cast<int64_t>(seq) * compressed.size(),
                 compressed.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  // At the model's layers; a windowed layer keeps its keys whole (rank 0: not compressed).
  std::vector<int32_t> ranks(m.config.num_layers, 0);
  for (int layer = 0; layer < m.config.num_layers; ++layer) {
    if (!s.parts.windowed[layer]) ranks[layer] = compressed[s.parts.index[layer]];
  }
  return ranks;
}

Result<std::vector<int32_t>> CudaModel::ShadowKvGatheredChunks(int seq, int layer,
                                                               int kv_head) const {
  const Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  const ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  if (layer < 0 || layer >= m.config.num_layers || kv_head < 0 || kv_head >= m.config.num_kv_heads) {
    return Error(ErrorCode::kInvalidArgument, "layer {} / KV head {}", layer, kv_head);
  }
  if (s.parts.windowed[layer]) return std::vector<int32_t>{};  // it keeps its window, gathers none
  std::vector<int32_t> chunks(s.host_info[seq].budget_chunks);
  const int64_t offset = s.layout.HeadIndex(seq, s.parts.index[layer], kv_head) * s.geometry.max_budget;
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(chunks.data(), s.layout.slot_chunk + offset,
                                      chunks.size() * 4, cudaMemcpyDeviceToHost));
  return chunks;
}

}  // namespace shadowkv::cuda
