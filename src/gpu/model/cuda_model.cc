// CudaModel: loading (GGUF dequantised to bf16, fused tensors split as the CPU splits them, or
// synthetic weights made on the device), step buffers and the KV cache. The forward pass itself
// is in cuda_forward.cc.
#include <fmt/ranges.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "core/half.h"
#include "core/rope.h"
#include "format/gguf.h"
#include "format/quants.h"
#include "gpu/model/cuda_model_impl.h"
#include "gpu/tp/communicator.h"
#include "ops/cuda/attention/decode_attention.cuh"
#include "ops/cuda/common/cuda_backend.h"
#include "ops/cuda/elementwise/fill_random.cuh"
#include "ops/cuda/gemm/gemm.h"
#include "ops/cuda/rope/qkv_rope.cuh"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int64_t kCublasWorkspaceBytes = 64ll << 20;

Status CheckSupported(const ModelConfig& c, const CudaModelOptions& o) {
  if (c.num_layers <= 0 || c.hidden_size <= 0 || c.num_query_heads <= 0 || c.num_kv_heads <= 0 ||
      c.ffn_size <= 0 || c.vocab_size <= 0) {
    return Error(ErrorCode::kInvalidArgument, "model config has an empty dimension: {}",
                 c.Summary());
  }
  // Every architecture ModelConfig reads runs here (the forward pass follows its config: post
  // norms, GELU FFN, embedding scale, soft-cap, fused tensors split at load, LongRoPE factors,
  // sliding windows); what remains to check is what the kernels take.
  if (c.num_query_heads % c.num_kv_heads != 0) {
    return Error(ErrorCode::kUnsupported, "{} query heads are not a multiple of {} KV heads",
                 c.num_query_heads, c.num_kv_heads);
  }
  const int group = c.num_query_heads / c.num_kv_heads;
  if (!DecodeAttentionSupports(c.head_dim, group) || !PrefillAttentionSupports(c.head_dim)) {
    return Error(ErrorCode::kUnsupported,
                 "the CUDA attention kernels support head_dim 16, 32, 64, 96, 128 or 256 with at "
                 "most {} query heads per KV head; this '{}' model has head_dim {} and {} (use "
                 "--device cpu)",
                 kDecodeMaxGroup, c.architecture, c.head_dim, group);
  }
  if (c.qk_norm && !QkvRopeNormSupports(c.head_dim)) {
    return Error(ErrorCode::kUnsupported,
                 "the CUDA QK norm does not support head_dim {} (this '{}' model normalises its "
                 "query and key heads; use --device cpu)",
                 c.head_dim, c.architecture);
  }
  if (c.sliding_window > std::numeric_limits<int>::max()) {
    return Error(ErrorCode::kUnsupported, "sliding window of {} tokens", c.sliding_window);
  }
  if (c.rope.rotary_dim % 2 != 0 || c.rope.rotary_dim > c.head_dim) {
    return Error(ErrorCode::kUnsupported, "rotary dim {} with head_dim {}", c.rope.rotary_dim,
                 c.head_dim);
  }
  if (c.vocab_size > (1ll << 30)) {
    return Error(ErrorCode::kUnsupported, "vocabulary of {} tokens", c.vocab_size);
  }
  if (o.max_batch < 1 || o.max_batch > 1024 || o.max_step_tokens < o.max_batch ||
      o.max_step_tokens > (1 << 20)) {
    return Error(ErrorCode::kInvalidArgument,
                 "max_batch {} must be in [1, 1024] and max_step_tokens {} in [max_batch, 2^20]",
                 o.max_batch, o.max_step_tokens);
  }
  return Status::Ok();
}

// Host memory that CUDA can copy to and from asynchronously.
Result<void*> PinnedAlloc(int64_t bytes) {
  void* pointer = nullptr;
  SKV_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pointer, static_cast<size_t>(bytes), cudaHostAllocDefault));
  return pointer;
}

Status UploadFloats(const std::vector<float>& values, float* dest) {
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(dest, values.data(), values.size() * sizeof(float),
                                      cudaMemcpyHostToDevice));
  return Status::Ok();
}

// A GGUF matrix stored as [in, out] (row length `in`), i.e. a linear layer's [out, in] weight.
Result<const gguf::TensorInfo*> FindMatrix(const gguf::GgufFile& file, const std::string& name,
                                           int64_t in, int64_t out) {
  const gguf::TensorInfo* t = file.FindTensor(name);
  if (!t) return Error(ErrorCode::kNotFound, "tensor '{}' is missing from {}", name, file.path());
  if (t->shape != std::vector<int64_t>{in, out}) {
    return Error(ErrorCode::kCorrupt, "tensor '{}' has shape [{}], expected [{}, {}]", name,
                 fmt::join(t->shape, ", "), in, out);
  }
  if (!gguf::CanDequantize(t->type)) {
    return Error(ErrorCode::kUnsupported, "tensor '{}' has type {}, which cannot be dequantised",
                 name, gguf::TypeName(t->type));
  }
  return t;
}

Result<std::vector<float>> LoadVector(const gguf::GgufFile& file, const std::string& name,
                                      int64_t size) {
  const gguf::TensorInfo* t = file.FindTensor(name);
  if (!t) return Error(ErrorCode::kNotFound, "tensor '{}' is missing from {}", name, file.path());
  if (t->shape != std::vector<int64_t>{size}) {
    return Error(ErrorCode::kCorrupt, "tensor '{}' has shape [{}], expected [{}]", name,
                 fmt::join(t->shape, ", "), size);
  }
  return gguf::DequantizeTensor(*t);
}

// Dequantises rows [rows.begin, rows.end) of `t`, keeps columns [cols.begin, cols.end) of each
// (a tensor-parallel shard's slice; everything for one GPU) and writes them to `dest` as a dense
// bf16 [rows.count, cols.count] matrix, a few MiB at a time.
Status UploadSlice(const gguf::TensorInfo& t, IndexRange rows, IndexRange cols, Bf16* dest) {
  const int64_t row_length = t.row_length();
  if (rows.begin < 0 || rows.end() > t.rows() || cols.begin < 0 || cols.end() > row_length) {
    return Error(ErrorCode::kInternal, "slice [{}, {}) x [{}, {}) outside tensor '{}'",
                 rows.begin, rows.end(), cols.begin, cols.end(), t.name);
  }
  const int64_t block_rows = std::max<int64_t>(1, (int64_t{1} << 22) / row_length);
  std::vector<float> values(static_cast<size_t>(std::min(rows.count, block_rows) * row_length));
  std::vector<uint16_t> halves(static_cast<size_t>(std::min(rows.count, block_rows) * cols.count));
  for (int64_t done = 0; done < rows.count; done += block_rows) {
    const int64_t count = std::min(block_rows, rows.count - done);
    SKV_RETURN_IF_ERROR(gguf::DequantizeRows(t, rows.begin + done, count, values.data()));
    for (int64_t r = 0; r < count; ++r) {
      const float* source = values.data() + r * row_length + cols.begin;
      uint16_t* target = halves.data() + r * cols.count;
      for (int64_t c = 0; c < cols.count; ++c) target[c] = Fp32ToBf16(source[c]);
    }
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(dest + done * cols.count, halves.data(),
                                        count * cols.count * sizeof(uint16_t),
                                        cudaMemcpyHostToDevice));
  }
  return Status::Ok();
}

Status UploadMatrix(const gguf::TensorInfo& t, Bf16* dest) {
  return UploadSlice(t, {0, t.rows()}, {0, t.row_length()}, dest);
}

// Under tensor parallelism: checks the communicator and makes `impl` the rank's shard of
// `full` (its shapes in impl->config). Otherwise the whole model.
Status SetUpShard(CudaModel::Impl& impl, const ModelConfig& full) {
  const tp::Communicator* comm = impl.options.communicator;
  const int size = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
  SKV_ASSIGN_OR_RETURN(impl.shard, MakeShard(full, size, rank));
  impl.config = ShardConfig(full, impl.shard);
  if (comm) {
    int device = -1;
    SKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    if (device != comm->device()) {
      return Error(ErrorCode::kInternal, "tensor-parallel rank {} loads on GPU {}, but its "
                   "communicator is on GPU {}", rank, device, comm->device());
    }
  }
  return Status::Ok();
}

// Rows `rows` x columns `cols` of the random [*, full_cols] matrix of `seed` into `dest`
// (dense): a shard's slice of a synthetic weight, the same values the whole model has there.
Status FillRandomWindow(Bf16* dest, IndexRange rows, IndexRange cols, int64_t full_cols,
                        float scale, uint64_t seed, cudaStream_t stream) {
  FillRandomParams p;
  p.out = dest;
  p.count = rows.count * cols.count;
  p.scale = scale;
  p.seed = seed;
  p.row_length = cols.count;
  p.full_row_length = full_cols;
  p.first_row = rows.begin;
  p.first_col = cols.begin;
  SKV_CUDA_RETURN_IF_ERROR(LaunchFillRandom(p, stream));
  return Status::Ok();
}

Status FillRandom(DeviceBuffer<Bf16>& buffer, float scale, uint64_t seed, cudaStream_t stream) {
  FillRandomParams p;
  p.out = buffer.get();
  p.count = buffer.size();
  p.scale = scale;
  p.seed = seed;
  SKV_CUDA_RETURN_IF_ERROR(LaunchFillRandom(p, stream));
  return Status::Ok();
}

}  // namespace

StepProfiler::~StepProfiler() {
  for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
}

Status StepProfiler::Mark(OpKind kind, cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  SKV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&event));
  events_.push_back(event);
  kinds_.push_back(kind);
  SKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(event, stream));
  return Status::Ok();
}

Result<StepBreakdown> StepProfiler::Collect() {
  StepBreakdown b;
  if (events_.size() < 2) return b;
  SKV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_.back()));
  for (size_t i = 1; i < events_.size(); ++i) {
    float ms = 0.0f;
    SKV_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
    b.total_ms += ms;
    switch (kinds_[i]) {
      case OpKind::kGemm: b.gemm_ms += ms; break;
      case OpKind::kAttention: b.attention_ms += ms; break;
      case OpKind::kOther: b.other_ms += ms; break;
      case OpKind::kSkvScoring: b.scoring_ms += ms; break;
      case OpKind::kSkvRebuild: b.rebuild_ms += ms; break;
      case OpKind::kSkvFetch: b.fetch_ms += ms; break;
      case OpKind::kSkvGraduate: b.graduate_ms += ms; break;
      case OpKind::kAllReduce: b.allreduce_ms += ms; break;
    }
  }
  return b;
}

CudaModel::Impl::~Impl() {
  DropGraphs();
  skv.reset();
  if (cublas) (void)cublasDestroy(cublas);
  if (stream) (void)cudaStreamDestroy(stream);
  if (host_meta_block) (void)cudaFreeHost(host_meta_block);
  if (host_logits) (void)cudaFreeHost(host_logits);
}

void CudaModel::Impl::DropGraphs() {
  for (auto& [batch, exec] : graphs) (void)cudaGraphExecDestroy(exec);
  graphs.clear();
}

Status CudaModel::Impl::Init() {
  const ModelConfig& c = config;
  q_width = c.num_query_heads * c.head_dim;
  kv_width = c.num_kv_heads * c.head_dim;
  qkv_width = q_width + 2 * kv_width;
  max_rows = options.max_step_tokens;
  int multiprocessors = 0, device = 0;
  SKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));  // a tensor-parallel rank's own GPU
  SKV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  // About 8 decode-attention blocks per multiprocessor: a few waves, a small tail.
  target_blocks = 8 * multiprocessors;

  SKV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  SKV_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas));
  SKV_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas, stream));
  // A workspace of our own keeps cuBLAS from allocating while a graph is being captured.
  SKV_RETURN_IF_ERROR(cublas_workspace.Allocate(kCublasWorkspaceBytes));
  SKV_CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(cublas, cublas_workspace.get(), cublas_workspace.bytes()));

  const int64_t rows = max_rows, batch = options.max_batch;
  SKV_RETURN_IF_ERROR(x.Allocate(rows * c.hidden_size));
  SKV_RETURN_IF_ERROR(xn.Allocate(rows * c.hidden_size));
  SKV_RETURN_IF_ERROR(qkv.Allocate(rows * qkv_width));
  SKV_RETURN_IF_ERROR(q.Allocate(rows * q_width));
  SKV_RETURN_IF_ERROR(attn.Allocate(rows * q_width));
  SKV_RETURN_IF_ERROR(proj.Allocate(rows * c.hidden_size));
  SKV_RETURN_IF_ERROR(gate_up.Allocate(rows * 2 * c.ffn_size));
  SKV_RETURN_IF_ERROR(act.Allocate(rows * c.ffn_size));
  SKV_RETURN_IF_ERROR(logits.Allocate(batch * c.vocab_size));
  SKV_RETURN_IF_ERROR(
      partial_out.Allocate(batch * c.num_query_heads * kDecodeMaxSplits * c.head_dim));
  SKV_RETURN_IF_ERROR(partial_lse.Allocate(batch * c.num_query_heads * kDecodeMaxSplits));
  if (options.communicator) {
    SKV_RETURN_IF_ERROR(options.communicator->Reserve(proj.bytes()));
  }

  // Metadata block: fixed offsets, 16-byte aligned, identical on both sides.
  int64_t offset = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = offset;
    offset += (bytes + 15) / 16 * 16;
    return at;
  };
  const int64_t at_tokens = take(rows * 4), at_slots = take(rows * 4),
                at_positions = take(rows * 4), at_logit_rows = take(batch * 4),
                at_sequences = take(batch * sizeof(PrefillSequence)),
                at_controls = take(batch * sizeof(SamplingControl)), at_next = take(batch * 4);
  meta_bytes = offset;
  SKV_RETURN_IF_ERROR(meta_block.Allocate(meta_bytes));
  SKV_ASSIGN_OR_RETURN(void* host_block, PinnedAlloc(meta_bytes));
  host_meta_block = static_cast<uint8_t*>(host_block);
  std::fill_n(host_meta_block, meta_bytes, 0);
  auto point = [&](uint8_t* base, StepMeta& m) {
    m.tokens = reinterpret_cast<int32_t*>(base + at_tokens);
    m.slots = reinterpret_cast<int32_t*>(base + at_slots);
    m.positions = reinterpret_cast<int32_t*>(base + at_positions);
    m.logit_rows = reinterpret_cast<int32_t*>(base + at_logit_rows);
    m.sequences = reinterpret_cast<PrefillSequence*>(base + at_sequences);
    m.controls = reinterpret_cast<SamplingControl*>(base + at_controls);
    m.next_tokens = reinterpret_cast<int32_t*>(base + at_next);
  };
  point(meta_block.get(), meta);
  point(host_meta_block, host_meta);
  SKV_ASSIGN_OR_RETURN(void* host_logit_block, PinnedAlloc(batch * c.vocab_size * 4));
  host_logits = static_cast<float*>(host_logit_block);

  // RoPE inverse frequencies: the CPU Rope's own (llama3 and LongRoPE factors and linear scaling
  // folded in), and the sliding layers' where any layer slides (gemma3's local base).
  auto upload_frequencies = [](const RopeConfig& rope, DeviceBuffer<float>& dest) -> Status {
    const Rope rotation(rope);
    const std::vector<float>& frequencies = rotation.inverse_frequencies();
    SKV_RETURN_IF_ERROR(dest.Allocate(std::max<int64_t>(1, frequencies.size())));
    if (!frequencies.empty()) SKV_RETURN_IF_ERROR(UploadFloats(frequencies, dest.get()));
    return Status::Ok();
  };
  SKV_RETURN_IF_ERROR(upload_frequencies(c.rope, inv_freq));
  if (!c.layer_windowed.empty()) {
    SKV_RETURN_IF_ERROR(upload_frequencies(c.rope_windowed, inv_freq_windowed));
  }
  return Status::Ok();
}

Status CudaModel::Impl::AllocateWeights() {
  const ModelConfig& c = config;
  const int64_t hidden = c.hidden_size, ffn = c.ffn_size;
  layers.resize(c.num_layers);
  for (DeviceLayer& l : layers) {
    SKV_RETURN_IF_ERROR(l.qkv.Allocate(qkv_width * hidden));
    if (c.qkv_bias) SKV_RETURN_IF_ERROR(l.qkv_bias.Allocate(qkv_width));
    SKV_RETURN_IF_ERROR(l.o.Allocate(hidden * q_width));
    SKV_RETURN_IF_ERROR(l.gate_up.Allocate(2 * ffn * hidden));
    SKV_RETURN_IF_ERROR(l.down.Allocate(hidden * ffn));
    SKV_RETURN_IF_ERROR(l.attn_norm.Allocate(hidden));
    SKV_RETURN_IF_ERROR(l.ffn_norm.Allocate(hidden));
    if (c.qk_norm) {
      SKV_RETURN_IF_ERROR(l.q_norm.Allocate(c.head_dim));
      SKV_RETURN_IF_ERROR(l.k_norm.Allocate(c.head_dim));
    }
    if (c.post_norms) {
      SKV_RETURN_IF_ERROR(l.post_attn_norm.Allocate(hidden));
      SKV_RETURN_IF_ERROR(l.post_ffn_norm.Allocate(hidden));
    }
  }
  SKV_RETURN_IF_ERROR(token_embd.Allocate(c.vocab_size * hidden));
  if (c.tied_embeddings) {
    output = token_embd.get();
  } else {
    SKV_RETURN_IF_ERROR(output_own.Allocate(c.vocab_size * hidden));
    output = output_own.get();
  }
  SKV_RETURN_IF_ERROR(output_norm.Allocate(hidden));
  return Status::Ok();
}

int64_t CudaModel::Impl::DecodeWeightBytes() const {
  int64_t total = config.vocab_size * config.hidden_size * 2 + output_norm.bytes();
  for (const DeviceLayer& l : layers) total += l.Bytes();
  return total;
}

int64_t CudaModel::Impl::ActivationBytes() const {
  return x.bytes() + xn.bytes() + qkv.bytes() + q.bytes() + attn.bytes() + proj.bytes() +
         gate_up.bytes() + act.bytes() + logits.bytes() + partial_out.bytes() +
         partial_lse.bytes() + meta_block.bytes() + cublas_workspace.bytes();
}

namespace {

// A variant the decode step does not know is refused at load rather than run as another one.
Status CheckKernelOptions(const CudaKernelOptions& k) {
  if (k.shadowkv_kernels == kSkvKernelsFirst || k.shadowkv_kernels == kSkvKernelsFast) {
    return Status::Ok();
  }
  return Error(ErrorCode::kInvalidArgument,
               "ShadowKV kernels variant {} does not exist (0: the first kernels, 1: the fast "
               "ones, the default)", k.shadowkv_kernels);
}

}  // namespace

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::~CudaModel() = default;

Result<std::unique_ptr<CudaModel>> CudaModel::Load(const std::string& path,
                                                   const CudaModelOptions& options) {
  SKV_RETURN_IF_ERROR(CheckKernelOptions(options.kernels));
  std::string why;
  if (!CudaAvailable(&why)) return Error(ErrorCode::kUnsupported, "no usable CUDA GPU: {}", why);
  SKV_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file, gguf::GgufFile::Open(path));
  auto impl = std::make_unique<Impl>();
  SKV_ASSIGN_OR_RETURN(const ModelConfig full, ModelConfig::FromGguf(*file));
  impl->options = options;
  SKV_RETURN_IF_ERROR(CheckSupported(full, options));
  SKV_RETURN_IF_ERROR(SetUpShard(*impl, full));
  SKV_RETURN_IF_ERROR(impl->Init());
  SKV_RETURN_IF_ERROR(impl->AllocateWeights());

  // Shapes of the file's tensors (the whole model); the shard takes its rows or columns.
  const ModelConfig& c = full;
  const int64_t hidden = c.hidden_size, ffn = c.ffn_size;
  const int64_t q_width = static_cast<int64_t>(c.num_query_heads) * c.head_dim;
  const int64_t kv_width = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const TensorParallelShard& shard = impl->shard;
  const IndexRange q_rows = shard.QueryRows(c.head_dim), kv_rows = shard.KvRows(c.head_dim);
  const IndexRange ffn_rows = shard.FfnRows(), all_hidden{0, hidden};
  const int64_t local_q = q_rows.count, local_kv = kv_rows.count, local_ffn = ffn_rows.count;
  auto shifted = [](IndexRange r, int64_t by) { return IndexRange{r.begin + by, r.count}; };
  // Rows of a fused [q | k | v] tensor (phi3's and chatglm's attn_qkv, chatglm's with its bias)
  // and of a fused [gate | up] one (phi3's, glm4's and chatglm's ffn_up) that this shard holds:
  // each part's own rows, as the CPU splits them.
  const int64_t fused_qkv = q_width + 2 * kv_width;
  const IndexRange fused_k_rows = shifted(kv_rows, q_width);
  const IndexRange fused_v_rows = shifted(kv_rows, q_width + kv_width);
  SKV_ASSIGN_OR_RETURN(const gguf::TensorInfo* embd,
                       FindMatrix(*file, "token_embd.weight", hidden, c.vocab_size));
  SKV_RETURN_IF_ERROR(UploadMatrix(*embd, impl->token_embd.get()));
  if (!c.tied_embeddings) {
    SKV_ASSIGN_OR_RETURN(const gguf::TensorInfo* out,
                         FindMatrix(*file, "output.weight", hidden, c.vocab_size));
    SKV_RETURN_IF_ERROR(UploadMatrix(*out, impl->output_own.get()));
  }
  SKV_ASSIGN_OR_RETURN(std::vector<float> output_norm,
                       LoadVector(*file, "output_norm.weight", hidden));
  SKV_RETURN_IF_ERROR(UploadFloats(output_norm, impl->output_norm.get()));

  for (int layer = 0; layer < c.num_layers; ++layer) {
    DeviceLayer& l = impl->layers[layer];
    const std::string p = fmt::format("blk.{}.", layer);
    // A matrix [out, in] of the file; the shard's rows (output units) and columns (inputs).
    auto upload = [&](const std::string& name, int64_t in, int64_t out, IndexRange rows,
                      IndexRange cols, Bf16* dest) -> Status {
      SKV_ASSIGN_OR_RETURN(const gguf::TensorInfo* t, FindMatrix(*file, p + name, in, out));
      return UploadSlice(*t, rows, cols, dest);
    };
    Bf16* qkv = l.qkv.get();
    Bf16* k_dest = qkv + local_q * hidden;
    Bf16* v_dest = qkv + (local_q + local_kv) * hidden;
    if (c.fused_qkv) {
      SKV_RETURN_IF_ERROR(upload("attn_qkv.weight", hidden, fused_qkv, q_rows, all_hidden, qkv));
      SKV_RETURN_IF_ERROR(
          upload("attn_qkv.weight", hidden, fused_qkv, fused_k_rows, all_hidden, k_dest));
      SKV_RETURN_IF_ERROR(
          upload("attn_qkv.weight", hidden, fused_qkv, fused_v_rows, all_hidden, v_dest));
    } else {
      SKV_RETURN_IF_ERROR(upload("attn_q.weight", hidden, q_width, q_rows, all_hidden, qkv));
      SKV_RETURN_IF_ERROR(upload("attn_k.weight", hidden, kv_width, kv_rows, all_hidden, k_dest));
      SKV_RETURN_IF_ERROR(upload("attn_v.weight", hidden, kv_width, kv_rows, all_hidden, v_dest));
    }
    SKV_RETURN_IF_ERROR(
        upload("attn_output.weight", q_width, hidden, all_hidden, q_rows, l.o.get()));
    Bf16* up_dest = l.gate_up.get() + local_ffn * hidden;
    if (c.fused_gate_up) {
      SKV_RETURN_IF_ERROR(
          upload("ffn_up.weight", hidden, 2 * ffn, ffn_rows, all_hidden, l.gate_up.get()));
      SKV_RETURN_IF_ERROR(
          upload("ffn_up.weight", hidden, 2 * ffn, shifted(ffn_rows, ffn), all_hidden, up_dest));
    } else {
      SKV_RETURN_IF_ERROR(
          upload("ffn_gate.weight", hidden, ffn, ffn_rows, all_hidden, l.gate_up.get()));
      SKV_RETURN_IF_ERROR(upload("ffn_up.weight", hidden, ffn, ffn_rows, all_hidden, up_dest));
    }
    SKV_RETURN_IF_ERROR(
        upload("ffn_down.weight", ffn, hidden, all_hidden, ffn_rows, l.down.get()));
    SKV_ASSIGN_OR_RETURN(std::vector<float> attn_norm,
                         LoadVector(*file, p + "attn_norm.weight", hidden));
    SKV_RETURN_IF_ERROR(UploadFloats(attn_norm, l.attn_norm.get()));
    SKV_ASSIGN_OR_RETURN(std::vector<float> ffn_norm, LoadVector(*file, p + "ffn_norm.weight", hidden));
    SKV_RETURN_IF_ERROR(UploadFloats(ffn_norm, l.ffn_norm.get()));
    if (c.qk_norm) {  // per head, the same on every tensor-parallel rank
      SKV_ASSIGN_OR_RETURN(std::vector<float> q_norm,
                           LoadVector(*file, p + "attn_q_norm.weight", c.head_dim));
      SKV_RETURN_IF_ERROR(UploadFloats(q_norm, l.q_norm.get()));
      SKV_ASSIGN_OR_RETURN(std::vector<float> k_norm,
                           LoadVector(*file, p + "attn_k_norm.weight", c.head_dim));
      SKV_RETURN_IF_ERROR(UploadFloats(k_norm, l.k_norm.get()));
    }
    if (c.post_norms) {  // of whole hidden rows, after the all-reduce: the same on every rank
      SKV_ASSIGN_OR_RETURN(std::vector<float> post_attn,
                           LoadVector(*file, p + "post_attention_norm.weight", hidden));
      SKV_RETURN_IF_ERROR(UploadFloats(post_attn, l.post_attn_norm.get()));
      SKV_ASSIGN_OR_RETURN(std::vector<float> post_ffn,
                           LoadVector(*file, p + "post_ffw_norm.weight", hidden));
      SKV_RETURN_IF_ERROR(UploadFloats(post_ffn, l.post_ffn_norm.get()));
    }
    if (c.qkv_bias) {
      std::vector<float> bias;
      if (c.fused_qkv) {
        SKV_ASSIGN_OR_RETURN(std::vector<float> all,
                             LoadVector(*file, p + "attn_qkv.bias", fused_qkv));
        for (IndexRange range : {q_rows, fused_k_rows, fused_v_rows}) {
          bias.insert(bias.end(), all.begin() + range.begin, all.begin() + range.end());
        }
      } else {
        for (auto [name, size, range] : {std::tuple{"attn_q.bias", q_width, q_rows},
                                         std::tuple{"attn_k.bias", kv_width, kv_rows},
                                         std::tuple{"attn_v.bias", kv_width, kv_rows}}) {
          SKV_ASSIGN_OR_RETURN(std::vector<float> part, LoadVector(*file, p + name, size));
          bias.insert(bias.end(), part.begin() + range.begin, part.begin() + range.end());
        }
      }
      SKV_RETURN_IF_ERROR(UploadFloats(bias, l.qkv_bias.get()));
    }
  }
  // cudaMemcpy from pageable memory may return before its DMA lands, and the model's own stream
  // does not wait for the legacy stream: settle every upload before the first step.
  SKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

Result<std::unique_ptr<CudaModel>> CudaModel::CreateSynthetic(const ModelConfig& config,
                                                              uint64_t seed,
                                                              const CudaModelOptions& options) {
  SKV_RETURN_IF_ERROR(CheckKernelOptions(options.kernels));
  std::string why;
  if (!CudaAvailable(&why)) return Error(ErrorCode::kUnsupported, "no usable CUDA GPU: {}", why);
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->synthetic = true;
  SKV_RETURN_IF_ERROR(CheckSupported(config, options));
  SKV_RETURN_IF_ERROR(SetUpShard(*impl, config));
  SKV_RETURN_IF_ERROR(impl->Init());
  SKV_RETURN_IF_ERROR(impl->AllocateWeights());

  // Uniform values with variance 1/fan_in keep activations of unit size through the layers.
  const ModelConfig& c = impl->config;
  auto scale_for = [](int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  uint64_t stream_id = seed * 0x2545f4914f6cdd1dull;
  auto next_seed = [&] { return stream_id += 0x9e3779b97f4a7c15ull; };
  cudaStream_t s = impl->stream;
  SKV_RETURN_IF_ERROR(FillRandom(impl->token_embd, 1.0f, next_seed(), s));
  if (!c.tied_embeddings) {
    SKV_RETURN_IF_ERROR(FillRandom(impl->output_own, scale_for(c.hidden_size), next_seed(), s));
  }
  const std::vector<float> ones(c.hidden_size, 1.0f);
  SKV_RETURN_IF_ERROR(UploadFloats(ones, impl->output_norm.get()));
  // Each matrix is drawn as the whole model's [out, in] matrix would be; a tensor-parallel rank
  // takes its rows or columns of it (the same values: a split synthetic model is the same model).
  const TensorParallelShard& shard = impl->shard;
  const int64_t hidden = config.hidden_size, ffn = config.ffn_size;
  const int64_t q_width = static_cast<int64_t>(config.num_query_heads) * config.head_dim;
  const int64_t kv_width = static_cast<int64_t>(config.num_kv_heads) * config.head_dim;
  const IndexRange q_rows = shard.QueryRows(config.head_dim);
  const IndexRange kv_rows = shard.KvRows(config.head_dim);
  const IndexRange ffn_rows = shard.FfnRows(), all_hidden{0, hidden};
  auto shifted = [](IndexRange r, int64_t by) { return IndexRange{r.begin + by, r.count}; };
  for (DeviceLayer& l : impl->layers) {
    const uint64_t qkv_seed = next_seed(), o_seed = next_seed(), gate_up_seed = next_seed(),
                   down_seed = next_seed();
    const float in_hidden = scale_for(hidden);
    Bf16* qkv = l.qkv.get();
    SKV_RETURN_IF_ERROR(FillRandomWindow(qkv, q_rows, all_hidden, hidden, in_hidden, qkv_seed, s));
    SKV_RETURN_IF_ERROR(FillRandomWindow(qkv + q_rows.count * hidden, shifted(kv_rows, q_width),
                                         all_hidden, hidden, in_hidden, qkv_seed, s));
    SKV_RETURN_IF_ERROR(FillRandomWindow(qkv + (q_rows.count + kv_rows.count) * hidden,
                                         shifted(kv_rows, q_width + kv_width), all_hidden, hidden,
                                         in_hidden, qkv_seed, s));
    // Fan-ins of the whole model: the ranks' partial products add up to one product.
    SKV_RETURN_IF_ERROR(FillRandomWindow(l.o.get(), all_hidden, q_rows, q_width,
                                         scale_for(q_width), o_seed, s));
    SKV_RETURN_IF_ERROR(FillRandomWindow(l.gate_up.get(), ffn_rows, all_hidden, hidden, in_hidden,
                                         gate_up_seed, s));
    SKV_RETURN_IF_ERROR(FillRandomWindow(l.gate_up.get() + ffn_rows.count * hidden,
                                         shifted(ffn_rows, ffn), all_hidden, hidden, in_hidden,
                                         gate_up_seed, s));
    SKV_RETURN_IF_ERROR(FillRandomWindow(l.down.get(), all_hidden, ffn_rows, ffn,
                                         scale_for(ffn), down_seed, s));
    SKV_RETURN_IF_ERROR(UploadFloats(ones, l.attn_norm.get()));
    SKV_RETURN_IF_ERROR(UploadFloats(ones, l.ffn_norm.get()));
    if (l.post_attn_norm.size() > 0) {
      SKV_RETURN_IF_ERROR(UploadFloats(ones, l.post_attn_norm.get()));
      SKV_RETURN_IF_ERROR(UploadFloats(ones, l.post_ffn_norm.get()));
    }
    if (l.q_norm.size() > 0) {
      const std::vector<float> head_ones(c.head_dim, 1.0f);
      SKV_RETURN_IF_ERROR(UploadFloats(head_ones, l.q_norm.get()));
      SKV_RETURN_IF_ERROR(UploadFloats(head_ones, l.k_norm.get()));
    }
    if (l.qkv_bias.size() > 0) {
      SKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(l.qkv_bias.get(), 0, l.qkv_bias.bytes(), s));
    }
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the fills and the uploads alike
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

const ModelConfig& CudaModel::config() const { return impl_->config; }
const CudaModelOptions& CudaModel::options() const { return impl_->options; }
bool CudaModel::synthetic() const { return impl_->synthetic; }

int64_t CudaModel::weight_bytes() const {
  const Impl& m = *impl_;
  int64_t total = m.token_embd.bytes() + m.output_own.bytes() + m.output_norm.bytes();
  for (const DeviceLayer& l : m.layers) total += l.Bytes();
  return total;
}

int64_t CudaModel::decode_weight_bytes() const { return impl_->DecodeWeightBytes(); }
int64_t CudaModel::activation_bytes() const { return impl_->ActivationBytes(); }

}  // namespace shadowkv::cuda
