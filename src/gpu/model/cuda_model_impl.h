// CudaModel's state: device weights, step buffers, the KV cache, stream, cuBLAS and graphs.
// Internal to the CUDA backend.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "gpu/model/cuda_model.h"
#include "gpu/model/shadowkv_plan.h"
#include "model/tensor_parallel.h"
#include "ops/cuda/attention/prefill_attention.cuh"
#include "ops/cuda/common/device_buffer.h"
#include "ops/cuda/common/kv_cache_view.cuh"
#include "ops/cuda/gemm/gemm.h"
#include "ops/cuda/linalg/symmetric_eigen.h"
#include "ops/cuda/sampling/sampling.cuh"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {

using Bf16 = __nv_bfloat16;

struct DeviceLayer {
  DeviceBuffer<Bf16> qkv;       // [q_width + 2 * kv_width, hidden]: q rows, then k, then v
  DeviceBuffer<float> qkv_bias;  // [q_width + 2 * kv_width] (qwen2, glm4, chatglm) or empty
  DeviceBuffer<Bf16> o;         // [hidden, q_width]
  DeviceBuffer<Bf16> gate_up;   // [2 * ffn, hidden]: gate rows, then up rows
  DeviceBuffer<Bf16> down;      // [hidden, ffn]
  DeviceBuffer<float> attn_norm;  // [hidden]
  DeviceBuffer<float> ffn_norm;   // [hidden]
  DeviceBuffer<float> q_norm;     // [head_dim] per-head norm of Q (qk_norm models) or empty
  DeviceBuffer<float> k_norm;     // [head_dim]
  // [hidden] norms of the attention and FFN outputs before they join the residual stream
  // (post_norms models: gemma3, glm4), else empty.
  DeviceBuffer<float> post_attn_norm;
  DeviceBuffer<float> post_ffn_norm;

  int64_t Bytes() const {
    return qkv.bytes() + qkv_bias.bytes() + o.bytes() + gate_up.bytes() + down.bytes() +
           attn_norm.bytes() + ffn_norm.bytes() + q_norm.bytes() + k_norm.bytes() +
           post_attn_norm.bytes() + post_ffn_norm.bytes();
  }
};

// Per-step metadata, mirrored in pinned host memory and uploaded as one block before each step
// (a replayed graph reads the fresh values from the same addresses).
struct StepMeta {
  int32_t* tokens = nullptr;     // [max_rows] token of each row
  int32_t* slots = nullptr;      // [max_rows] slot of each row
  int32_t* positions = nullptr;  // [max_rows] position of each row
  int32_t* logit_rows = nullptr;  // [max_batch] rows whose logits are wanted
  PrefillSequence* sequences = nullptr;  // [max_batch] prefill chunks
  SamplingControl* controls = nullptr;   // [max_batch] each logit row's sampling settings
  int32_t* next_tokens = nullptr;        // [max_batch] written by the sampler
};

// What one step runs; decode rows come first, then the prefill chunks' rows.
struct StepPlan {
  int rows = 0;
  int decode_rows = 0;
  int num_prefill = 0;
  int max_prefill_queries = 0;
  int logit_rows = 0;
  bool sample = false;
  bool shadowkv = false;  // decode rows over ShadowKV sequences (slots are sequence indices)
  // ShadowKV: some row graduates a chunk at this step (else the graduation kernels, which
  // would do nothing, are left out; such steps replay a graph of their own).
  bool skv_graduates = true;
};

enum class OpKind {
  kGemm, kAttention, kOther, kSkvScoring, kSkvRebuild, kSkvFetch, kSkvGraduate, kAllReduce
};

// ShadowKV sequences on the device (see shadowkv_kernels.cuh for the layout).
struct ShadowKvState {
  kv::KvPolicyConfig config;
  SkvGeometry geometry;
  SkvLayout layout;  // device pointers into the buffers below
  int num_sequences = 0;
  DeviceBuffer<Bf16> attn_keys, attn_values, keys_pre, coefficients, basis, landmarks;
  DeviceBuffer<uint8_t> landmark_codes;  // FP8 landmarks instead of `landmarks`
  DeviceBuffer<float> landmark_scales;
  DeviceBuffer<uint8_t> outlier;
  DeviceBuffer<int32_t> slot_chunk;
  DeviceBuffer<float> slot_log_weight;  // select_sample only (SkvLayout::slot_log_weight)
  DeviceBuffer<int32_t> layer_rank;  // [seq, layer] each layer's own rank (SkvLayout::layer_rank)
  // select_drift only (SkvLayout::drift_step, drift_queries); empty without it.
  DeviceBuffer<int32_t> drift_step;
  DeviceBuffer<float> drift_queries;
  DeviceBuffer<SkvSequenceInfo> info;
  DeviceBuffer<Bf16*> value_table;
  DeviceBuffer<unsigned long long> counters;
  // Sliding-window models: which part each model layer is in, and the windowed layers' rings
  // ([seq, window layers, kv heads, window_rows, head_dim] K and V; `window` views them, a
  // sequence's slot being its index). Empty where no layer slides.
  SkvLayerParts parts;
  DeviceBuffer<Bf16> window_keys, window_values;
  KvCacheView window;
  std::vector<DeviceBuffer<Bf16>> device_values;  // [seq], empty where on the host
  std::vector<Bf16*> host_values;                 // [seq] pinned, or null
  std::vector<Bf16*> value_pointers;              // [seq] what value_table holds
  // [seq] AllocateShadowKvKeys: pinned host copies of the compressed prompt's exact pre-RoPE
  // keys, [layers, capacity_chunks * C, kv_width] (null: none), and the rows they hold.
  std::vector<Bf16*> host_keys;
  std::vector<int64_t> host_key_rows;
  std::vector<SkvSequenceInfo> host_info;         // [seq]
  std::vector<int64_t> lengths;                   // [seq] tokens held, 0 = not compressed
  std::vector<int64_t> exact_first0;              // [seq] first exact position after compression
  // The basis fit on the GPU (CudaKernelOptions::basis_gpu_max_width): every layer's Gram
  // matrix solved at once. gram: [layers, kv_width, kv_width] fp32, overwritten by the
  // eigenvectors; eigen_values [layers, kv_width]; eigen_info [layers]. Null / empty: solved on
  // the host.
  std::unique_ptr<BatchedSymmetricEigen> eigen;
  DeviceBuffer<float> gram, eigen_values;
  DeviceBuffer<int32_t> eigen_info;
  // GPU-timeline marks of a compression's phases (timing events).
  std::array<cudaEvent_t, 5> compress_marks{};
  double compress_seconds = 0;
  std::array<double, 4> compress_phase_seconds{};  // CudaShadowKvStats::compress_phase_seconds
  // Step scratch and per-row plans (pinned mirror uploaded before each step).
  DeviceBuffer<float> logits;       // [max_batch, query heads, capacity_chunks]
  DeviceBuffer<float> softmax_partials;  // [max_batch, query heads, SkvScoreBlocks(capacity), 2]
  DeviceBuffer<int32_t> miss_chunk;  // [max_batch, kv heads, max_budget]
  // Re-ranking only (SkvDecodeParams::candidates): [max_batch, kv heads, max_candidates] and
  // [max_batch, query heads, max_candidates].
  DeviceBuffer<int32_t> candidates;
  DeviceBuffer<float> candidate_lse;
  DeviceBuffer<uint8_t> head_keeps;  // select_drift only: [max_batch, kv heads]
  DeviceBuffer<uint8_t> meta_block;
  uint8_t* host_meta_block = nullptr;
  int64_t meta_bytes = 0;
  SkvRowMeta* row_meta = nullptr;  // device [max_batch]
  int32_t* attn_rows = nullptr;    // device [max_batch]
  int32_t* pre_rows = nullptr;     // device [max_batch]
  int32_t* attn_last = nullptr;    // device [max_batch]
  int32_t* window_rows = nullptr;  // device [max_batch] ring row of the new token: p % rows
  int32_t* window_last = nullptr;  // device [max_batch] last ring row it sees: min(p, rows - 1)
  int32_t* gather_first = nullptr;  // device [max_batch] first gather row (the weighted runs')
  cudaStream_t side_stream = nullptr;  // value fetch, beside the key rebuild
  cudaEvent_t fork = nullptr, join = nullptr;
  // The second half of a graph-replayed step's rows (see RunShadowKvAttention): its selection
  // and gathers run on their own streams; start / done join it to the step.
  struct {
    cudaStream_t stream = nullptr, fetch_stream = nullptr;
    cudaEvent_t start = nullptr, fork = nullptr, join = nullptr, done = nullptr;
  } half;
  // Decode step by batch size n, or -n for steps where no row graduates.
  std::map<int, cudaGraphExec_t> graphs;

  ~ShadowKvState();
  void DropGraphs();
};

// The ShadowKV decode step's kernel settings from the model's CudaKernelOptions, each brought
// into its range (shadowkv_decode.cc).
struct SkvDecodeSettings {
  int kernel_variant = kSkvKernelsFast;
  int coarse_select = 1;
  int select_registers = 0;
  bool split_rows = true;
  int split_share = 50;
  int rebuild_slots = 0;
  int stored_key_prefetch = 1;
  int attention_splits = 0;
};
SkvDecodeSettings ShadowKvDecodeSettings(const CudaKernelOptions& options);

// Events between ops of an un-graphed step.
class StepProfiler {
 public:
  ~StepProfiler();
  Status Mark(OpKind kind, cudaStream_t stream);  // the op just issued ends here
  Result<StepBreakdown> Collect();                // after the stream finished
 private:
  std::vector<cudaEvent_t> events_;
  std::vector<OpKind> kinds_;  // kinds_[i]: the op between events_[i] and events_[i + 1]
};

struct CudaModel::Impl {
  ~Impl();

  ModelConfig config;  // the shard's shapes under tensor parallelism
  CudaModelOptions options;
  TensorParallelShard shard;  // the whole model (one rank) unless options.communicator
  bool synthetic = false;
  int q_width = 0, kv_width = 0, qkv_width = 0, max_rows = 0, target_blocks = 0;

  // Weights.
  std::vector<DeviceLayer> layers;
  DeviceBuffer<Bf16> token_embd;  // [vocab, hidden]
  DeviceBuffer<Bf16> output_own;  // [vocab, hidden] when not tied
  const Bf16* output = nullptr;   // output_own or token_embd
  DeviceBuffer<float> output_norm;  // [hidden]
  DeviceBuffer<float> inv_freq;     // [rotary_dim / 2] (core Rope's inverse frequencies)
  // [rotary_dim / 2] the sliding-window layers' own (gemma3's local base), where any layer
  // slides; empty otherwise.
  DeviceBuffer<float> inv_freq_windowed;

  // Step buffers, [max_rows, width] unless noted.
  DeviceBuffer<float> x;         // residual stream
  DeviceBuffer<Bf16> xn;         // normalised rows (GEMM input)
  DeviceBuffer<float> qkv;       // [max_rows, qkv_width]
  DeviceBuffer<Bf16> q;          // [max_rows, q_width]
  DeviceBuffer<Bf16> attn;       // [max_rows, q_width]
  DeviceBuffer<float> proj;      // [max_rows, hidden] o-proj or down-proj output
  DeviceBuffer<Bf16> gate_up;    // [max_rows, 2 * ffn]
  DeviceBuffer<Bf16> act;        // [max_rows, ffn]
  DeviceBuffer<float> logits;    // [max_batch, vocab]
  DeviceBuffer<float> partial_out;  // [max_batch, num_query_heads, kDecodeMaxSplits, head_dim]
  DeviceBuffer<float> partial_lse;  // [max_batch, num_query_heads, kDecodeMaxSplits]
  DeviceBuffer<uint8_t> meta_block;
  StepMeta meta;            // device pointers into meta_block
  StepMeta host_meta;       // the same layout in host_meta_block
  uint8_t* host_meta_block = nullptr;  // pinned
  int64_t meta_bytes = 0;
  float* host_logits = nullptr;  // pinned [max_batch, vocab]

  // KV cache.
  DeviceBuffer<Bf16> kv_keys, kv_values;
  DeviceBuffer<Bf16> kv_keys_pre;  // [slots, layers, capacity, kv_width] or empty
  KvCacheView cache;
  std::vector<int64_t> lengths;  // [num_slots]

  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  DeviceBuffer<uint8_t> cublas_workspace;
  std::map<int, cudaGraphExec_t> graphs;  // decode step by batch size
  uint64_t sample_step = 0;               // draw of the next step that gives every row one setting
  std::unique_ptr<ShadowKvState> skv;     // ShadowKV sequences, when allocated
  // The (GEMM role, rows) pairs this rank has run inside a step (see Gemm).
  std::set<std::pair<int, int64_t>> gemm_shapes;

  Status Init();  // stream, cuBLAS, step buffers (after config/options are set)
  Status AllocateWeights();
  void DropGraphs();
  int64_t DecodeWeightBytes() const;
  int64_t ActivationBytes() const;

  // One GEMM of a step on `stream`. Under tensor parallelism a rank's first GEMM of a shape
  // runs with no collective in flight on any rank: cuBLAS loads that shape's kernels then, the
  // driver's load waits for the device to go idle while holding a lock the other ranks' cuBLAS
  // calls wait for, and a collective of this rank in flight waits for one of them (a stop seen
  // on two H200s: one rank in cuLibraryLoadData, the other on cuBLAS's mutex). So the rank
  // drains its stream (outside graph capture), meets every rank, runs it, and meets them again.
  // `role` names which GEMM of the step this is (the same on every rank): with the row count it
  // fixes the shape, and every rank meets the same (role, rows) pairs in the same order, so
  // they all take this path together.
  Status Gemm(const GemmParams& params, int role);
  // The whole step on `stream`, from the uploaded metadata; profiler may be null.
  Status RunStep(const StepPlan& plan, StepProfiler* profiler);
  Status Upload();  // host_meta_block -> meta_block
  // Runs an uploaded decode step of tokens.size() rows: replays (capturing on first use) the
  // graph for that batch size in `graphs`, or runs it op by op when profiling or graphs are
  // off; the sampled tokens come back in `tokens`, the logits in `logits_out` when not null,
  // and each row's entry of `lengths` (indexed by `ids`, its slot or sequence) grows by one.
  Status ExecuteDecodeStep(const StepPlan& plan, StepProfiler* profiler,
                           std::map<int, cudaGraphExec_t>* graphs, std::span<const int> ids,
                           std::vector<int64_t>& lengths, std::span<int32_t> tokens,
                           float* logits_out);
  Status CheckSlots(std::span<const int> slots) const;
  // Writes `sampling` (one setting per row, each checked) into host_meta.controls.
  Status SetSampling(std::span<const CudaSampling> sampling, int rows);
  // One setting for all `rows`: a seed per row from (seed, row), the draw from sample_step (which
  // advances).
  std::vector<CudaSampling> SameForEveryRow(const CudaSampling& sampling, int rows);
  // The ShadowKV part of one decode layer, after the QKV/RoPE kernel.
  // Every layer's graduation for a ShadowKV step (none where plan.skv_graduates is false).
  Status RunShadowKvGraduation(const StepPlan& plan, StepProfiler* profiler);
  Status RunShadowKvAttention(const StepPlan& plan, int layer, StepProfiler* profiler);
  Status ShadowKvDecodeStepImpl(std::span<const int> seqs, std::span<int32_t> tokens,
                                std::span<const CudaSampling> sampling, float* logits_out,
                                StepProfiler* profiler);
  Status DecodeStepImpl(std::span<const int> slots, std::span<int32_t> tokens,
                        std::span<const CudaSampling> sampling, float* logits_out,
                        StepProfiler* profiler);
};

// The softmax scale of q·k: the config's (gemma3's query_pre_attn_scalar, phi3's LongRoPE
// attention factor folded in), or 1/sqrt(head_dim) for a config that sets none (0, e.g. one made
// in code rather than read from a file).
float AttentionScaleOf(const ModelConfig& config);

// The device form of one row's setting; kInvalidArgument naming `where` when a field is out of
// range (the CPU Sampler's rules).
Result<SamplingControl> ToSamplingControl(const CudaSampling& sampling, const std::string& where);

// Errors unless ShadowKV sequences are allocated / unless `seq` is one of them.
Status NeedShadowKv(const CudaModel::Impl& m);
Status CheckSeq(const ShadowKvState& s, int seq);
// Sequence `seq`'s exact-key copy of compressed layer `layer` (AllocateShadowKvKeys): rows of
// [capacity_chunks * C, kv_width] in pinned host memory, one such block per layer.
int64_t SkvKeptKeyElementsPerLayer(const SkvGeometry& g);
Bf16* SkvKeptKeys(const ShadowKvState& s, int seq, int layer);

}  // namespace shadowkv::cuda
