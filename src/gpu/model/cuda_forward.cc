// CudaModel's forward pass: the op sequence of one step, Forward (prefill chunks and decode rows),
// and graph-captured decode steps.
#include <algorithm>
#include <cmath>

#include "core/draw_noise.h"
#include "engine/sampler.h"
#include "gpu/model/cuda_model_impl.h"
#include "gpu/tp/communicator.h"
#include "ops/cuda/attention/decode_attention.cuh"
#include "ops/cuda/elementwise/embedding.cuh"
#include "ops/cuda/elementwise/gelu_tanh_glu.cuh"
#include "ops/cuda/elementwise/soft_cap.cuh"
#include "ops/cuda/elementwise/swiglu.cuh"
#include "ops/cuda/gemm/gemm.h"
#include "ops/cuda/norm/rmsnorm.cuh"
#include "ops/cuda/rope/qkv_rope.cuh"

namespace shadowkv::cuda {

float AttentionScaleOf(const ModelConfig& config) {
  return config.attention_scale > 0.0f ? config.attention_scale
                                       : 1.0f / std::sqrt(static_cast<float>(config.head_dim));
}

Status CudaModel::Impl::Upload() {
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_block.get(), host_meta_block, meta_bytes,
                                           cudaMemcpyHostToDevice, stream));
  return Status::Ok();
}

Status CudaModel::Impl::Gemm(const GemmParams& params, int role) {
  tp::Communicator* comm = options.communicator;
  if (comm == nullptr || comm->size() == 1) return RunGemm(cublas, params);
  const auto shape = std::make_pair(role, params.rows);
  if (gemm_shapes.count(shape) != 0) return RunGemm(cublas, params);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capturing));
  // While capturing nothing runs; what the stream held before the capture belongs to steps
  // every rank has finished issuing, so it drains on its own.
  if (capturing == cudaStreamCaptureStatusNone) {
    SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  SKV_RETURN_IF_ERROR(comm->HostBarrier());
  const Status ran = RunGemm(cublas, params);
  const Status met = comm->HostBarrier();  // even after a failure: the others wait here
  SKV_RETURN_IF_ERROR(ran);
  SKV_RETURN_IF_ERROR(met);
  gemm_shapes.insert(shape);
  return Status::Ok();
}

Status CudaModel::Impl::RunStep(const StepPlan& plan, StepProfiler* profiler) {
  const ModelConfig& c = config;
  auto mark = [&](OpKind kind) { return profiler ? profiler->Mark(kind, stream) : Status::Ok(); };
  // Tensor parallelism: each rank's W_o holds its heads' columns and its W_down its FFN units'
  // rows, so their products are partial sums of `rows` hidden rows, summed over the ranks in
  // fp32 (the residual stream's type). Nothing without a communicator.
  auto reduce_across_ranks = [&](float* partial, int rows) -> Status {
    if (!options.communicator) return Status::Ok();
    SKV_RETURN_IF_ERROR(options.communicator->AllReduceSum(partial, int64_t{rows} * c.hidden_size,
                                                           tp::ReduceType::kFloat32, stream));
    return mark(OpKind::kAllReduce);
  };
  // `role`: which of the step's GEMMs (0 QKV, 1 O, 2 gate|up, 3 down, 4 head), the same on
  // every rank (Gemm's first-of-a-shape rule keys on it).
  auto gemm = [&](int role, const Bf16* input, const Bf16* weight, void* output, GemmOutput type,
                  int64_t rows, int64_t in, int64_t out) {
    GemmParams g;
    g.x = input;
    g.weight = weight;
    g.y = output;
    g.output = type;
    g.rows = rows;
    g.in = in;
    g.out = out;
    return Gemm(g, role);
  };
  // x += delta (normalised with delta_weight first where that is not null: the post norms);
  // xn = norm(x)·weight, of the rows row_index names (all when null).
  auto norm = [&](const float* delta, const float* delta_weight, const float* weight,
                  const int32_t* row_index, int rows) {
    RmsNormParams n;
    n.x = x.get();
    n.delta = delta;
    n.delta_weight = delta_weight;
    n.weight = weight;
    n.out = xn.get();
    n.row_index = row_index;
    n.rows = rows;
    n.width = c.hidden_size;
    n.eps = c.rms_norm_eps;
    return LaunchRmsNorm(n, stream);
  };
  // A post norm's weights, or null where the model has none.
  auto post_norm = [](const DeviceBuffer<float>& weights) -> const float* {
    return weights.size() > 0 ? weights.get() : nullptr;
  };
  const float scale = AttentionScaleOf(c);
  const int rows = plan.rows;
  if (profiler) SKV_RETURN_IF_ERROR(mark(OpKind::kOther));  // the starting point

  EmbeddingParams embedding;
  embedding.tokens = meta.tokens;
  embedding.table = token_embd.get();
  embedding.out = x.get();
  embedding.rows = rows;
  embedding.hidden = c.hidden_size;
  embedding.scale = c.embedding_scale;
  SKV_CUDA_RETURN_IF_ERROR(LaunchEmbedding(embedding, stream));
  SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
  // ShadowKV: the chunks leaving the exact windows, every layer's, before any layer appends.
  if (plan.shadowkv) SKV_RETURN_IF_ERROR(RunShadowKvGraduation(plan, profiler));

  for (int layer = 0; layer < c.num_layers; ++layer) {
    const DeviceLayer& w = layers[layer];
    // Sliding-window layers read only the last sliding_window keys and rotate with their own
    // frequencies (gemma3's local base).
    const bool windowed = c.IsWindowed(layer);
    const int window = windowed ? static_cast<int>(c.sliding_window) : 0;
    // The previous layer's FFN output (after its post-FFN norm, where the model has one) joins
    // the residual stream inside the norm.
    SKV_CUDA_RETURN_IF_ERROR(norm(layer == 0 ? nullptr : proj.get(),
                                  layer == 0 ? nullptr : post_norm(layers[layer - 1].post_ffn_norm),
                                  w.attn_norm.get(), nullptr, rows));
    SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
    SKV_RETURN_IF_ERROR(gemm(0, xn.get(), w.qkv.get(), qkv.get(), GemmOutput::kFloat32, rows,
                             c.hidden_size, qkv_width));
    SKV_RETURN_IF_ERROR(mark(OpKind::kGemm));

    QkvRopeParams rope;
    rope.qkv = qkv.get();
    rope.bias = w.qkv_bias.size() > 0 ? w.qkv_bias.get() : nullptr;
    if (w.q_norm.size() > 0) {
      rope.q_norm = w.q_norm.get();
      rope.k_norm = w.k_norm.get();
      rope.norm_eps = c.rms_norm_eps;
    }
    rope.inv_freq = windowed ? inv_freq_windowed.get() : inv_freq.get();
    rope.positions = meta.positions;
    rope.slots = meta.slots;
    rope.queries = q.get();
    rope.cache = cache;
    rope.layer = layer;
    rope.rows = rows;
    rope.num_query_heads = c.num_query_heads;
    rope.num_kv_heads = c.num_kv_heads;
    rope.head_dim = c.head_dim;
    rope.rotary_dim = c.rope.rotary_dim;
    rope.halves = c.rope.style == RopeConfig::Style::kHalves;
    // ShadowKV rows: a global layer's token goes to its exact window (and its pre-RoPE key
    // beside it), a windowed layer's to that layer's ring; `part_layer` indexes either part.
    const bool skv_ring = plan.shadowkv && skv->parts.windowed[layer];
    const int part_layer = plan.shadowkv ? skv->parts.index[layer] : layer;
    if (skv_ring) {
      rope.cache = skv->window;
      rope.cache_rows = skv->window_rows;
      rope.layer = part_layer;
    } else if (plan.shadowkv) {
      rope.cache = skv->layout.attn;
      rope.cache_rows = skv->attn_rows;
      rope.layer = part_layer;
      rope.keys_pre = skv->layout.keys_pre;
      rope.keys_pre_capacity = skv->geometry.recent_capacity;
      rope.keys_pre_rows = skv->pre_rows;
    } else if (kv_keys_pre.size() > 0) {
      rope.keys_pre = kv_keys_pre.get();
      rope.keys_pre_capacity = cache.capacity;
    }
    SKV_CUDA_RETURN_IF_ERROR(LaunchQkvRope(rope, stream));
    SKV_RETURN_IF_ERROR(mark(OpKind::kOther));

    if (plan.shadowkv && !skv_ring) {
      SKV_RETURN_IF_ERROR(RunShadowKvAttention(plan, part_layer, profiler));
    } else if (plan.decode_rows > 0) {
      // The full cache's rows, a window masking the older ones; or a ShadowKV ring, which holds
      // exactly the window (rows 0 .. min(position, ring rows - 1), in any order).
      DecodeAttentionParams d;
      d.queries = q.get();
      d.cache = skv_ring ? skv->window : cache;
      d.layer = part_layer;
      d.slots = meta.slots;
      d.positions = skv_ring ? skv->window_last : meta.positions;
      d.partial_out = partial_out.get();
      d.partial_lse = partial_lse.get();
      d.out = attn.get();
      d.rows = plan.decode_rows;
      d.num_query_heads = c.num_query_heads;
      d.num_kv_heads = c.num_kv_heads;
      d.head_dim = c.head_dim;
      d.num_splits = DecodeNumSplits(
          plan.decode_rows, DecodeHeadBlocks(c.num_query_heads, c.num_kv_heads), target_blocks);
      d.scale = scale;
      d.window = skv_ring ? 0 : window;
      SKV_CUDA_RETURN_IF_ERROR(LaunchDecodeAttention(d, stream));
    }
    if (plan.num_prefill > 0 && !plan.shadowkv) {
      PrefillAttentionParams pa;
      pa.queries = q.get();
      pa.cache = cache;
      pa.layer = layer;
      pa.sequences = meta.sequences;
      pa.num_sequences = plan.num_prefill;
      pa.max_queries = plan.max_prefill_queries;
      pa.out = attn.get();
      pa.num_query_heads = c.num_query_heads;
      pa.num_kv_heads = c.num_kv_heads;
      pa.head_dim = c.head_dim;
      pa.scale = scale;
      pa.window = window;
      SKV_CUDA_RETURN_IF_ERROR(LaunchPrefillAttention(pa, stream));
    }
    SKV_RETURN_IF_ERROR(mark(OpKind::kAttention));

    SKV_RETURN_IF_ERROR(gemm(1, attn.get(), w.o.get(), proj.get(), GemmOutput::kFloat32, rows,
                             q_width, c.hidden_size));
    SKV_RETURN_IF_ERROR(mark(OpKind::kGemm));
    SKV_RETURN_IF_ERROR(reduce_across_ranks(proj.get(), rows));
    // The attention output (after the post-attention norm of the whole, summed rows) joins x.
    SKV_CUDA_RETURN_IF_ERROR(
        norm(proj.get(), post_norm(w.post_attn_norm), w.ffn_norm.get(), nullptr, rows));
    SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
    SKV_RETURN_IF_ERROR(gemm(2, xn.get(), w.gate_up.get(), gate_up.get(), GemmOutput::kBfloat16,
                             rows, c.hidden_size, 2ll * c.ffn_size));
    SKV_RETURN_IF_ERROR(mark(OpKind::kGemm));
    if (c.activation == FfnActivation::kGeluTanh) {
      GeluTanhGluParams glu;
      glu.gate_up = gate_up.get();
      glu.out = act.get();
      glu.rows = rows;
      glu.ffn = c.ffn_size;
      SKV_CUDA_RETURN_IF_ERROR(LaunchGeluTanhGlu(glu, stream));
    } else {
      SwiGluParams swiglu;
      swiglu.gate_up = gate_up.get();
      swiglu.out = act.get();
      swiglu.rows = rows;
      swiglu.ffn = c.ffn_size;
      SKV_CUDA_RETURN_IF_ERROR(LaunchSwiGlu(swiglu, stream));
    }
    SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
    SKV_RETURN_IF_ERROR(gemm(3, act.get(), w.down.get(), proj.get(), GemmOutput::kFloat32, rows,
                             c.ffn_size, c.hidden_size));
    SKV_RETURN_IF_ERROR(mark(OpKind::kGemm));
    SKV_RETURN_IF_ERROR(reduce_across_ranks(proj.get(), rows));
  }

  if (plan.logit_rows > 0) {
    // Only the rows whose logits are wanted get the last residual add, the norm and the head.
    SKV_CUDA_RETURN_IF_ERROR(norm(proj.get(), post_norm(layers.back().post_ffn_norm),
                                  output_norm.get(), meta.logit_rows, plan.logit_rows));
    SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
    SKV_RETURN_IF_ERROR(gemm(4, xn.get(), output, logits.get(), GemmOutput::kFloat32,
                             plan.logit_rows, c.hidden_size, c.vocab_size));
    SKV_RETURN_IF_ERROR(mark(OpKind::kGemm));
    if (c.final_logit_softcap > 0.0f) {  // before sampling, as the CPU caps what it returns
      SoftCapParams cap;
      cap.logits = logits.get();
      cap.count = int64_t{plan.logit_rows} * c.vocab_size;
      cap.cap = c.final_logit_softcap;
      SKV_CUDA_RETURN_IF_ERROR(LaunchSoftCap(cap, stream));
      SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
    }
    if (plan.sample) {
      SamplingParams sampling;
      sampling.logits = logits.get();
      sampling.controls = meta.controls;
      sampling.tokens = meta.next_tokens;
      sampling.rows = plan.logit_rows;
      sampling.vocab = static_cast<int>(c.vocab_size);
      SKV_CUDA_RETURN_IF_ERROR(LaunchSampling(sampling, stream));
      SKV_RETURN_IF_ERROR(mark(OpKind::kOther));
    }
  }
  return Status::Ok();
}

Status CudaModel::Impl::CheckSlots(std::span<const int> slots) const {
  if (cache.num_slots == 0) {
    return Error(ErrorCode::kInvalidArgument, "no KV cache: call AllocateKvCache first");
  }
  if (slots.empty() || static_cast<int>(slots.size()) > options.max_batch) {
    return Error(ErrorCode::kInvalidArgument, "{} sequences in one step; the model takes 1 to {}",
                 slots.size(), options.max_batch);
  }
  std::vector<bool> seen(cache.num_slots, false);
  for (int slot : slots) {
    if (slot < 0 || slot >= cache.num_slots) {
      return Error(ErrorCode::kInvalidArgument, "slot {} is outside [0, {})", slot,
                   cache.num_slots);
    }
    if (seen[slot]) return Error(ErrorCode::kInvalidArgument, "slot {} appears twice", slot);
    seen[slot] = true;
  }
  return Status::Ok();
}

Result<SamplingControl> ToSamplingControl(const CudaSampling& sampling, const std::string& where) {
  const shadowkv::SamplingParams params{sampling.temperature, sampling.top_k, sampling.top_p,
                                        sampling.seed};
  const Status valid = params.Validate();
  if (!valid.ok()) return Error(valid.code(), "{}: {}", where, valid.message());
  SamplingControl control;
  control.temperature = sampling.temperature;
  control.top_k = sampling.top_k;
  control.top_p = sampling.top_p;
  control.seed = sampling.seed;
  control.draw = sampling.draw;
  return control;
}

Status CudaModel::Impl::SetSampling(std::span<const CudaSampling> sampling, int rows) {
  if (static_cast<int>(sampling.size()) != rows) {
    return Error(ErrorCode::kInvalidArgument, "{} sampling settings for {} rows", sampling.size(),
                 rows);
  }
  for (int i = 0; i < rows; ++i) {
    SKV_ASSIGN_OR_RETURN(host_meta.controls[i],
                         ToSamplingControl(sampling[i], fmt::format("sampling of row {}", i)));
  }
  return Status::Ok();
}

std::vector<CudaSampling> CudaModel::Impl::SameForEveryRow(const CudaSampling& sampling, int rows) {
  std::vector<CudaSampling> each(std::max(rows, 0), sampling);
  for (int i = 0; i < rows; ++i) {
    each[i].seed = RowSeed(sampling.seed, static_cast<uint64_t>(i));
    each[i].draw = sample_step;
  }
  ++sample_step;
  return each;
}

Status CudaModel::Forward(std::span<const CudaStepInput> inputs) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  std::vector<int> slots;
  for (const CudaStepInput& in : inputs) slots.push_back(in.slot);
  SKV_RETURN_IF_ERROR(m.CheckSlots(slots));
  int64_t total = 0;
  int logit_copies = 0;  // inputs with logits_out: the first logit rows, copied to the host
  std::vector<SamplingControl> controls(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const CudaStepInput& in = inputs[i];
    if (in.tokens.empty()) {
      return Error(ErrorCode::kInvalidArgument, "slot {} has no new tokens", in.slot);
    }
    if (in.sample) {
      if (!in.token_out) {
        return Error(ErrorCode::kInvalidArgument, "slot {}: a sample without a token_out", in.slot);
      }
      SKV_ASSIGN_OR_RETURN(
          controls[i], ToSamplingControl(*in.sample, fmt::format("sampling of slot {}", in.slot)));
    }
    if (in.logits_out) ++logit_copies;
    const int64_t end = m.lengths[in.slot] + static_cast<int64_t>(in.tokens.size());
    if (end > m.cache.capacity) {
      return Error(ErrorCode::kOutOfRange, "slot {} would hold {} tokens; its capacity is {}",
                   in.slot, end, m.cache.capacity);
    }
    for (int32_t token : in.tokens) {
      if (token < 0 || token >= c.vocab_size) {
        return Error(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})",
                     token, c.vocab_size);
      }
    }
    total += static_cast<int64_t>(in.tokens.size());
  }
  if (total > m.max_rows) {
    return Error(ErrorCode::kInvalidArgument, "{} tokens in one step; the model takes at most {}",
                 total, m.max_rows);
  }

  // Rows: decode inputs first (one row each), then the prefill chunks.
  StepPlan plan;
  StepMeta& h = m.host_meta;
  std::vector<std::pair<int, int>> wanted;   // (input, logit row) of the logits_out inputs
  std::vector<std::pair<int, int>> sampled;  // (input, logit row) of the inputs with sample
  int sample_only_row = logit_copies;        // the logit rows after the copied ones
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < static_cast<int>(inputs.size()); ++i) {
      const CudaStepInput& in = inputs[i];
      const int count = static_cast<int>(in.tokens.size());
      if ((count == 1) != (pass == 0)) continue;
      const int first_row = plan.rows;
      const int first_position = static_cast<int>(m.lengths[in.slot]);
      for (int t = 0; t < count; ++t) {
        h.tokens[plan.rows] = in.tokens[t];
        h.slots[plan.rows] = in.slot;
        h.positions[plan.rows] = first_position + t;
        ++plan.rows;
      }
      if (count == 1) {
        ++plan.decode_rows;
      } else {
        h.sequences[plan.num_prefill++] =
            PrefillSequence{first_row, count, first_position, in.slot};
        plan.max_prefill_queries = std::max(plan.max_prefill_queries, count);
      }
      if (in.logits_out || in.sample) {
        const int logit_row = in.logits_out ? static_cast<int>(wanted.size()) : sample_only_row++;
        if (in.logits_out) wanted.emplace_back(i, logit_row);
        if (in.sample) sampled.emplace_back(i, logit_row);
        h.logit_rows[logit_row] = plan.rows - 1;
        h.controls[logit_row] = controls[i];  // greedy (unused) for rows without sample
        ++plan.logit_rows;
      }
    }
  }
  plan.sample = !sampled.empty();
  SKV_RETURN_IF_ERROR(m.Upload());
  SKV_RETURN_IF_ERROR(m.RunStep(plan, nullptr));
  if (logit_copies > 0) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.host_logits, m.logits.get(),
                                             logit_copies * c.vocab_size * sizeof(float),
                                             cudaMemcpyDeviceToHost, m.stream));
  }
  if (plan.sample) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h.next_tokens, m.meta.next_tokens,
                                             plan.logit_rows * sizeof(int32_t),
                                             cudaMemcpyDeviceToHost, m.stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  for (auto [input, logit_row] : wanted) {
    std::copy_n(m.host_logits + logit_row * c.vocab_size, c.vocab_size, inputs[input].logits_out);
  }
  for (auto [input, logit_row] : sampled) *inputs[input].token_out = h.next_tokens[logit_row];
  for (const CudaStepInput& in : inputs)
    m.lengths[in.slot] += static_cast<int64_t>(in.tokens.size());
  return Status::Ok();
}

Status CudaModel::Impl::ExecuteDecodeStep(const StepPlan& plan, StepProfiler* profiler,
                                          std::map<int, cudaGraphExec_t>* graphs,
                                          std::span<const int> ids, std::vector<int64_t>& lengths,
                                          std::span<int32_t> tokens, float* logits_out) {
  const int n = static_cast<int>(tokens.size());
  StepMeta& h = host_meta;
  if (profiler == nullptr && options.use_graphs) {
    // ShadowKV steps without graduation have a graph of their own (key -n).
    const int key = plan.shadowkv && !plan.skv_graduates ? -n : n;
    auto found = graphs->find(key);
    if (found == graphs->end()) {
      SKV_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const Status captured = RunStep(plan, nullptr);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
      if (!captured.ok()) {
        if (graph) (void)cudaGraphDestroy(graph);
        return captured;
      }
      SKV_CUDA_RETURN_IF_ERROR(ended);
      cudaGraphExec_t exec = nullptr;
      const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
      (void)cudaGraphDestroy(graph);
      SKV_CUDA_RETURN_IF_ERROR(instantiated);
      found = graphs->emplace(key, exec).first;
      // Tensor parallelism: every rank has its graph before any starts (see HostBarrier).
      if (options.communicator) SKV_RETURN_IF_ERROR(options.communicator->HostBarrier());
    }
    SKV_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(found->second, stream));
  } else {
    SKV_RETURN_IF_ERROR(RunStep(plan, profiler));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h.next_tokens, meta.next_tokens, n * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, stream));
  if (logits_out) {
    SKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_logits, logits.get(),
                                             n * config.vocab_size * sizeof(float),
                                             cudaMemcpyDeviceToHost, stream));
  }
  SKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (logits_out) std::copy_n(host_logits, n * config.vocab_size, logits_out);
  for (int i = 0; i < n; ++i) tokens[i] = h.next_tokens[i];
  for (const int id : ids) ++lengths[id];
  return Status::Ok();
}

Status CudaModel::Impl::DecodeStepImpl(std::span<const int> slot_list, std::span<int32_t> tokens,
                                       std::span<const CudaSampling> sampling, float* logits_out,
                                       StepProfiler* profiler) {
  SKV_RETURN_IF_ERROR(CheckSlots(slot_list));
  const int n = static_cast<int>(slot_list.size());
  if (static_cast<int>(tokens.size()) != n) {
    return Error(ErrorCode::kInvalidArgument, "{} tokens for {} sequences", tokens.size(), n);
  }
  for (int i = 0; i < n; ++i) {
    if (lengths[slot_list[i]] + 1 > cache.capacity) {
      return Error(ErrorCode::kOutOfRange, "slot {} is full ({} tokens)", slot_list[i],
                   cache.capacity);
    }
    if (tokens[i] < 0 || tokens[i] >= config.vocab_size) {
      return Error(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})",
                   tokens[i], config.vocab_size);
    }
  }
  SKV_RETURN_IF_ERROR(SetSampling(sampling, n));
  StepMeta& h = host_meta;
  for (int i = 0; i < n; ++i) {
    h.tokens[i] = tokens[i];
    h.slots[i] = slot_list[i];
    h.positions[i] = static_cast<int32_t>(lengths[slot_list[i]]);
    h.logit_rows[i] = i;
  }
  StepPlan plan;
  plan.rows = plan.decode_rows = plan.logit_rows = n;
  plan.sample = true;
  SKV_RETURN_IF_ERROR(Upload());

  return ExecuteDecodeStep(plan, profiler, &graphs, slot_list, lengths, tokens, logits_out);
}

Status CudaModel::DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                             std::span<const CudaSampling> sampling, float* logits_out) {
  return impl_->DecodeStepImpl(slots, tokens, sampling, logits_out, nullptr);
}

Status CudaModel::DecodeStep(std::span<const int> slots, std::span<int32_t> tokens,
                             const CudaSampling& sampling, float* logits_out) {
  const std::vector<CudaSampling> each =
      impl_->SameForEveryRow(sampling, static_cast<int>(slots.size()));
  return impl_->DecodeStepImpl(slots, tokens, each, logits_out, nullptr);
}

Result<StepBreakdown> CudaModel::ProfileDecodeStep(std::span<const int> slots,
                                                   std::span<int32_t> tokens) {
  StepProfiler profiler;
  const std::vector<CudaSampling> greedy(slots.size());
  SKV_RETURN_IF_ERROR(impl_->DecodeStepImpl(slots, tokens, greedy, nullptr, &profiler));
  return profiler.Collect();
}

}  // namespace shadowkv::cuda
