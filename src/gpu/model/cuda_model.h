// CudaModel: a model of any supported architecture (llama, qwen2, qwen3, gemma3, phi3, glm4,
// chatglm) resident on one GPU (bf16 weights, fp32 accumulation) with a device-side full KV cache:
// chunked prefill, batched decode over sequences of different lengths, and decode steps replayed
// from CUDA graphs. Pure C++ interface (no CUDA types).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kv/kv_config.h"
#include "model/config.h"

namespace shadowkv::cuda {

namespace tp {
class Communicator;
}

// The ShadowKV decode step's kernel variants and tuning (every other op has one kernel per
// architecture). The defaults are the production kernels; the others are kept to compare against
// (ops/cuda/NOTES.md). apps/ sets the variants from SKV_* environment variables and the tuning
// from `shadowkv bench`'s flags (apps/cuda_environment.h).
struct CudaKernelOptions {
  // ShadowKV decode (shadowkv_decode.cc): 0 the first kernels, 1 the fast ones (kSkvKernels*).
  int shadowkv_kernels = 1;
  int coarse_select = 1;     // 0: the four-digit select over every key
  int select_registers = 0;  // 32: the coarse select's 32-register forms (0: 64 registers)
  bool split_rows = true;    // false: one selection for all rows of a step
  int split_share = 50;      // percent of a split step's rows in its first part, 10 to 90
  int rebuild_slots = 0;     // gather slots per rebuild block, 64 or 128 (0: 32)
  // The re-rank's reads of stored exact keys: 1 ahead of the tile a warp multiplies (bf16 by
  // cp.async, two tiles; FP8 codes into registers, one tile, scored as coded); 0 a tile at a
  // time by plain loads, FP8 decoded to bf16.
  int stored_key_prefetch = 1;
  // Split count of the sparse attention, 1 to kDecodeMaxSplits; 0: the full attention's rule
  // for the step's rows (DecodeNumSplits).
  int attention_splits = 0;
  // ShadowKV compression: key widths (kv_heads x head_dim) up to this fit their basis on the GPU
  // (every layer's Gram matrix solved at once, in stream order); wider ones on the host (LAPACK,
  // a thread per layer). 0: always on the host.
  int basis_gpu_max_width = 512;
};

struct CudaModelOptions {
  int max_batch = 16;          // sequences in one Forward or DecodeStep
  int max_step_tokens = 2048;  // tokens in one Forward (prefill chunks plus decode rows)
  bool use_graphs = true;      // DecodeStep replays one captured CUDA graph per batch size
  // Tensor parallelism (set by CudaModelGroup, see docs/TENSOR_PARALLEL.md): with a
  // communicator of size N > 1 this model is its rank's shard (its query and KV heads and FFN
  // units; config() then gives the shard's shapes) and sums its attention-output and FFN-down
  // products with the other ranks'. Not owned; null = the whole model on one GPU.
  tp::Communicator* communicator = nullptr;
  CudaKernelOptions kernels;
};

// How the next token of one row is chosen on the device: the CPU Sampler's semantics
// (engine/sampler.h) and noise, so a request samples alike on either backend up to the logits'
// rounding.
struct CudaSampling {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties)
  int top_k = 0;             // 0: no limit
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  uint64_t seed = 0;
  // Which draw of its sequence this is (0 for the first new token). The noise of a draw is a
  // function of (seed, draw, token id) only: a request samples the same tokens alone or in a
  // batch, in any row.
  uint64_t draw = 0;
};

// One sequence's share of a Forward call: new tokens at the positions that follow what its slot
// already holds.
struct CudaStepInput {
  int slot = 0;
  std::span<const int32_t> tokens;
  float* logits_out = nullptr;           // [vocab] host memory for the last token's logits, or null
  const CudaSampling* sample = nullptr;  // non-null: draw the next token after the last one, on
                                         // the device
  int32_t* token_out = nullptr;          // where that token goes (required with sample)
};

// GPU time of one decode step by kind of work, measured with events between the ops of an
// un-graphed step: GEMMs (cuBLAS), attention (split + combine kernels), everything else.
struct StepBreakdown {
  double total_ms = 0;
  double gemm_ms = 0;
  double attention_ms = 0;
  double other_ms = 0;
  // ShadowKV steps only: landmark scoring and top-k, key rebuild, value fetch, graduation of
  // generated chunks (attention_ms is then the sparse attention alone).
  double scoring_ms = 0;
  double rebuild_ms = 0;
  double fetch_ms = 0;
  double graduate_ms = 0;
  double allreduce_ms = 0;  // tensor parallelism: the two all-reduces of every layer

  // Adds `weight` times every time of `o` (a mean over steps: weight 1 / steps).
  void Add(const StepBreakdown& o, double weight) {
    for (auto field : {&StepBreakdown::total_ms, &StepBreakdown::gemm_ms,
                       &StepBreakdown::attention_ms, &StepBreakdown::other_ms,
                       &StepBreakdown::scoring_ms, &StepBreakdown::rebuild_ms,
                       &StepBreakdown::fetch_ms, &StepBreakdown::graduate_ms,
                       &StepBreakdown::allreduce_ms}) {
      this->*field += weight * (o.*field);
    }
  }
};

// The ShadowKV sequences' state and counters.
struct CudaShadowKvStats {
  int num_sequences = 0;          // allocated
  int rank = 0;                   // the rank A and B are sized for (a per-layer rank's cap)
  int max_budget_chunks = 0;
  int64_t device_bytes = 0;       // device memory of the sequences (values included where held)
  int64_t host_bytes = 0;         // pinned host memory of the values kept there
  int device_value_sequences = 0;
  int host_value_sequences = 0;
  int64_t chunks_selected = 0;    // summed over steps, layers, KV heads
  int64_t chunk_hits = 0;         // of which already in the gather buffer
  // select_drift only (0 without it): (layer, KV head) decode steps, of which selected.
  int64_t head_steps = 0;
  int64_t head_selections = 0;
  double compress_seconds = 0;    // the last CompressToShadowKv
  // Its parts on the GPU's timeline (over tensor-parallel ranks, summed): the Gram matrices, the
  // eigenvectors (on the GPU, or downloaded, solved on the host and uploaded), the projection
  // with landmarks and minimum cosines, the outliers and the copies.
  std::array<double, 4> compress_phase_seconds{};
};

// One ShadowKV sequence's chunk selections since it was compressed (or the counters reset):
// summed over steps, layers and KV heads, and how many of them were already gathered.
struct CudaChunkCounts {
  int64_t selected = 0;
  int64_t hits = 0;
  // select_drift only (0 without it): (layer, KV head) decode steps, of which selected.
  int64_t head_steps = 0;
  int64_t head_selections = 0;

  CudaChunkCounts& operator+=(const CudaChunkCounts& o) {
    selected += o.selected;
    hits += o.hits;
    head_steps += o.head_steps;
    head_selections += o.head_selections;
    return *this;
  }
};

// One ShadowKV sequence's whole state in (pageable) host memory: restored into an allocation
// of the same settings and capacity, it continues exactly where it was saved.
// The first tokens of one full-cache slot in host memory as fp32, per layer
// [num_tokens, num_kv_heads * head_dim] (token-major, heads side by side, as the CPU KV policies
// take them).
struct CudaSlotExport {
  int64_t num_tokens = 0;
  std::vector<std::vector<float>> keys;           // after RoPE
  std::vector<std::vector<float>> values;
  std::vector<std::vector<float>> keys_pre_rope;  // empty unless the cache keeps them
};

struct CudaShadowKvSnapshot {
  std::vector<std::vector<uint8_t>> device_parts;  // per device buffer, one sequence's share
  std::vector<uint8_t> values;
  std::vector<uint8_t> bookkeeping;                // host-side records
};

class CudaModel {
 public:
  // Reads a GGUF model and uploads it once, every weight dequantised to bf16. Unsupported shapes
  // (head_dim other than 16/32/64/96/128/256, more than 32 query heads per KV head) are
  // kUnsupported.
  static Result<std::unique_ptr<CudaModel>> Load(const std::string& path,
                                                 const CudaModelOptions& options);
  // Random weights generated on the device with `config`'s shapes: for throughput only.
  static Result<std::unique_ptr<CudaModel>> CreateSynthetic(const ModelConfig& config,
                                                            uint64_t seed,
                                                            const CudaModelOptions& options);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const;
  const CudaModelOptions& options() const;
  bool synthetic() const;
  int64_t weight_bytes() const;         // device bytes of all weights
  int64_t decode_weight_bytes() const;  // weight bytes one decode step reads (not the embedding)
  int64_t activation_bytes() const;     // device bytes of the step buffers

  // The KV cache: `num_slots` sequences of up to `capacity` tokens. Replaces any previous cache
  // (every slot starts empty). Short of memory: kResourceExhausted, and no cache is held.
  int64_t KvBytesPerToken() const;  // keys and values of one token, all layers
  // keep_pre_rope_keys: also keep every token's keys before RoPE (ShadowKV compresses those).
  Status AllocateKvCache(int num_slots, int64_t capacity, bool keep_pre_rope_keys = false);
  void FreeKvCache();
  int num_slots() const;
  int64_t slot_capacity() const;
  int64_t slot_length(int slot) const;  // tokens the slot holds
  void ResetSlot(int slot);             // the slot's sequence is forgotten
  // Makes `to` hold a copy of `from`'s sequence (forks; bench batches of one prompt).
  Status CopySlot(int from, int to);
  // The slot's first `num_tokens` tokens (at most its length), e.g. to hand a prefill made here
  // to the CPU policies.
  Result<CudaSlotExport> ExportSlot(int slot, int64_t num_tokens) const;

  // Runs the new tokens of every input (distinct slots) through the model and appends them to
  // the cache. Single-token inputs take the decode attention kernel, longer ones the prefill
  // kernel. Inputs with `sample` get their next token drawn on the device in *token_out; only
  // inputs with logits_out copy logits to the host. On error nothing was appended when the inputs
  // were rejected up front; a failure inside the GPU work leaves the slots involved unusable
  // (reset them).
  Status Forward(std::span<const CudaStepInput> inputs);

  // One decode step for `slots` (distinct): tokens[i] goes in, the next token (chosen on the
  // GPU with sampling[i]) comes back in tokens[i]. logits_out, when not null, receives
  // [slots.size(), vocab]. One setting per row (kInvalidArgument unless sampling.size() is the
  // number of rows or a setting is out of range).
  Status DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                    std::span<const CudaSampling> sampling, float* logits_out = nullptr);
  // Every row with `sampling`'s settings: the draw is the model's count of such steps (its
  // `draw` is not read) and each row has a seed of its own made from (seed, row).
  Status DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                    const CudaSampling& sampling, float* logits_out = nullptr);

  // DecodeStep without the graph, timing its parts (greedy). Advances the sequences the same way.
  Result<StepBreakdown> ProfileDecodeStep(std::span<const int> slots, std::span<int32_t> tokens);

  // ShadowKV sequences, separate from the full cache's slots: a prompt is prefilled
  // into a full-cache slot (with pre-RoPE keys), compressed into a ShadowKV sequence, then
  // decoded with sparse attention over outliers + selected chunks + the exact recent window.
  // On a sliding-window model only the global layers are compressed; each windowed layer keeps
  // its last sliding_window tokens exactly, in a ring per sequence, as on the CPU.
  // Allocates `num_sequences` sequences of up to `capacity` tokens (no values yet). Budget,
  // rank, chunk size, outliers and window come from `config` as on the CPU.
  Status AllocateShadowKv(const kv::KvPolicyConfig& config, int num_sequences, int64_t capacity);
  void FreeShadowKv();
  // Whether this model's ShadowKV runs on the GPU: a refusal naming why where it does not
  // (head widths or more query heads per KV head than the kernels take). The CPU backend serves
  // those models' ShadowKV. Every other ShadowKV entry point checks it too.
  Status ShadowKvRunsHere() const;
  // Device bytes of one sequence without its values, and of its values (after AllocateShadowKv,
  // or for a planned allocation).
  Result<std::pair<int64_t, int64_t>> ShadowKvBytesPerSequence(const kv::KvPolicyConfig& config,
                                                               int64_t capacity) const;
  // Gives sequence `seq` its value store: device memory, or mapped pinned host memory that the
  // fetch kernel reads directly. kResourceExhausted when it does not fit.
  Status AllocateShadowKvValues(int seq, bool on_host);
  // Gives sequence `seq` a pinned host copy of its compressed prompt's exact pre-RoPE keys,
  // written by the next CompressToShadowKv and read by DecompressShadowKv, so that a later
  // turn's recompression starts from the prompt's exact keys rather than rank-r ones. The
  // memory ([layers, capacity, kv_width] bf16) stays with the index until FreeShadowKv.
  // kResourceExhausted when it cannot be pinned.
  Status AllocateShadowKvKeys(int seq);
  // Gives sequence `seq`'s value store back (the sequence is forgotten).
  Status FreeShadowKvValues(int seq);
  // Compresses the prompt held by full-cache slot `full_slot` into ShadowKV sequence `seq`.
  Status CompressToShadowKv(int full_slot, int seq);
  // The inverse, as far as it goes: full-cache slot `full_slot` (one that keeps pre-RoPE keys)
  // comes to hold sequence `seq`'s tokens: the chunked ones' keys rebuilt at the sequence's rank
  // (pre-RoPE A·B, then rotated; the compressed prompt's exact keys where AllocateShadowKvKeys
  // kept them), their values from the store, the exact window's keys and
  // values as held, each windowed layer's last window tokens from its ring. The sequence is left
  // as it was. A held conversation's next turn can then prefill its new tokens into the slot with
  // full attention and compress the whole again. kUnsupported for FP8 value stores.
  Status DecompressShadowKv(int seq, int full_slot);
  Status CopyShadowKvSequence(int from, int to);
  // Sequence `seq` (with values) to host memory and back, e.g. across a re-allocation.
  Result<CudaShadowKvSnapshot> SaveShadowKvSequence(int seq);
  Status RestoreShadowKvSequence(const CudaShadowKvSnapshot& snapshot, int seq);
  int64_t shadowkv_length(int seq) const;
  // As DecodeStep, over ShadowKV sequences.
  Status ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                            std::span<const CudaSampling> sampling, float* logits_out = nullptr);
  Status ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                            const CudaSampling& sampling, float* logits_out = nullptr);
  Result<StepBreakdown> ProfileShadowKvDecodeStep(std::span<const int> seqs,
                                                  std::span<int32_t> tokens);
  CudaShadowKvStats shadowkv_stats() const;
  void ResetShadowKvCounters();
  // Every sequence's chunk counts, [num_sequences].
  Result<std::vector<CudaChunkCounts>> ShadowKvSequenceCounts() const;
  // The rank each layer of sequence `seq` uses: the one rank, or under rank_energy each layer's
  // own from its key spectrum (CudaShadowKvStats::rank is then the cap the memory is sized for);
  // [model layers], 0 at a sliding-window layer (not compressed).
  Result<std::vector<int32_t>> ShadowKvLayerRanks(int seq) const;
  // The chunks held by the gather slots of (seq, model layer, KV head) (-1: empty; none at a
  // sliding-window layer), for tests.
  Result<std::vector<int32_t>> ShadowKvGatheredChunks(int seq, int layer, int kv_head) const;

  struct Impl;

 private:
  explicit CudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowkv::cuda
