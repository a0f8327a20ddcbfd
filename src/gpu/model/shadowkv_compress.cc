// CudaModel::CompressToShadowKv: a prefilled full-cache slot into a ShadowKV sequence. Every
// compressed layer's Gram matrix of pre-RoPE keys, its top-r eigenvectors (on the GPU in one
// batched solve, or on the host for keys wider than CudaKernelOptions::basis_gpu_max_width),
// A = X·Bᵀ, landmarks and minimum cosines, the outlier chunks, the values and the exact window;
// on a sliding-window model the windowed layers' last tokens into their rings; in stream order,
// the host waiting once at the end; and CudaModel::DecompressShadowKv, a sequence back into a
// full-cache slot. Allocation, copies and statistics are in shadowkv_model.cc, the decode step
// in shadowkv_decode.cc.
#include <algorithm>
#include <chrono>
#include <thread>

#include <cblas.h>

#include "core/half.h"
#include "gpu/model/cuda_model_impl.h"
#include "kv/low_rank.h"
#include "ops/cuda/gemm/gemm.h"

namespace shadowkv::cuda {

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

// The compressed layers as runs of one stride through the full cache, for the batched GEMMs:
// one run where they are evenly spaced (every layer; gemma3's every sixth), else one per layer.
struct LayerRun {
  int first = 0;     // compressed index of the run's first layer
  int count = 0;
  int64_t step = 1;  // model layers from one to the next
};

std::vector<LayerRun> LayerRunsOf(const std::vector<int>& global) {
  const int n = static_cast<int>(global.size());
  bool even = true;
  for (int i = 2; i < n; ++i) even = even && global[i] - global[i - 1] == global[1] - global[0];
  if (even) return {LayerRun{0, n, n > 1 ? global[1] - global[0] : 1}};
  std::vector<LayerRun> runs;
  for (int i = 0; i < n; ++i) runs.push_back(LayerRun{i, 1, 1});
  return runs;
}

// Which way a copy between a full-cache slot and a ShadowKV sequence goes: into the sequence
// (compression) or back into the slot (decompression).
enum class Toward { kSequence, kSlot };

// The windowed layers' rings of sequence `seq` and full-cache slot `slot` holding `length`
// tokens: the last window_rows of them, token p at ring row p % window_rows.
Status CopyWindowRings(const ShadowKvState& s, const KvCacheView& cache, int slot, int seq,
                       int64_t length, Toward toward, cudaStream_t stream) {
  const KvCacheView& ring = s.window;
  const int64_t rows = ring.capacity, d = ring.head_dim;
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(Bf16);
  const size_t ring_pitch = rows * row_bytes, cache_pitch = cache.capacity * row_bytes;
  for (size_t layer = 0; layer < s.parts.windowed.size(); ++layer) {
    if (!s.parts.windowed[layer]) continue;
    const int index = s.parts.index[layer];
    // Two runs at most: up to the ring's end, then from its start.
    for (int64_t from = std::max<int64_t>(0, length - rows); from < length;) {
      const int64_t row = from % rows, count = std::min(length - from, rows - row);
      const int64_t at_ring = ring.HeadOffset(seq, index, 0) + row * d;
      const int64_t at_cache = cache.HeadOffset(slot, static_cast<int>(layer), 0) + from * d;
      for (auto [ring_part, cache_part] :
           {std::pair{ring.keys, cache.keys}, std::pair{ring.values, cache.values}}) {
        const bool in = toward == Toward::kSequence;
        SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
            in ? ring_part + at_ring : cache_part + at_cache, in ? ring_pitch : cache_pitch,
            in ? cache_part + at_cache : ring_part + at_ring, in ? cache_pitch : ring_pitch,
            count * row_bytes, ring.num_kv_heads, cudaMemcpyDeviceToDevice, stream));
      }
      from += count;
    }
  }
  return Status::Ok();
}

// One compressed layer's exact window of `recent` tokens from position `first`: post-RoPE K and V
// between the slot's rows and the sequence's attention-buffer rows from `recent_base`, pre-RoPE K
// between the slot's pre-key rows (`slot_pre`, the layer's row 0) and the sequence's exact ones.
Status CopyExactWindow(const CudaModel::Impl& m, const ShadowKvState& s, int slot, int seq,
                       int layer, int64_t first, int64_t recent, int recent_base, Bf16* slot_pre,
                       Toward toward, cudaStream_t stream) {
  if (recent <= 0) return Status::Ok();
  const SkvLayout& l = s.layout;
  const int d = m.config.head_dim, width = s.geometry.kv_width();
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(Bf16);
  const size_t cache_pitch = static_cast<size_t>(m.cache.capacity) * row_bytes;
  const size_t attn_pitch = static_cast<size_t>(l.attn.capacity) * row_bytes;
  const int64_t at_attn = l.attn.HeadOffset(seq, layer, 0) + static_cast<int64_t>(recent_base) * d;
  const int64_t at_cache = m.cache.HeadOffset(slot, s.parts.global[layer], 0) + first * d;
  const bool in = toward == Toward::kSequence;
  for (auto [attn_part, cache_part] :
       {std::pair{l.attn.keys, m.cache.keys}, std::pair{l.attn.values, m.cache.values}}) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        in ? attn_part + at_attn : cache_part + at_cache, in ? attn_pitch : cache_pitch,
        in ? cache_part + at_cache : attn_part + at_attn, in ? cache_pitch : attn_pitch,
        recent * row_bytes, m.config.num_kv_heads, cudaMemcpyDeviceToDevice, stream));
  }
  Bf16* exact_pre = l.keys_pre +
                    (static_cast<int64_t>(seq) * s.geometry.num_layers + layer) *
                        s.geometry.recent_capacity * width;
  Bf16* window_pre = slot_pre + first * width;
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(in ? exact_pre : window_pre, in ? window_pre : exact_pre,
                                           recent * width * sizeof(Bf16),
                                           cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

}  // namespace

namespace {

// ShadowKV sequence `seq` and full-cache slot `full_slot`, one that keeps pre-RoPE keys, exist.
Status CheckSeqAndKeySlot(const CudaModel::Impl& m, int seq, int full_slot) {
  SKV_RETURN_IF_ERROR(NeedShadowKv(m));
  SKV_RETURN_IF_ERROR(CheckSeq(*m.skv, seq));
  if (full_slot < 0 || full_slot >= m.cache.num_slots) {
    return Error(ErrorCode::kInvalidArgument, "full-cache slot {} is outside [0, {})", full_slot,
                 m.cache.num_slots);
  }
  if (m.kv_keys_pre.size() == 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "the full cache keeps no pre-RoPE keys: AllocateKvCache(..., true)");
  }
  return Status::Ok();
}

}  // namespace

Status CudaModel::CompressToShadowKv(int full_slot, int seq) {
  using Clock = std::chrono::steady_clock;
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(CheckSeqAndKeySlot(m, seq, full_slot));
  ShadowKvState& s = *m.skv;
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
  // Compressed layer i is model layer global[i] of the full cache.
  const std::vector<int>& global = s.parts.global;
  const int layers = g.num_layers, heads = c.num_kv_heads, d = c.head_dim, chunk = g.chunk_size;
  const int width = g.kv_width(), rank = g.rank;
  const int64_t chunked = plan.exact_first, num_chunks = plan.num_chunks;
  const int64_t recent = prompt - chunked;
  const int outliers = plan.info.outlier_chunks;
  auto pre_keys = [&](int model_layer) {
    return m.kv_keys_pre.get() +
           (static_cast<int64_t>(full_slot) * c.num_layers + model_layer) * m.cache.capacity * width;
  };
  const std::vector<LayerRun> runs = LayerRunsOf(global);

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
  for (const LayerRun& run : runs) {
    const Bf16* keys = pre_keys(global[run.first]);
    const int64_t stride = layer_keys * run.step;
    SKV_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
        m.cublas, CUBLAS_OP_N, CUBLAS_OP_T, width, width, static_cast<int>(prompt), &one, keys,
        CUDA_R_16BF, width, stride, keys, CUDA_R_16BF, width, stride, &zero,
        gram + static_cast<int64_t>(run.first) * width * width, CUDA_R_32F, width,
        static_cast<int64_t>(width) * width, run.count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
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
  //    values or keys, every chunk's quantised value or key run).
  DeviceBuffer<float> min_cosine;
  SKV_RETURN_IF_ERROR(min_cosine.Allocate(static_cast<int64_t>(layers) * heads * num_chunks));
  for (const LayerRun& run : runs) {
    GemmBatch every_layer;
    every_layer.batch = run.count;
    every_layer.x_stride = layer_keys * run.step;
    every_layer.weight_stride = static_cast<int64_t>(rank) * width;
    every_layer.y_stride = static_cast<int64_t>(g.capacity_chunks) * chunk * rank;
    GemmParams gp;
    gp.x = pre_keys(global[run.first]);
    gp.weight = basis + run.first * every_layer.weight_stride;
    gp.y = l.coefficients +
           (static_cast<int64_t>(seq) * layers + run.first) * every_layer.y_stride;
    gp.output = GemmOutput::kBfloat16;
    gp.rows = chunked;
    gp.in = width;
    gp.out = rank;
    SKV_RETURN_IF_ERROR(RunGemmBatched(m.cublas, gp, every_layer));
  }
  for (int layer = 0; layer < layers; ++layer) {
    SkvLandmarkParams lp;
    lp.layout = l;
    lp.seq = seq;
    lp.layer = layer;
    lp.cache = m.cache;
    lp.cache_slot = full_slot;
    lp.cache_layer = global[layer];
    lp.num_chunks = static_cast<int>(num_chunks);
    lp.min_cosine = min_cosine.get() + static_cast<int64_t>(layer) * heads * num_chunks;
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvLandmarks(lp, stream));
    if (g.fp8_values) SKV_CUDA_RETURN_IF_ERROR(LaunchSkvStoreValuesFp8(lp, stream));
    if (g.fp8_keys) SKV_CUDA_RETURN_IF_ERROR(LaunchSkvStoreKeysFp8(lp, stream));
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
    op.cache_layer = global[layer];
    op.outliers = outlier_list.get() + static_cast<int64_t>(layer) * heads * outliers;
    op.num_outliers = outliers;
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvPlaceOutliers(op, stream));
    // 5. Values (and exact keys) of every chunk to the store (one run per chunk per head), the
    //    exact window (post-RoPE K, V, pre-RoPE K) to the recent rows.
    const Bf16* cache_values = m.cache.values + m.cache.HeadOffset(full_slot, global[layer], 0);
    const size_t cache_pitch = static_cast<size_t>(m.cache.capacity) * row_bytes;
    const size_t store_pitch = static_cast<size_t>(g.capacity_chunks) * chunk * row_bytes;
    if (!g.fp8_values) {  // (FP8 runs were quantised with the landmarks, step 3)
      Bf16* store = s.value_pointers[seq] +
                    static_cast<int64_t>(layer) * heads * g.capacity_chunks * chunk * d;
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(store, store_pitch, cache_values, cache_pitch,
                                                 chunked * row_bytes, heads, cudaMemcpyDefault,
                                                 stream));
    }
    if (g.exact_keys && !g.fp8_keys) {  // and their post-RoPE keys, as the full cache holds them
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          l.KeyRunOf(s.value_pointers[seq], layer, 0, 0), store_pitch,
          m.cache.keys + m.cache.HeadOffset(full_slot, global[layer], 0), cache_pitch,
          chunked * row_bytes, heads, cudaMemcpyDefault, stream));
    }
    SKV_RETURN_IF_ERROR(CopyExactWindow(m, s, full_slot, seq, layer, chunked, recent,
                                        plan.info.recent_base, pre_keys(global[layer]),
                                        Toward::kSequence, stream));
    if (s.host_keys[seq]) {  // AllocateShadowKvKeys: the exact chunked keys
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(SkvKeptKeys(s, seq, layer), pre_keys(global[layer]),
                                               chunked * width * sizeof(Bf16),
                                               cudaMemcpyDeviceToHost, stream));
    }
  }
  if (g.window_layers > 0) {
    SKV_RETURN_IF_ERROR(
        CopyWindowRings(s, m.cache, full_slot, seq, prompt, Toward::kSequence, stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      l.slot_chunk + static_cast<int64_t>(seq) * layers * heads * g.max_budget, 0xFF,
      static_cast<size_t>(layers) * heads * g.max_budget * 4, stream));
  if (l.slot_log_weight) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        l.slot_log_weight + static_cast<int64_t>(seq) * layers * heads * g.max_budget, 0,
        static_cast<size_t>(layers) * heads * g.max_budget * sizeof(float), stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(l.SequenceCounters(seq), 0,
                                           kSkvCounters * sizeof(unsigned long long), stream));
  if (l.drift_step) {  // the first decode step of every KV head selects
    SKV_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(l.drift_step + static_cast<int64_t>(seq) * layers * heads, 0xFF,
                        static_cast<size_t>(layers) * heads * sizeof(int32_t), stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.info.get() + seq, &plan.info, sizeof(plan.info),
                                           cudaMemcpyHostToDevice, stream));
  SKV_CUDA_RETURN_IF_ERROR(mark(4));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (s.eigen && !g.per_layer_rank()) SKV_RETURN_IF_ERROR(CheckEigenInfo(s, stream));
  s.host_info[seq] = plan.info;
  s.lengths[seq] = prompt;
  s.exact_first0[seq] = chunked;
  s.host_key_rows[seq] = s.host_keys[seq] ? chunked : 0;
  s.compress_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (size_t i = 0; i < s.compress_phase_seconds.size(); ++i) {
    float ms = 0.0f;
    SKV_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, s.compress_marks[i], s.compress_marks[i + 1]));
    s.compress_phase_seconds[i] = ms / 1e3;
  }
  return Status::Ok();
}

Status CudaModel::DecompressShadowKv(int seq, int full_slot) {
  Impl& m = *impl_;
  SKV_RETURN_IF_ERROR(CheckSeqAndKeySlot(m, seq, full_slot));
  ShadowKvState& s = *m.skv;
  const SkvGeometry& g = s.geometry;
  if (g.fp8_values) {
    return Error(ErrorCode::kUnsupported,
                 "decompressing a ShadowKV sequence reads bf16 values; its store is FP8");
  }
  const int64_t length = s.lengths[seq];
  if (length == 0) return Error(ErrorCode::kInvalidArgument, "sequence {} holds nothing", seq);
  if (length > m.cache.capacity) {
    return Error(ErrorCode::kOutOfRange, "sequence {} holds {} tokens, a slot {}", seq, length,
                 m.cache.capacity);
  }
  const ModelConfig& c = m.config;
  const SkvLayout& l = s.layout;
  cudaStream_t stream = m.stream;
  const int layers = g.num_layers, heads = c.num_kv_heads, d = c.head_dim;
  const int width = g.kv_width(), rank = g.rank, chunk = g.chunk_size;
  const int64_t first = SkvExactFirst(length, s.exact_first0[seq], chunk, g.local_window);
  const int64_t recent = length - first;
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(Bf16);
  const size_t cache_pitch = static_cast<size_t>(m.cache.capacity) * row_bytes;
  const SkvSequenceInfo& info = s.host_info[seq];
  const float one = 1.0f, zero = 0.0f;
  for (int layer = 0; layer < layers; ++layer) {
    const int model_layer = s.parts.global[layer];
    const int64_t index = static_cast<int64_t>(seq) * layers + layer;
    Bf16* pre = m.kv_keys_pre.get() +
                (static_cast<int64_t>(full_slot) * c.num_layers + model_layer) * m.cache.capacity *
                    width;
    if (first > 0) {
      // The compressed prompt's exact pre-RoPE keys where kept, the rest (chunks graduated
      // since) rebuilt: [rows, width] = A [rows, rank] · B [rank, width], row-major; in cuBLAS's
      // column-major terms Kᵀ = Bᵀ·Aᵀ.
      const int64_t kept = std::min(first, s.host_key_rows[seq]);
      if (kept > 0) {
        SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pre, SkvKeptKeys(s, seq, layer),
                                                 kept * width * sizeof(Bf16),
                                                 cudaMemcpyHostToDevice, stream));
      }
      if (first > kept) {
        SKV_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
            m.cublas, CUBLAS_OP_N, CUBLAS_OP_N, width, static_cast<int>(first - kept), rank, &one,
            l.basis + index * rank * width, CUDA_R_16BF, width,
            l.coefficients + (index * g.capacity_chunks * chunk + kept) * rank, CUDA_R_16BF, rank,
            &zero, pre + kept * width, CUDA_R_16BF, width, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT));
      }
      SkvRopeRowsParams rp;
      rp.keys_pre = pre;
      rp.cache = m.cache;
      rp.cache_slot = full_slot;
      rp.cache_layer = model_layer;
      rp.rows = first;
      rp.inv_freq = m.inv_freq.get();
      rp.rotary_dim = c.rope.rotary_dim;
      rp.halves = c.rope.style == RopeConfig::Style::kHalves;
      SKV_CUDA_RETURN_IF_ERROR(LaunchSkvRopeRows(rp, stream));
      const Bf16* store =
          s.value_pointers[seq] + static_cast<int64_t>(layer) * heads * g.capacity_chunks * chunk * d;
      SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          m.cache.values + m.cache.HeadOffset(full_slot, model_layer, 0), cache_pitch, store,
          static_cast<size_t>(g.capacity_chunks) * chunk * row_bytes, first * row_bytes, heads,
          cudaMemcpyDefault, stream));
    }
    SKV_RETURN_IF_ERROR(CopyExactWindow(m, s, full_slot, seq, layer, first, recent,
                                        info.recent_base, pre, Toward::kSlot, stream));
  }
  if (g.window_layers > 0) {
    SKV_RETURN_IF_ERROR(CopyWindowRings(s, m.cache, full_slot, seq, length, Toward::kSlot, stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  m.lengths[full_slot] = length;
  return Status::Ok();
}

}  // namespace shadowkv::cuda
