// CudaModel's ShadowKV sequences: allocation, compression of a prefilled full-cache slot
// (Gram matrices and their top-r eigenvectors on the GPU, or on the host for wide keys; A,
// landmarks, outliers, values), copies, snapshots and statistics. The decode step is in
// shadowkv_decode.cc.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include <cblas.h>

#include "core/half.h"
#include "gpu/model/cuda_model_impl.h"
#include "kv/low_rank.h"
#include "ops/cuda/gemm/gemm.h"

namespace shadowkv::cuda {

ShadowKvState::~ShadowKvState() {
  DropGraphs();
  for (Bf16* pointer : host_values) {
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

// The GPU's ShadowKV cache compresses every layer and has no window to mask, so sliding-window
// models (gemma3, Mistral-style llama) take only the full cache here; its scoring and select
// kernels hold a GQA group's query heads in mma tiles of 8 columns, built for groups of 1 to 8
// and 16 (GLM-4-9B), so other groups take only the full cache too. The CPU backend serves both
// with ShadowKV (on a sliding model the global layers compressed and the windowed layers kept
// exact, kv/sliding_split_policy.cc), and `eval --device cuda` decodes ShadowKV there.
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
  const auto windowed = std::count(c.layer_windowed.begin(), c.layer_windowed.end(), true);
  if (windowed == 0) return Status::Ok();
  return Error(ErrorCode::kUnsupported,
               "KV policy 'shadowkv' has no CUDA path for this model: {} of its {} layers attend "
               "to a sliding window of {} tokens, and the GPU's ShadowKV cache compresses every "
               "layer; ShadowKV on sliding-window models (global layers compressed, windowed "
               "layers exact) runs on the CPU backend (--device cpu; `eval --device cuda` "
               "decodes it there from the GPU's prompt)",
               windowed, c.num_layers, c.sliding_window);
}

Result<std::pair<int64_t, int64_t>> CudaModel::ShadowKvBytesPerSequence(
    const kv::KvPolicyConfig& requested, int64_t capacity) const {
  const ModelConfig& c = impl_->config;
  const kv::KvPolicyConfig config = kv::WithPaperSettings(requested);  // as the CPU policy does
  SKV_RETURN_IF_ERROR(ShadowKvRunsHere());
  SKV_ASSIGN_OR_RETURN(SkvGeometry g, MakeSkvGeometry(config, c.num_layers, c.num_kv_heads,
                                                      c.head_dim, capacity));
  return std::pair<int64_t, int64_t>{g.DeviceBytesPerSequence(), g.ValueBytesPerSequence()};
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
  SKV_ASSIGN_OR_RETURN(SkvGeometry g, MakeSkvGeometry(config, c.num_layers, c.num_kv_heads,
                                                      c.head_dim, capacity));
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
  if (config.fp8_landmarks != 0 && !fast) {
    return Error(ErrorCode::kUnsupported, "ShadowKV FP8 landmarks (fp8_landmarks=1) need the "
                 "fast decode kernels (kernel option shadowkv_kernels = 1, the default)");
  }
  s->config = config;
  s->geometry = g;
  s->num_sequences = num_sequences;
  const int64_t n = num_sequences, layers = c.num_layers, heads = c.num_kv_heads;
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
  SKV_RETURN_IF_ERROR(sized(s->layer_rank.Allocate(n * layers)));
  SKV_RETURN_IF_ERROR(sized(s->info.Allocate(n)));
  SKV_RETURN_IF_ERROR(sized(s->value_table.Allocate(n)));
  SKV_RETURN_IF_ERROR(sized(s->counters.Allocate(2 * n)));
  const int64_t batch = m.options.max_batch;
  SKV_RETURN_IF_ERROR(sized(s->logits.Allocate(batch * c.num_query_heads * g.capacity_chunks)));
  SKV_RETURN_IF_ERROR(sized(s->softmax_partials.Allocate(
      batch * c.num_query_heads * SkvScoreBlocks(static_cast<int>(g.capacity_chunks)) * 2)));
  SKV_RETURN_IF_ERROR(sized(s->miss_chunk.Allocate(batch * heads * g.max_budget)));
  if (g.max_candidates > 0) {
    SKV_RETURN_IF_ERROR(sized(s->candidates.Allocate(batch * heads * g.max_candidates)));
    SKV_RETURN_IF_ERROR(sized(
        s->candidate_lse.Allocate(batch * c.num_query_heads * g.max_candidates)));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->slot_chunk.get(), 0xFF, s->slot_chunk.bytes()));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->counters.get(), 0, s->counters.bytes()));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemset(s->info.get(), 0, s->info.bytes()));
  {
    const std::vector<int32_t> full_rank(static_cast<size_t>(n * layers), g.rank);
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(s->layer_rank.get(), full_rank.data(),
                                        s->layer_rank.bytes(), cudaMemcpyHostToDevice));
  }

  // Per-row plans: [SkvRowMeta x batch] then three int arrays, one block uploaded per step.
  const int64_t at_rows = 0, at_attn = batch * sizeof(SkvRowMeta), at_pre = at_attn + batch * 4,
                at_last = at_pre + batch * 4;
  s->meta_bytes = at_last + batch * 4;
  SKV_RETURN_IF_ERROR(s->meta_block.Allocate(s->meta_bytes));
  void* host_block = nullptr;
  SKV_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host_block, s->meta_bytes, cudaHostAllocDefault));
  s->host_meta_block = static_cast<uint8_t*>(host_block);
  std::memset(s->host_meta_block, 0, s->meta_bytes);
  s->row_meta = reinterpret_cast<SkvRowMeta*>(s->meta_block.get() + at_rows);
  s->attn_rows = reinterpret_cast<int32_t*>(s->meta_block.get() + at_attn);
  s->pre_rows = reinterpret_cast<int32_t*>(s->meta_block.get() + at_pre);
  s->attn_last = reinterpret_cast<int32_t*>(s->meta_block.get() + at_last);
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
                                                                 c.num_layers, m.stream));
    SKV_RETURN_IF_ERROR(sized(s->gram.Allocate(layers * width * width)));
    SKV_RETURN_IF_ERROR(sized(s->eigen_values.Allocate(layers * width)));
    SKV_RETURN_IF_ERROR(sized(s->eigen_info.Allocate(layers)));
  }

  s->device_values.resize(n);
  s->host_values.assign(n, nullptr);
  s->value_pointers.assign(n, nullptr);
  s->host_info.assign(n, SkvSequenceInfo{});
  s->lengths.assign(n, 0);
  s->exact_first0.assign(n, 0);

  SkvLayout& l = s->layout;
  l.num_layers = c.num_layers;
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
  l.attn.num_layers = c.num_layers;
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
  l.outlier = s->outlier.get();
  l.slot_chunk = s->slot_chunk.get();
  l.values = s->value_table.get();
  l.info = s->info.get();
  l.counters = s->counters.get();
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
  const int64_t bytes = s.geometry.ValueBytesPerSequence();
  if (on_host) {
    void* pointer = nullptr;
    const cudaError_t error = cudaHostAlloc(&pointer, static_cast<size_t>(bytes),
                                            cudaHostAllocMapped | cudaHostAllocPortable);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return Error(ErrorCode::kResourceExhausted, "pinned host memory for the values of a "
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
  return UploadValueTable(s, m.stream);
}

namespace {

// Compression step 2 on the host (widths past CudaKernelOptions::basis_gpu_max_width): the
// top-`rank` eigenvectors of each layer's Gram matrix (gram_host: [layers, width, width]) by the
// CPU policy's own solver, in fp32 like the Gram it is given, layers in parallel threads, into
// basis_host ([layers, rank, width] bf16, zeros past a layer's rank) and ranks_host ([layers]).
// OpenBLAS runs single-threaded meanwhile: concurrent callers of its threaded server serialise
// (measured: 12 s for 32 layers of width 1024 on 16 cores).
Status FitBasesOnHost(const SkvGeometry& g, int layers, std::span<const float> gram_host,
                      std::span<uint16_t> basis_host, std::span<int32_t> ranks_host) {
  const int width = g.kv_width(), rank = g.rank;
  std::vector<Status> fits(layers, Status::Ok());
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  {
    const int threads = std::max(1, std::min<int>(layers, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (int layer = t; layer < layers; layer += threads) {
          const std::span<const float> layer_gram =
              gram_host.subspan(static_cast<size_t>(layer) * width * width,
                                static_cast<size_t>(width) * width);
          auto fit = kv::FitLowRankBasis(layer_gram, width, rank);
          if (!fit.ok()) {
            fits[layer] = fit.status();
            continue;
          }
          const int own = g.per_layer_rank() ? SkvRankForEnergy(fit->eigenvalues, fit->total_energy,
                                                                g.rank_energy, g.rank_floor, rank)
                                             : rank;
          ranks_host[layer] = own;
          uint16_t* target = basis_host.data() + static_cast<size_t>(layer) * rank * width;
          for (size_t i = 0; i < static_cast<size_t>(own) * width; ++i) {
            target[i] = Fp32ToBf16(fit->basis[i]);
          }
        }
      });
    }
    for (std::thread& thread : pool) thread.join();
  }
  openblas_set_num_threads(blas_threads);
  for (const Status& fit : fits) SKV_RETURN_IF_ERROR(fit);
  return Status::Ok();
}

// After the stream has passed the GPU solve: an error naming the layers whose solve did not
// converge.
Status CheckEigenInfo(const ShadowKvState& s, cudaStream_t stream) {
  std::vector<int32_t> info(static_cast<size_t>(s.eigen_info.size()));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(info.data(), s.eigen_info.get(), s.eigen_info.bytes(),
                                           cudaMemcpyDeviceToHost, stream));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  std::string failed;
  for (size_t layer = 0; layer < info.size(); ++layer) {
    if (info[layer] != 0) failed += fmt::format("{}{} ({})", failed.empty() ? "" : ", ", layer,
                                                info[layer]);
  }
  if (failed.empty()) return Status::Ok();
  return Error(ErrorCode::kInternal,
               "ShadowKV compression: the eigensolver of the key basis failed on layers {}",
               failed);
}

}  // namespace

Status CudaModel::CompressToShadowKv(int full_slot, int seq) {
  using Clock = std::chrono::steady_clock;
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  if (full_slot < 0 || full_slot >= m.cache.num_slots) {
    return Error(ErrorCode::kInvalidArgument, "full-cache slot {} is outside [0, {})", full_slot,
                 m.cache.num_slots);
  }
  if (m.kv_keys_pre.size() == 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "the full cache keeps no pre-RoPE keys: AllocateKvCache(..., true)");
  }
  if (!s.value_pointers[seq]) {
    return Error(ErrorCode::kInvalidArgument, "sequence {} has no value store", seq);
  }
  const auto start = Clock::now();
  cudaStream_t stream = m.stream;
  // Phase marks on the GPU's timeline (read after the last synchronisation below).
  auto mark = [&](int index) { return cudaEventRecord(s.compress_marks[index], stream); };
  SKV_CUDA_RETURN_IF_ERROR(mark(0));
  const ModelConfig& c = m.config;
  const SkvGeometry& g = s.geometry;
  const SkvLayout& l = s.layout;
  const int64_t prompt = m.lengths[full_slot];
  SKV_ASSIGN_OR_RETURN(SkvCompressionPlan plan, PlanSkvCompression(s.config, g, prompt));
  const int layers = c.num_layers, heads = c.num_kv_heads, d = c.head_dim, chunk = g.chunk_size;
  const int width = g.kv_width(), rank = g.rank;
  const int64_t chunked = plan.exact_first, num_chunks = plan.num_chunks;
  const int64_t recent = prompt - chunked;
  const int outliers = plan.info.outlier_chunks;
  auto pre_keys = [&](int layer) {
    return m.kv_keys_pre.get() +
           (static_cast<int64_t>(full_slot) * layers + layer) * m.cache.capacity * width;
  };

  // 1. Gram matrices of every layer's pre-RoPE keys (all prompt rows), fp32 on the tensor cores.
  DeviceBuffer<float> host_path_gram;
  float* gram = s.gram.get();
  if (!s.eigen) {
    SKV_RETURN_IF_ERROR(host_path_gram.Allocate(static_cast<int64_t>(layers) * width * width));
    gram = host_path_gram.get();
  }
  const float one = 1.0f, zero = 0.0f;
  // Row-major X [prompt, width] is column-major Xᵀ; G = Xᵀ·X = (Xᵀ)·(Xᵀ)ᵀ. Every layer in one
  // launch: one product's output is a tile or two, so a layer alone keeps a few SMs busy.
  const int64_t layer_keys = m.cache.capacity * width;
  SKV_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      m.cublas, CUBLAS_OP_N, CUBLAS_OP_T, width, width, static_cast<int>(prompt), &one,
      pre_keys(0), CUDA_R_16BF, width, layer_keys, pre_keys(0), CUDA_R_16BF, width, layer_keys,
      &zero, gram, CUDA_R_32F, width, static_cast<int64_t>(width) * width, layers,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  SKV_CUDA_RETURN_IF_ERROR(mark(1));

  // 2. Top-r eigenvectors of each layer's Gram matrix as B's rows; under a per-layer rank r is
  //    the cap: the layer keeps the rank its spectrum asks for (SkvRankForEnergy) and the rows
  //    past it are zeros, so that A's columns there come out zero below and in every graduation.
  Bf16* basis = l.basis + static_cast<int64_t>(seq) * layers * rank * width;
  int32_t* layer_ranks = s.layer_rank.get() + static_cast<int64_t>(seq) * layers;
  std::vector<int32_t> ranks_host(layers, rank);
  if (s.eigen) {
    // On the GPU, every layer at once, in stream order: the host waits only where a per-layer
    // rank needs the spectrum.
    std::vector<float> diagonal;
    if (g.per_layer_rank()) {  // the traces, before the solver overwrites the matrices
      diagonal.resize(static_cast<size_t>(layers) * width);
      for (int layer = 0; layer < layers; ++layer) {
        SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
            diagonal.data() + static_cast<size_t>(layer) * width, sizeof(float),
            gram + static_cast<int64_t>(layer) * width * width, (width + 1) * sizeof(float),
            sizeof(float), width, cudaMemcpyDeviceToHost, stream));
      }
    }
    SKV_RETURN_IF_ERROR(s.eigen->Run(gram, s.eigen_values.get(), s.eigen_info.get()));
    if (g.per_layer_rank()) {
      std::vector<float> values(static_cast<size_t>(layers) * width);
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(values.data(), s.eigen_values.get(),
                                               values.size() * sizeof(float),
                                               cudaMemcpyDeviceToHost, stream));
      SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      SKV_RETURN_IF_ERROR(CheckEigenInfo(s, stream));
      std::vector<double> top(rank);
      for (int layer = 0; layer < layers; ++layer) {
        const float* ascending = values.data() + static_cast<size_t>(layer) * width;
        for (int i = 0; i < rank; ++i) top[i] = ascending[width - 1 - i];
        double total = 0.0;
        for (int i = 0; i < width; ++i) total += diagonal[static_cast<size_t>(layer) * width + i];
        ranks_host[layer] =
            SkvRankForEnergy(top, total, g.rank_energy, g.rank_floor, rank);
      }
    }
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(layer_ranks, ranks_host.data(),
                                             ranks_host.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, stream));
    SkvBasisParams bp;
    bp.layout = l;
    bp.seq = seq;
    bp.eigenvectors = gram;
    bp.ranks = g.per_layer_rank() ? layer_ranks : nullptr;
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvBasisFromEigenvectors(bp, stream));
  } else {
    std::vector<float> gram_host(static_cast<size_t>(layers) * width * width);
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(gram_host.data(), gram, gram_host.size() * 4,
                                             cudaMemcpyDeviceToHost, stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    host_path_gram.Reset();
    std::vector<uint16_t> basis_host(static_cast<size_t>(layers) * rank * width, 0);
    SKV_RETURN_IF_ERROR(FitBasesOnHost(g, layers, gram_host, basis_host, ranks_host));
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(basis, basis_host.data(),
                                             basis_host.size() * sizeof(uint16_t),
                                             cudaMemcpyHostToDevice, stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(layer_ranks, ranks_host.data(),
                                             ranks_host.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(mark(2));

  // 3. A = X·Bᵀ for the chunked rows; landmarks and min-cosines of every chunk (and under FP8
  //    values, every chunk's quantised value run).
  DeviceBuffer<float> min_cosine;
  SKV_RETURN_IF_ERROR(min_cosine.Allocate(static_cast<int64_t>(layers) * heads * num_chunks));
  {
    GemmParams gp;
    gp.x = pre_keys(0);
    gp.weight = basis;
    gp.y = l.coefficients + static_cast<int64_t>(seq) * layers * g.capacity_chunks * chunk * rank;
    gp.output = GemmOutput::kBfloat16;
    gp.rows = chunked;
    gp.in = width;
    gp.out = rank;
    GemmBatch every_layer;
    every_layer.batch = layers;
    every_layer.x_stride = layer_keys;
    every_layer.weight_stride = static_cast<int64_t>(rank) * width;
    every_layer.y_stride = static_cast<int64_t>(g.capacity_chunks) * chunk * rank;
    SKV_RETURN_IF_ERROR(RunGemmBatched(m.cublas, gp, every_layer));
  }
  for (int layer = 0; layer < layers; ++layer) {
    SkvLandmarkParams lp;
    lp.layout = l;
    lp.seq = seq;
    lp.layer = layer;
    lp.cache = m.cache;
    lp.cache_slot = full_slot;
    lp.num_chunks = static_cast<int>(num_chunks);
    lp.min_cosine = min_cosine.get() + static_cast<int64_t>(layer) * heads * num_chunks;
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvLandmarks(lp, stream));
    if (g.fp8_values) SKV_CUDA_RETURN_IF_ERROR(LaunchSkvStoreValuesFp8(lp, stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(mark(3));

  // 4. Outliers per (layer, head) by the CPU's own rule (kv::PickOutlierChunks), on the GPU;
  //    their exact K/V into the buffer.
  DeviceBuffer<int32_t> outlier_list;
  SKV_RETURN_IF_ERROR(
      outlier_list.Allocate(std::max<int64_t>(1, static_cast<int64_t>(layers) * heads * outliers)));
  SkvPickOutliersParams pick;
  pick.min_cosine = min_cosine.get();
  pick.pairs = layers * heads;
  pick.num_chunks = static_cast<int>(num_chunks);
  pick.count = outliers;
  pick.outliers = outlier_list.get();
  SKV_CUDA_RETURN_IF_ERROR(LaunchSkvPickOutliers(pick, stream));
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(Bf16);
  for (int layer = 0; layer < layers; ++layer) {
    SkvOutlierParams op;
    op.layout = l;
    op.seq = seq;
    op.layer = layer;
    op.cache = m.cache;
    op.cache_slot = full_slot;
    op.outliers = outlier_list.get() + static_cast<int64_t>(layer) * heads * outliers;
    op.num_outliers = outliers;
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvPlaceOutliers(op, stream));
    // 5. Values of every chunk to the store (one run per chunk per head), the exact window
    //    (post-RoPE K, V, pre-RoPE K) to the recent rows.
    const Bf16* cache_values = m.cache.values + m.cache.HeadOffset(full_slot, layer, 0);
    const Bf16* cache_keys = m.cache.keys + m.cache.HeadOffset(full_slot, layer, 0);
    const size_t cache_pitch = static_cast<size_t>(m.cache.capacity) * row_bytes;
    if (!g.fp8_values) {  // (FP8 runs were quantised with the landmarks, step 3)
      Bf16* store = s.value_pointers[seq] +
                    static_cast<int64_t>(layer) * heads * g.capacity_chunks * chunk * d;
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          store, static_cast<size_t>(g.capacity_chunks) * chunk * row_bytes, cache_values,
          cache_pitch, chunked * row_bytes, heads, cudaMemcpyDefault, stream));
    }
    const int64_t attn_head0 = l.attn.HeadOffset(seq, layer, 0) +
                               static_cast<int64_t>(plan.info.recent_base) * d;
    const size_t attn_pitch = static_cast<size_t>(l.attn.capacity) * row_bytes;
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(l.attn.keys + attn_head0, attn_pitch,
                                               cache_keys + chunked * d, cache_pitch,
                                               recent * row_bytes, heads,
                                               cudaMemcpyDeviceToDevice, stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(l.attn.values + attn_head0, attn_pitch,
                                               cache_values + chunked * d, cache_pitch,
                                               recent * row_bytes, heads,
                                               cudaMemcpyDeviceToDevice, stream));
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        l.keys_pre + (static_cast<int64_t>(seq) * layers + layer) * g.recent_capacity * width,
        pre_keys(layer) + chunked * width, recent * width * sizeof(Bf16),
        cudaMemcpyDeviceToDevice, stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      l.slot_chunk + static_cast<int64_t>(seq) * layers * heads * g.max_budget, 0xFF,
      static_cast<size_t>(layers) * heads * g.max_budget * 4, stream));
  SKV_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(l.SequenceCounters(seq), 0, 2 * sizeof(unsigned long long), stream));
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.info.get() + seq, &plan.info, sizeof(plan.info),
                                           cudaMemcpyHostToDevice, stream));
  SKV_CUDA_RETURN_IF_ERROR(mark(4));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (s.eigen && !g.per_layer_rank()) SKV_RETURN_IF_ERROR(CheckEigenInfo(s, stream));
  s.host_info[seq] = plan.info;
  s.lengths[seq] = prompt;
  s.exact_first0[seq] = chunked;
  s.compress_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (size_t i = 0; i < s.compress_phase_seconds.size(); ++i) {
    float ms = 0.0f;
    SKV_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, s.compress_marks[i], s.compress_marks[i + 1]));
    s.compress_phase_seconds[i] = ms / 1e3;
  }
  return Status::Ok();
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
  SKV_RETURN_IF_ERROR(part(s.layer_rank));
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
                                           s.geometry.ValueBytesPerSequence(), cudaMemcpyDefault,
                                           m.stream));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  s.host_info[to] = s.host_info[from];
  s.lengths[to] = s.lengths[from];
  s.exact_first0[to] = s.exact_first0[from];
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
  snapshot.values.resize(s.geometry.ValueBytesPerSequence());
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
      static_cast<int64_t>(snapshot.values.size()) != s.geometry.ValueBytesPerSequence()) {
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
                       s.candidate_lse.bytes();
  for (int i = 0; i < s.num_sequences; ++i) {
    if (s.host_values[i]) {
      ++stats.host_value_sequences;
      stats.host_bytes += s.geometry.ValueBytesPerSequence();
    } else if (s.value_pointers[i]) {
      ++stats.device_value_sequences;
      stats.device_bytes += s.geometry.ValueBytesPerSequence();
    }
  }
  if (auto counts = ShadowKvSequenceCounts(); counts.ok()) {
    for (const CudaChunkCounts& c : *counts) {
      stats.chunks_selected += c.selected;
      stats.chunk_hits += c.hits;
    }
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
    counts[i].selected = static_cast<int64_t>(counters[2 * i]);
    counts[i].hits = static_cast<int64_t>(counters[2 * i + 1]);
  }
  return counts;
}

Result<std::vector<int32_t>> CudaModel::ShadowKvLayerRanks(int seq) const {
  const Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  const ShadowKvState& s = *m.skv;
  SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
  std::vector<int32_t> ranks(m.config.num_layers);
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(ranks.data(),
                                      s.layer_rank.get() + static_cast<int64_t>(seq) * ranks.size(),
                                      ranks.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
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
  std::vector<int32_t> chunks(s.host_info[seq].budget_chunks);
  const int64_t offset =
      ((static_cast<int64_t>(seq) * m.config.num_layers + layer) * m.config.num_kv_heads + kv_head) *
      s.geometry.max_budget;
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(chunks.data(), s.slot_chunk.get() + offset,
                                      chunks.size() * 4, cudaMemcpyDeviceToHost));
  return chunks;
}

}  // namespace shadowkv::cuda
