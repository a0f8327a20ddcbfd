// The ShadowKV decode step on the GPU: its kernel settings, the graduation of every layer at the
// step's start, the sparse attention of one layer (scoring, select, value fetch beside the key
// rebuild, attention; in two overlapping halves of the rows when graph-replayed) and the step
// around it.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "gpu/model/cuda_model_impl.h"
#include "ops/cuda/attention/decode_attention.cuh"

namespace shadowkv::cuda {

SkvDecodeSettings ShadowKvDecodeSettings(const CudaKernelOptions& options) {
  SkvDecodeSettings d;
  if (options.shadowkv_kernels == kSkvKernelsFirst) d.kernel_variant = kSkvKernelsFirst;
  d.coarse_select = options.coarse_select == 0 ? 0 : 1;
  d.select_registers = options.select_registers;
  d.split_rows = options.split_rows;
  d.split_share = std::clamp(options.split_share, 10, 90);
  d.rebuild_slots = options.rebuild_slots;
  d.stored_key_prefetch = options.stored_key_prefetch == 0 ? 0 : 1;
  d.attention_splits = std::clamp(options.attention_splits, 0, kDecodeMaxSplits);
  return d;
}

Status CudaModel::Impl::RunShadowKvGraduation(const StepPlan& plan, StepProfiler* profiler) {
  if (!plan.skv_graduates) return Status::Ok();
  SkvDecodeParams p;
  p.layout = skv->layout;
  p.meta = skv->row_meta;
  p.rows = plan.decode_rows;
  SKV_CUDA_RETURN_IF_ERROR(LaunchSkvGraduate(p, stream));
  return profiler ? profiler->Mark(OpKind::kSkvGraduate, stream) : Status::Ok();
}

Status CudaModel::Impl::RunShadowKvAttention(const StepPlan& plan, int layer,
                                             StepProfiler* profiler) {
  ShadowKvState& s = *skv;
  const ModelConfig& c = config;
  const SkvDecodeSettings settings = ShadowKvDecodeSettings(options.kernels);
  auto mark = [&](OpKind kind) { return profiler ? profiler->Mark(kind, stream) : Status::Ok(); };
  SkvDecodeParams p;
  p.layout = s.layout;
  p.meta = s.row_meta;
  p.rows = plan.decode_rows;
  p.layer = layer;
  p.queries = q.get();
  p.logits = s.logits.get();
  p.softmax_partials = s.softmax_partials.get();
  p.miss_chunk = s.miss_chunk.get();
  p.inv_freq = inv_freq.get();
  p.rotary_dim = c.rope.rotary_dim;
  p.halves = c.rope.style == RopeConfig::Style::kHalves;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));  // chunk scoring, as on the CPU
  p.kernel_variant = settings.kernel_variant;
  p.coarse_select = settings.coarse_select;
  p.select_registers = settings.select_registers;
  p.rebuild_slots = settings.rebuild_slots;
  p.stored_key_prefetch = settings.stored_key_prefetch;
  p.select_successors = s.config.select_successors;
  p.select_heads = s.geometry.select_heads ? 1 : 0;
  if (s.geometry.drift()) {
    p.head_keeps = s.head_keeps.get();
    p.select_interval = s.geometry.select_interval;
    // Which KV heads select at this step, for every row at once (the halves below read it).
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvDrift(p, stream));
  }
  if (s.geometry.max_candidates > 0) {
    p.rerank_factor = s.geometry.rerank_factor;
    p.rerank_min_chunks = s.geometry.rerank_min_chunks;
    p.rerank_rank = s.geometry.rerank_rank;
    p.candidates = s.candidates.get();
    p.candidate_lse = s.candidate_lse.get();
  }
  // The chunk selection of `part`: the landmark select, and under re-ranking the exact scoring
  // of its candidates that picks the K.
  auto select_chunks = [&](const SkvDecodeParams& part, cudaStream_t on) -> Status {
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvSelect(part, on));
    if (part.candidates) SKV_CUDA_RETURN_IF_ERROR(LaunchSkvRerank(part, on));
    return Status::Ok();
  };
  // Sparse attention of rows [first, first + count) on `on`.
  auto attend = [&](int first, int count, cudaStream_t on) {
    const int64_t q_width = static_cast<int64_t>(c.num_query_heads) * c.head_dim;
    // The whole step's split count, so a row's sums run in the same order split or not.
    const int fixed = settings.attention_splits;
    const int splits =
        fixed > 0
            ? fixed
            : DecodeNumSplits(plan.decode_rows, DecodeHeadBlocks(c.num_query_heads, c.num_kv_heads),
                              target_blocks);
    DecodeAttentionParams d;
    d.queries = q.get() + first * q_width;
    d.cache = s.layout.attn;
    d.layer = layer;
    d.slots = meta.slots + first;
    d.positions = s.attn_last + first;
    // [rows, query heads, splits, head_dim]: the part's rows start after the others' splits.
    d.partial_out =
        partial_out.get() + static_cast<int64_t>(first) * c.num_query_heads * splits * c.head_dim;
    d.partial_lse = partial_lse.get() + static_cast<int64_t>(first) * c.num_query_heads * splits;
    d.out = attn.get() + first * q_width;
    d.rows = count;
    d.num_query_heads = c.num_query_heads;
    d.num_kv_heads = c.num_kv_heads;
    d.head_dim = c.head_dim;
    d.num_splits = splits;
    d.scale = AttentionScaleOf(c);  // the model's own softmax scale (phi3: LongRoPE's factor)
    if (s.layout.slot_log_weight) {  // chunks drawn at random stand for the pool they came from
      d.key_log_weight = s.layout.slot_log_weight;
      d.weight_first = s.gather_first + first;
      d.weight_runs = s.layout.max_budget;
      d.weight_run = s.layout.chunk_size;
    }
    return LaunchDecodeAttention(d, on);
  };
  const int rows = plan.decode_rows;
  if (profiler) {
    // Timed one after the other.
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvScore(p, stream));
    SKV_RETURN_IF_ERROR(select_chunks(p, stream));
    SKV_RETURN_IF_ERROR(mark(OpKind::kSkvScoring));
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvFetchValues(p, stream));
    SKV_RETURN_IF_ERROR(mark(OpKind::kSkvFetch));
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvRebuildKeys(p, stream));
    SKV_RETURN_IF_ERROR(mark(OpKind::kSkvRebuild));
    SKV_CUDA_RETURN_IF_ERROR(attend(0, rows, stream));
    return mark(OpKind::kAttention);
  }
  // Select, the value fetch (possibly over PCIe) beside the key rebuild, then attention, for the
  // rows of `part` on `on`, the fetch on `fetch_on`.
  auto select_gather_attend = [&](const SkvDecodeParams& part, int first, cudaStream_t on,
                                  cudaStream_t fetch_on, cudaEvent_t fork, cudaEvent_t join) {
    SKV_RETURN_IF_ERROR(select_chunks(part, on));
    SKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork, on));
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(fetch_on, fork, 0));
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvFetchValues(part, fetch_on));
    SKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(join, fetch_on));
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvRebuildKeys(part, on));
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(on, join, 0));
    SKV_CUDA_RETURN_IF_ERROR(attend(first, part.rows, on));
    return Status::Ok();
  };
  if (rows < kSkvSplitMinRows || !settings.split_rows) {
    SKV_CUDA_RETURN_IF_ERROR(LaunchSkvScore(p, stream));
    return select_gather_attend(p, 0, stream, s.side_stream, s.fork, s.join);
  }
  // Two halves of the rows, the second's scoring after the first's: the first half's select (a
  // few blocks, latency-bound) runs beside the second half's scoring, the second half's select
  // beside the first half's rebuild, and the first half's attention beside the second's rebuild.
  const int half = std::clamp(rows * settings.split_share / 100, 1, rows - 1);
  const SkvDecodeParams first = SkvDecodeRows(p, 0, half);
  const SkvDecodeParams second = SkvDecodeRows(p, half, rows - half);
  SKV_CUDA_RETURN_IF_ERROR(LaunchSkvScore(first, stream));
  SKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.half.start, stream));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.half.stream, s.half.start, 0));
  SKV_CUDA_RETURN_IF_ERROR(LaunchSkvScore(second, s.half.stream));
  SKV_RETURN_IF_ERROR(select_gather_attend(second, half, s.half.stream, s.half.fetch_stream,
                                           s.half.fork, s.half.join));
  SKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.half.done, s.half.stream));
  SKV_RETURN_IF_ERROR(select_gather_attend(first, 0, stream, s.side_stream, s.fork, s.join));
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, s.half.done, 0));
  return Status::Ok();
}

Status CudaModel::Impl::ShadowKvDecodeStepImpl(std::span<const int> seq_list,
                                               std::span<int32_t> tokens,
                                               std::span<const CudaSampling> sampling,
                                               float* logits_out, StepProfiler* profiler) {
  SKV_RETURN_IF_ERROR(NeedShadowKv(*this));
  ShadowKvState& s = *skv;
  const int n = static_cast<int>(seq_list.size());
  if (n < 1 || n > options.max_batch) {
    return Error(ErrorCode::kInvalidArgument, "{} sequences in one step; the model takes 1 to {}",
                 n, options.max_batch);
  }
  if (static_cast<int>(tokens.size()) != n) {
    return Error(ErrorCode::kInvalidArgument, "{} tokens for {} sequences", tokens.size(), n);
  }
  std::vector<bool> seen(s.num_sequences, false);
  const SkvGeometry& g = s.geometry;
  uint8_t* block = s.host_meta_block;
  const int64_t batch = options.max_batch;
  auto* rows = reinterpret_cast<SkvRowMeta*>(block);
  auto* attn_rows = reinterpret_cast<int32_t*>(block + batch * sizeof(SkvRowMeta));
  auto* pre_rows = attn_rows + batch;
  auto* attn_last = pre_rows + batch;
  auto* window_rows = attn_last + batch;
  auto* window_last = window_rows + batch;
  auto* gather_first = window_last + batch;
  StepMeta& h = host_meta;
  for (int i = 0; i < n; ++i) {
    const int seq = seq_list[i];
    SKV_RETURN_IF_ERROR(CheckSeq(s, seq));
    if (seen[seq]) return Error(ErrorCode::kInvalidArgument, "sequence {} appears twice", seq);
    seen[seq] = true;
    if (s.lengths[seq] == 0) {
      return Error(ErrorCode::kInvalidArgument, "ShadowKV sequence {} holds no prompt", seq);
    }
    if (s.lengths[seq] + 1 > g.capacity_tokens) {
      return Error(ErrorCode::kOutOfRange, "ShadowKV sequence {} is full ({} tokens)", seq,
                   g.capacity_tokens);
    }
    if (tokens[i] < 0 || tokens[i] >= config.vocab_size) {
      return Error(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})",
                   tokens[i], config.vocab_size);
    }
    // Under select_drift the drift kernel decides per KV head (LaunchSkvDrift).
    rows[i] = PlanSkvRow(seq, s.lengths[seq], s.exact_first0[seq], s.host_info[seq], g.chunk_size,
                         g.local_window, g.drift() ? 1 : s.config.select_interval);
    attn_rows[i] = rows[i].attn_row;
    pre_rows[i] = rows[i].pre_row;
    attn_last[i] = rows[i].attn_last;
    gather_first[i] = s.host_info[seq].gather_base;
    if (g.window_layers > 0) {  // the ring row the token goes to, and the last it sees
      window_rows[i] = static_cast<int32_t>(s.lengths[seq] % g.window_rows);
      window_last[i] = static_cast<int32_t>(std::min<int64_t>(s.lengths[seq], g.window_rows - 1));
    }
    h.tokens[i] = tokens[i];
    h.slots[i] = seq;
    h.positions[i] = static_cast<int32_t>(s.lengths[seq]);
    h.logit_rows[i] = i;
  }
  SKV_RETURN_IF_ERROR(SetSampling(sampling, n));
  StepPlan plan;
  plan.rows = plan.decode_rows = plan.logit_rows = n;
  plan.sample = true;
  plan.shadowkv = true;
  plan.skv_graduates =
      std::any_of(rows, rows + n, [](const SkvRowMeta& row) { return row.graduate_chunk >= 0; });
  SKV_RETURN_IF_ERROR(Upload());
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.meta_block.get(), s.host_meta_block, s.meta_bytes,
                                           cudaMemcpyHostToDevice, stream));
  return ExecuteDecodeStep(plan, profiler, &s.graphs, seq_list, s.lengths, tokens, logits_out);
}

Status CudaModel::ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                                     std::span<const CudaSampling> sampling, float* logits_out) {
  return impl_->ShadowKvDecodeStepImpl(seqs, tokens, sampling, logits_out, nullptr);
}

Status CudaModel::ShadowKvDecodeStep(std::span<const int> seqs, std::span<int32_t> tokens,
                                     const CudaSampling& sampling, float* logits_out) {
  const std::vector<CudaSampling> each =
      impl_->SameForEveryRow(sampling, static_cast<int>(seqs.size()));
  return impl_->ShadowKvDecodeStepImpl(seqs, tokens, each, logits_out, nullptr);
}

Result<StepBreakdown> CudaModel::ProfileShadowKvDecodeStep(std::span<const int> seqs,
                                                           std::span<int32_t> tokens) {
  StepProfiler profiler;
  const std::vector<CudaSampling> greedy(seqs.size());
  SKV_RETURN_IF_ERROR(impl_->ShadowKvDecodeStepImpl(seqs, tokens, greedy, nullptr, &profiler));
  return profiler.Collect();
}

}  // namespace shadowkv::cuda
