// ShadowKV decode and compression kernels (DESIGN.md): landmark scoring, top-k with gather-slot
// reuse (or per-query-head, or re-ranked by the candidates' rebuilt keys), value fetch, low-rank
// key rebuild with RoPE at each layer's own rank, graduation of generated chunks, and the
// per-chunk landmarks / outliers of a freshly prefilled sequence.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/common/kv_cache_view.cuh"
#include "ops/cuda/shadowkv/shadowkv_meta.h"

namespace shadowkv::cuda {

constexpr int kSkvMaxBudgetChunks = 1024;  // K per KV head at most (one select block's threads)
constexpr int kSkvMaxGroup = 16;          // query heads per KV head at most (score and select)
constexpr int kSkvMaxGroupFirst = 8;      // the same for the first kernels (kSkvKernelsFirst)
// The query heads per KV head the scoring and select kernels are built for: 1 to 8 (each a
// tensor-core tile's columns, or fewer), and 16 (two tiles: GLM-4-9B).
constexpr bool SkvGroupSupported(int group) {
  return (group >= 1 && group <= 8) || group == kSkvMaxGroup;
}
// Head widths the kernels are built for: 64 and 128 by both kernel variants, 96 (Phi-3-mini)
// and 256 (Gemma 3 below 27B) by the fast kernels only.
constexpr bool SkvHeadDimFirstKernels(int head_dim) { return head_dim == 64 || head_dim == 128; }
constexpr bool SkvHeadDimSupported(int head_dim) {
  return SkvHeadDimFirstKernels(head_dim) || head_dim == 96 || head_dim == 256;
}
constexpr int kSkvMaxGraduateChunk = 16;   // C at most (a graduating chunk's tokens in registers)
constexpr int kSkvScoreChunksPerBlock = 256;  // chunks scored by one block of the fast kernel
SKV_HOST_DEVICE constexpr int SkvScoreBlocks(int capacity_chunks) {
  return (capacity_chunks + kSkvScoreChunksPerBlock - 1) / kSkvScoreChunksPerBlock;
}

// Counters per sequence (SkvLayout::counters).
constexpr int kSkvCounters = 4;

// Where every ShadowKV sequence keeps its state ([seqs, layers, ...] buffers, one per kind).
struct SkvLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int group = 0;          // query heads per KV head
  int chunk_size = 0;     // C
  int rank = 0;           // r (multiple of 8): what A's rows and B are laid out for
  int capacity_chunks = 0;  // chunks one sequence can hold
  int max_budget = 0;       // K slots reserved per (sequence, layer, KV head)
  int max_candidates = 0;   // re-ranking only: candidates per (row, KV head) at most, else 0
  int recent_capacity = 0;  // W + C rows of exact keys
  // Attention buffer, K and V: [seqs, layers, kv_heads, attn capacity, head_dim]: rows
  // [0, O·C) outlier chunks, [O·C, (O+K)·C) gather slots, then the exact recent tokens.
  KvCacheView attn;
  __nv_bfloat16* keys_pre = nullptr;      // [seqs, layers, recent_capacity, kv_width]
  __nv_bfloat16* coefficients = nullptr;  // A: [seqs, layers, capacity_chunks * C, rank]
  __nv_bfloat16* basis = nullptr;         // B: [seqs, layers, rank, kv_width]
  // [seqs, layers] the rank each layer of each sequence uses, a multiple of 8 up to `rank` (a
  // per-layer rank from the key spectrum), or null: `rank` everywhere. B's rows and A's columns
  // past a layer's rank hold zeros, so a kernel that reads the whole `rank` stays right; the
  // kernels stop at the layer's rank to save the work.
  const int32_t* layer_rank = nullptr;
  __nv_bfloat16* landmarks = nullptr;     // [seqs, layers, kv_heads, capacity_chunks, head_dim]
  // FP8 landmarks (core/fp8.h) instead of `landmarks`: e4m3 codes in the same order, and one
  // scale per landmark [seqs, layers, kv_heads, capacity_chunks]. Fast kernels only, with
  // capacity_chunks a multiple of 16.
  int fp8_landmarks = 0;
  uint8_t* landmark_codes = nullptr;
  float* landmark_scales = nullptr;
  uint8_t* outlier = nullptr;             // [seqs, layers, kv_heads, capacity_chunks] 1 = outlier
  int32_t* slot_chunk = nullptr;          // [seqs, layers, kv_heads, max_budget] -1 = empty
  // select_sample (kv::KvPolicyConfig), or null without it: [seqs, layers, kv_heads, max_budget]
  // each gather slot's log weight, ln(pool / drawn) where its chunk was drawn at random from the
  // pool of selectable chunks the ranking left out, 0 where it was ranked; the attention adds it
  // to the slot's scores, so a drawn chunk stands for pool / drawn chunks. A selecting step
  // rewrites every slot's weight with its slot_chunk. max_sample: chunks a selection draws at
  // most (SkvSequenceInfo::sample_chunks of the largest budget).
  float* slot_log_weight = nullptr;
  int max_sample = 0;
  // The model's index of this layout's KV head 0 (under tensor parallelism its rank's first
  // head, else 0): the draw is seeded by the model's head, so every rank draws what one GPU and
  // the CPU policy draw.
  int first_head = 0;
  // values[seq] → [layers, kv_heads, capacity_chunks * C, head_dim]: device or mapped pinned
  // host memory; one chunk of one head is one contiguous run. With fp8_values the run is e4m3
  // codes (1 byte each) and the store continues, after all the codes, with one fp32 scale per
  // run [layers, kv_heads, capacity_chunks] (core/fp8.h).
  __nv_bfloat16* const* values = nullptr;
  int fp8_values = 0;
  // Exact keys (kv::KvPolicyConfig::exact_keys): the store continues, at byte key_store_offset
  // (16-byte aligned), with the chunks' post-RoPE keys, bf16, one run per chunk of one head in
  // the values' order; with fp8_keys as e4m3 codes of each key less its chunk's landmark (as
  // stored, bf16 or FP8), then one fp32 scale per run, as FP8 values are laid out. The value
  // fetch then copies (or decodes) a missed chunk's keys too, and there is no key rebuild
  // (LaunchSkvRebuildKeys does nothing).
  int exact_keys = 0;
  int fp8_keys = 0;
  // 1: the re-rank scores its candidates from the stored exact keys (exact_keys without
  // rerank_rank); 0: from keys rebuilt from A and B (SkvDecodeParams::rerank_rank components).
  int rerank_stored = 0;
  int64_t key_store_offset = 0;
  const SkvSequenceInfo* info = nullptr;      // [seqs]
  // Selection reuse under select_drift (LaunchSkvDrift; null without it): each (sequence, layer,
  // KV head)'s last selection, its decode step [seqs, layers, kv_heads] (-1: none since the
  // compression) and its query heads' queries without the rotary embedding [seqs, layers,
  // kv_heads, group, head_dim] fp32.
  int32_t* drift_step = nullptr;
  float* drift_queries = nullptr;
  // [seqs, kSkvCounters]: each sequence's chunks selected, of which hits; under select_drift its
  // (layer, KV head) decode steps, of which selected (or null).
  unsigned long long* counters = nullptr;

  SKV_HOST_DEVICE int kv_width() const { return num_kv_heads * head_dim; }
  // Index of (sequence, layer, KV head) in the [seqs, layers, kv_heads, ...] buffers.
  SKV_HOST_DEVICE int64_t HeadIndex(int seq, int layer, int head) const {
    return (static_cast<int64_t>(seq) * num_layers + layer) * num_kv_heads + head;
  }
  // Index of (sequence, layer, KV head, chunk) in the per-chunk buffers (landmarks, outlier).
  SKV_HOST_DEVICE int64_t ChunkIndex(int seq, int layer, int head, int chunk) const {
    return HeadIndex(seq, layer, head) * capacity_chunks + chunk;
  }
  // The rank (sequence, layer) uses (device code: layer_rank is device memory).
  SKV_HOST_DEVICE int RankOf(int seq, int layer) const {
    return layer_rank ? layer_rank[static_cast<int64_t>(seq) * num_layers + layer] : rank;
  }
  // Sequence `seq`'s counters, or null where the layout keeps none.
  SKV_HOST_DEVICE unsigned long long* SequenceCounters(int seq) const {
    return counters ? counters + kSkvCounters * static_cast<int64_t>(seq) : nullptr;
  }
  // Index of the run (layer, head, chunk) within one sequence's value store or landmark set.
  SKV_HOST_DEVICE int64_t RunIndex(int layer, int head, int chunk) const {
    return (static_cast<int64_t>(layer) * num_kv_heads + head) * capacity_chunks + chunk;
  }
  // FP8 value store of sequence `seq`: codes of a run, and its scale.
  SKV_HOST_DEVICE uint8_t* ValueCodes(int seq, int layer, int head, int chunk) const {
    return reinterpret_cast<uint8_t*>(values[seq]) +
           RunIndex(layer, head, chunk) * chunk_size * head_dim;
  }
  SKV_HOST_DEVICE float* ValueScale(int seq, int layer, int head, int chunk) const {
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(values[seq]) +
                                    RunIndex(num_layers, 0, 0) * chunk_size * head_dim) +
           RunIndex(layer, head, chunk);
  }
  // Exact keys (exact_keys only) of the store at `store` (a sequence's values[seq]; the host
  // passes its own pointer to it): where they start, a bf16 run, or with fp8_keys its codes and
  // scale.
  SKV_HOST_DEVICE uint8_t* KeysOf(void* store) const {
    return static_cast<uint8_t*>(store) + key_store_offset;
  }
  SKV_HOST_DEVICE __nv_bfloat16* KeyRunOf(void* store, int layer, int head, int chunk) const {
    return reinterpret_cast<__nv_bfloat16*>(KeysOf(store)) +
           RunIndex(layer, head, chunk) * chunk_size * head_dim;
  }
  SKV_HOST_DEVICE __nv_bfloat16* KeyRun(int seq, int layer, int head, int chunk) const {
    return KeyRunOf(values[seq], layer, head, chunk);
  }
  SKV_HOST_DEVICE uint8_t* KeyCodes(int seq, int layer, int head, int chunk) const {
    return KeysOf(values[seq]) + RunIndex(layer, head, chunk) * chunk_size * head_dim;
  }
  SKV_HOST_DEVICE float* KeyScale(int seq, int layer, int head, int chunk) const {
    return reinterpret_cast<float*>(KeysOf(values[seq]) +
                                    RunIndex(num_layers, 0, 0) * chunk_size * head_dim) +
           RunIndex(layer, head, chunk);
  }
};

struct SkvDecodeParams {
  SkvLayout layout;
  const SkvRowMeta* meta = nullptr;  // [rows]
  int rows = 0;
  int layer = 0;
  const __nv_bfloat16* queries = nullptr;  // [rows, kv_heads * group * head_dim] post-RoPE
  float* logits = nullptr;                 // [rows, kv_heads * group, capacity_chunks] scratch
  // Fast kernels: each scoring block's softmax statistics (max, sum of exp(logit - max)) over
  // its kSkvScoreChunksPerBlock chunks, [rows, kv_heads * group, SkvScoreBlocks(capacity), 2].
  float* softmax_partials = nullptr;
  int32_t* miss_chunk = nullptr;           // [rows, kv_heads, max_budget] chunk to fill, or -1
  const float* inv_freq = nullptr;         // [rotary_dim / 2]
  int rotary_dim = 0;
  bool halves = false;
  float scale = 0.0f;  // 1/sqrt(head_dim)
  // kSkvKernelsFirst: the first kernels (kept to compare); kSkvKernelsFast: unrolled scoring,
  // three-pass select with warp-aggregated radix histograms, and the register-RoPE rebuild
  // (64 slots per block, cp.async double buffering; full-width rotary only, else the first).
  int kernel_variant = 1;
  // Select each top chunk's successor with it (kv::SelectTopKWithSuccessors): the top K of
  // max(key[c], key[c - 1]) over selectable neighbours. Fast kernels only.
  int select_successors = 0;
  // Fast select: 1 = a 12-bit first radix digit counted while the keys are written, the later
  // digits over its candidates only, and ballot placement; 0 = four 8-bit digits over every key
  // (kept to compare).
  int coarse_select = 1;
  // Coarse select: registers a thread may use, 64 (0: the default; 512 threads, two blocks per
  // SM; budgets up to 512 chunks, else 32) or 32 (1024 or 512 threads, two or four blocks per SM).
  int select_registers = 0;
  // Fast rebuild: gather slots per block, 32, 64 or 128 (0: the default, 32).
  int rebuild_slots = 0;
  // Fast re-rank with exact keys: 1 the stored keys read ahead of the tile multiplied (bf16 by
  // cp.async, two tiles; FP8 codes into registers, one tile, and scored as coded, at head dims
  // up to 128); 0 a tile at a time by plain loads, FP8 decoded to bf16 (kept to compare).
  int stored_key_prefetch = 1;
  // Re-ranking (kv::KvPolicyConfig selection "rerank"): with `candidates` set, LaunchSkvSelect
  // keeps min(max(rerank_factor · K, rerank_min_chunks), selectable, layout.max_candidates)
  // chunks per (row, KV head) into candidates [rows, kv_heads, max_candidates] (increasing, then
  // -1) and assigns no gather slot; LaunchSkvRerank then scores their rebuilt keys exactly, into
  // candidate_lse [rows, kv_heads * group, max_candidates]: per query head, the log-sum-exp of
  // each candidate chunk's token logits; and keeps the best K, assigning the slots as the select
  // does.
  int rerank_factor = 0;
  int rerank_min_chunks = 0;
  // Components of the key basis the exact scoring rebuilds candidates from: the first
  // rerank_rank (a multiple of 8), or the layer's rank when 0 or above it. The kept chunks are
  // rebuilt at the layer's rank either way.
  int rerank_rank = 0;
  int32_t* candidates = nullptr;
  float* candidate_lse = nullptr;
  // Per-query-head selection (selection "heads"): LaunchSkvSelect ranks the chunks by each
  // query head's own landmark softmax and takes them round-robin over the group's heads (each
  // its best not yet taken) until K; needs SkvConfigureSelectHeads.
  int select_heads = 0;
  // select_drift: LaunchSkvDrift writes head_keeps [rows, kv_heads], 1 where the KV head keeps
  // the chunks its slots hold (it selected fewer than select_interval steps ago and none of its
  // query heads' queries, without the rotary embedding, has a cosine below its sequence's
  // SkvSequenceInfo::select_drift with the one it last selected with); every selection kernel
  // then leaves that (row, KV head) as it leaves a row whose plan reuses (SkvKeepsChunks).
  // Null: no drift.
  uint8_t* head_keeps = nullptr;
  int select_interval = 1;
};

// Whether KV head h of decode row `row` (plan m) attends the chunks its slots hold without
// selecting at this step: the row's plan reuses (select_interval), or the drift test kept them.
SKV_HOST_DEVICE inline bool SkvKeepsChunks(const SkvDecodeParams& p, const SkvRowMeta& m, int row,
                                           int h) {
  return m.reuse != 0 ||
         (p.head_keeps && p.head_keeps[static_cast<int64_t>(row) * p.layout.num_kv_heads + h]);
}

constexpr int kSkvKernelsFirst = 0;
constexpr int kSkvKernelsFast = 1;

// The same step restricted to rows [first, first + count) of `params` (their metadata, queries
// and per-row scratch), for the decode kernels below but graduation.
SkvDecodeParams SkvDecodeRows(const SkvDecodeParams& params, int first, int count);
// A step's rows are split in two for the selection from this many rows.
constexpr int kSkvSplitMinRows = 4;

// Graduation (rows whose graduate_chunk >= 0), every layer of the layout in one launch of each
// kernel, before the step's first layer appends its token: A rows = K_pre·Bᵀ, landmark, values
// to the store, then the exact window moves down by one chunk. `params.layer` is not read.
cudaError_t LaunchSkvGraduate(const SkvDecodeParams& params, cudaStream_t stream);
// logits[row, q head, chunk] = scale·q·L (−inf for outliers); chunks [0, num_chunks).
cudaError_t LaunchSkvScore(const SkvDecodeParams& params, cudaStream_t stream);
// Softmax per query head, max over the group, top-K (ties: lower chunk first), hits against the
// gather slots, misses written to miss_chunk and slot_chunk; counters updated. Under
// select_sample (fast kernels, landmark selection) the top K less the sequence's sample_chunks,
// and that many more drawn at random from the selectable rest, as the CPU policy draws them
// (same seed, same shuffle: SkvDrawSample), with the slots' log weights written.
cudaError_t LaunchSkvSelect(const SkvDecodeParams& params, cudaStream_t stream);
// select_drift, before the layer's scoring: for each (row, KV head), whether it selects at this
// step (head_keeps), and where it does its step and unrotated queries recorded; counters
// updated. Needs head_keeps, layout.drift_step and layout.drift_queries.
cudaError_t LaunchSkvDrift(const SkvDecodeParams& params, cudaStream_t stream);
// Re-ranking, after a LaunchSkvSelect that kept candidates: each candidate's keys rebuilt from
// A and B with RoPE (rounded to bf16, as the gather rows hold them) and scored against the
// row's queries; per query head the softmax over all candidate tokens, a chunk's score the sum
// of its tokens' probabilities, max over the group; the best K (ties: the lower chunk) go to
// the gather slots as LaunchSkvSelect's would (hits, misses, counters; under select_sample the
// best K less the drawn chunks, which are drawn from every selectable chunk not kept).
cudaError_t LaunchSkvRerank(const SkvDecodeParams& params, cudaStream_t stream);
// Values of the missed chunks (and with exact_keys their keys): store → attention buffer gather
// rows.
cudaError_t LaunchSkvFetchValues(const SkvDecodeParams& params, cudaStream_t stream);
// Keys of the missed chunks: A rows · B_h on tensor cores, RoPE at the chunk's positions.
// Nothing with exact_keys (the fetch copied them).
cudaError_t LaunchSkvRebuildKeys(const SkvDecodeParams& params, cudaStream_t stream);

// Compression of one sequence, every layer: B from the eigenvectors of each layer's Gram matrix
// (BatchedSymmetricEigen's output). Row i of layer l's B is eigenvector width-1-i (the i-th
// largest eigenvalue's) in bf16, for i < the layer's rank; rows from there to layout.rank are 0.
struct SkvBasisParams {
  SkvLayout layout;
  int seq = 0;
  // [layers, kv_width, kv_width]: column j (column-major) is the eigenvector of the layer's j-th
  // smallest eigenvalue.
  const float* eigenvectors = nullptr;
  const int32_t* ranks = nullptr;  // [layers] rows each layer keeps (<= layout.rank), or null: all
};
cudaError_t LaunchSkvBasisFromEigenvectors(const SkvBasisParams& params, cudaStream_t stream);

// Compression of one freshly prefilled sequence, one layer: landmarks (mean post-RoPE key of
// each chunk) and each chunk's smallest cosine between its landmark and its keys.
struct SkvLandmarkParams {
  SkvLayout layout;
  int seq = 0;
  int layer = 0;      // in the layout: among the compressed (global) layers
  KvCacheView cache;  // the full cache holding the prompt's post-RoPE keys and values
  int cache_slot = 0;
  int cache_layer = 0;  // the same layer in the full cache: the model's layer index
  int num_chunks = 0;
  float* min_cosine = nullptr;  // [kv_heads, num_chunks]
};
cudaError_t LaunchSkvLandmarks(const SkvLandmarkParams& params, cudaStream_t stream);

// Compression, every layer and KV head at once: the `count` chunks with the lowest min-cosine
// (ties: the lower index), in increasing index: kv::PickOutlierChunks's rule.
struct SkvPickOutliersParams {
  const float* min_cosine = nullptr;  // [pairs, num_chunks]
  int pairs = 0;                      // layers x KV heads
  int num_chunks = 0;
  int count = 0;                      // at most num_chunks
  int32_t* outliers = nullptr;        // [pairs, count]
};
cudaError_t LaunchSkvPickOutliers(const SkvPickOutliersParams& params, cudaStream_t stream);

// Marks the chosen outlier chunks and copies their exact K/V into the attention buffer.
struct SkvOutlierParams {
  SkvLayout layout;
  int seq = 0;
  int layer = 0;  // in the layout (as SkvLandmarkParams)
  KvCacheView cache;
  int cache_slot = 0;
  int cache_layer = 0;  // in the full cache
  const int32_t* outliers = nullptr;  // [kv_heads, num_outliers] chunk indices, increasing
  int num_outliers = 0;
};
cudaError_t LaunchSkvPlaceOutliers(const SkvOutlierParams& params, cudaStream_t stream);

// FP8 value store only: the values of chunks [0, num_chunks) of every KV head of one layer,
// quantised from a full cache slot into sequence `seq`'s store (one run per chunk per head).
// Reads the same fields as the landmarks (all but min_cosine).
cudaError_t LaunchSkvStoreValuesFp8(const SkvLandmarkParams& params, cudaStream_t stream);
// The same for the post-RoPE keys into the FP8 key store (exact_keys with fp8_keys), each key
// less its chunk's landmark as stored: after LaunchSkvLandmarks of the same chunks.
cudaError_t LaunchSkvStoreKeysFp8(const SkvLandmarkParams& params, cudaStream_t stream);

// Decompression (CudaModel::DecompressShadowKv), one compressed layer: post-RoPE keys of tokens
// [0, rows) (token t at position t) into a full cache slot from their pre-RoPE keys.
struct SkvRopeRowsParams {
  const __nv_bfloat16* keys_pre = nullptr;  // [rows, kv_heads * head_dim], token-major
  KvCacheView cache;
  int cache_slot = 0;
  int cache_layer = 0;
  int64_t rows = 0;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  int rotary_dim = 0;
  bool halves = false;  // as SkvDecodeParams::halves
};
cudaError_t LaunchSkvRopeRows(const SkvRopeRowsParams& params, cudaStream_t stream);

// Dynamic shared memory of the select kernel for this layout (its capacity, budget, candidates
// and draw).
int64_t SkvSelectSharedBytes(const SkvLayout& layout);

// Checks the layout against the kernels' limits and raises their shared-memory limits (call
// before the first launch, outside any graph capture). cudaErrorInvalidValue: not supported.
cudaError_t SkvConfigureKernels(const SkvLayout& layout);
// The same for the per-query-head select (SkvDecodeParams::select_heads).
cudaError_t SkvConfigureSelectHeads(const SkvLayout& layout);

}  // namespace shadowkv::cuda
