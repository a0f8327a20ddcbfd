// CpuModel::Forward: the decoder block of every supported family over decode rows and prefill
// chunks.
#include "model/cpu_model.h"

#include <cblas.h>

#include <cmath>

#include "core/half.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/elementwise.h"
#include "ops/cpu/exact_matvec.h"
#include "ops/cpu/gemm.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace shadowkv {
namespace {

void RoundToFp16(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = Fp16ToFp32(Fp32ToFp16(x[i]));
}

// Attention with a window reads positions from the segments, so each must carry them.
Status CheckPositioned(const kv::AttentionInput& input, int layer) {
  for (const auto& segments : input.heads) {
    for (const KvSegment& s : segments) {
      if (!s.causal) {
        return Error(ErrorCode::kInternal,
                     "layer {} slides, but its KV policy prepared a segment without positions",
                     layer);
      }
    }
  }
  return Status::Ok();
}

}  // namespace

// Rows of a step in processing order: decode inputs first (one row each, contiguous so one
// mat-vec call serves them all), then the prefill inputs' rows.
struct CpuModel::Rows {
  std::vector<int> order;          // input indices in processing order
  std::vector<int64_t> first_row;  // [input] first row of the input
  std::vector<int64_t> position;   // [input] position of its first token
  int64_t decode_rows = 0;
  int64_t total = 0;
};

const char* NumericsName(Numerics numerics) {
  return numerics == Numerics::kExact ? "exact" : "int8";
}

Result<Numerics> ParseNumerics(const std::string& name) {
  if (name == "exact") return Numerics::kExact;
  if (name == "int8") return Numerics::kInt8;
  return Error(ErrorCode::kInvalidArgument, "numerics '{}' is not exact or int8", name);
}

Result<std::unique_ptr<CpuModel>> CpuModel::Load(const std::string& path, int num_threads,
                                                 Numerics numerics) {
  std::unique_ptr<CpuModel> model(new CpuModel());
  model->numerics_ = numerics;
  SKV_ASSIGN_OR_RETURN(model->file_, gguf::GgufFile::Open(path));
  SKV_ASSIGN_OR_RETURN(model->config_, ModelConfig::FromGguf(*model->file_));
  SKV_ASSIGN_OR_RETURN(model->tokenizer_, Tokenizer::FromGguf(*model->file_));
  if (model->tokenizer_->vocab_size() != model->config_.vocab_size) {
    return Error(ErrorCode::kCorrupt, "tokenizer has {} tokens but the embedding has {} rows",
                 model->tokenizer_->vocab_size(), model->config_.vocab_size);
  }
  SKV_ASSIGN_OR_RETURN(model->weights_, ModelWeights::Load(*model->file_, model->config_));
  // BLAS runs single-threaded inside our own pool's tasks.
  openblas_set_num_threads(1);
  model->pool_ = std::make_unique<ThreadPool>(num_threads);
  model->rope_ = std::make_unique<Rope>(model->config_.rope);
  if (model->config_.sliding_window > 0) {
    model->rope_windowed_ = std::make_unique<Rope>(model->config_.rope_windowed);
  }
  return model;
}

kv::KvGeometry KvGeometryOf(const ModelConfig& config) {
  kv::KvGeometry g;
  g.num_layers = config.num_layers;
  g.num_query_heads = config.num_query_heads;
  g.num_kv_heads = config.num_kv_heads;
  g.head_dim = config.head_dim;
  g.max_context = config.context_length;
  g.rope = config.rope;
  g.sliding_window = config.sliding_window;
  g.layer_windowed = config.layer_windowed;
  return g;
}

kv::KvGeometry CpuModel::kv_geometry() const { return KvGeometryOf(config_); }

void CpuModel::Linear(const LinearWeight& w, const float* x, float* y, const Rows& rows) {
  const int64_t out = w.out_features(), in = w.in_features();
  const bool exact = numerics_ == Numerics::kExact;
  if (rows.decode_rows > 0) {
    if (exact) {
      ExactMatVec(w.matrix, x, rows.decode_rows, y, *pool_);
    } else {
      QuantMatVec(w.matrix, x, rows.decode_rows, y, *pool_);
    }
  }
  const int64_t prefill_rows = rows.total - rows.decode_rows;
  if (prefill_rows > 0 && exact) {
    DequantGemm(w.matrix, x + rows.decode_rows * in, prefill_rows, y + rows.decode_rows * out,
                *pool_);
  } else if (prefill_rows > 0) {
    // Same rounding of the activations as the mat-vec kernel, so prefill and decode agree.
    rounded_.resize(prefill_rows * in);
    RoundActivations(w.matrix.type, x + rows.decode_rows * in, prefill_rows, in, rounded_.data());
    DequantGemm(w.matrix, rounded_.data(), prefill_rows, y + rows.decode_rows * out, *pool_);
  }
  if (!w.bias.empty()) AddBias(y, w.bias.data(), rows.total, static_cast<int>(out));
}

Status CpuModel::Forward(std::span<const StepInput> inputs) {
  const ModelConfig& c = config_;
  const int hidden = c.hidden_size;
  const int d = c.head_dim;
  const int q_width = c.num_query_heads * d;
  const int kv_width = c.num_kv_heads * d;
  const int n = static_cast<int>(inputs.size());

  // Plan rows and check every input before touching any state.
  Rows rows;
  rows.first_row.assign(n, 0);
  rows.position.assign(n, 0);
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < n; ++i) {
      if ((inputs[i].tokens.size() == 1) == (pass == 0)) rows.order.push_back(i);
    }
  }
  for (int i : rows.order) {
    const StepInput& in = inputs[i];
    if (!in.kv || in.tokens.empty()) {
      return Error(ErrorCode::kInvalidArgument, "step input {} has no KV state or no tokens", i);
    }
    if (in.logits != StepInput::Logits::kNone && in.logits_out == nullptr) {
      return Error(ErrorCode::kInvalidArgument,
                   "step input {} asks for logits but gives no buffer for them", i);
    }
    rows.first_row[i] = rows.total;
    rows.position[i] = in.kv->num_tokens();
    if (rows.position[i] + static_cast<int64_t>(in.tokens.size()) > c.context_length) {
      return Error(ErrorCode::kOutOfRange,
                   "sequence would hold {} tokens, more than the model's context of {}",
                   rows.position[i] + in.tokens.size(), c.context_length);
    }
    for (int32_t token : in.tokens) {
      if (token < 0 || token >= c.vocab_size) {
        return Error(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})",
                     token, c.vocab_size);
      }
    }
    if (in.tokens.size() == 1) rows.decode_rows++;
    rows.total += static_cast<int64_t>(in.tokens.size());
  }
  const int64_t total = rows.total;

  // Activations, [rows, width] each.
  std::vector<float> x(total * hidden), xn(total * hidden), q(total * q_width),
      k_pre(total * kv_width), k(total * kv_width), v(total * kv_width), attn(total * q_width),
      proj(total * hidden), gate(total * c.ffn_size), up(total * c.ffn_size);
  for (int i : rows.order) {
    for (size_t t = 0; t < inputs[i].tokens.size(); ++t) {
      DequantRow(weights_.token_embd, inputs[i].tokens[t],
                 x.data() + (rows.first_row[i] + t) * hidden);
    }
  }
  if (c.embedding_scale != 1.0f) {
    for (float& value : x) value *= c.embedding_scale;
  }

  std::vector<kv::AttentionInput> prepared(n);
  std::vector<Status> statuses(n);
  std::vector<AttentionJob> jobs(n);
  AttentionShape shape{c.num_query_heads, c.num_kv_heads, d, c.attention_scale};

  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    RmsNorm(x.data(), w.attn_norm.data(), total, hidden, c.rms_norm_eps, xn.data());
    Linear(w.q, xn.data(), q.data(), rows);
    Linear(w.k, xn.data(), k_pre.data(), rows);
    Linear(w.v, xn.data(), v.data(), rows);
    if (c.qk_norm) {  // per head, before RoPE: the policies see the normed pre-RoPE keys
      RmsNorm(q.data(), w.q_norm.data(), total * c.num_query_heads, d, c.rms_norm_eps, q.data());
      RmsNorm(k_pre.data(), w.k_norm.data(), total * c.num_kv_heads, d, c.rms_norm_eps,
              k_pre.data());
    }
    k = k_pre;
    const bool windowed = c.IsWindowed(layer);
    const Rope& rope = windowed ? *rope_windowed_ : *rope_;
    shape.window = windowed ? c.sliding_window : 0;
    for (int i : rows.order) {
      for (size_t t = 0; t < inputs[i].tokens.size(); ++t) {
        const int64_t r = rows.first_row[i] + t;
        rope.Apply(q.data() + r * q_width, c.num_query_heads, d, rows.position[i] + t);
        rope.Apply(k.data() + r * kv_width, c.num_kv_heads, d, rows.position[i] + t);
      }
    }
    if (numerics_ == Numerics::kInt8) {  // fp16 KV cache, as ggml's default
      RoundToFp16(k_pre.data(), total * kv_width);
      RoundToFp16(k.data(), total * kv_width);
      RoundToFp16(v.data(), total * kv_width);
    }
    // Each sequence's policy stores the new tokens and prepares what its queries read.
    pool_->ParallelFor(n, 1, [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) {
        const StepInput& in = inputs[i];
        const int64_t r = rows.first_row[i];
        kv::TokenBlock block;
        block.num_tokens = static_cast<int>(in.tokens.size());
        block.first_position = rows.position[i];
        block.keys_pre_rope = k_pre.data() + r * kv_width;
        block.keys = k.data() + r * kv_width;
        block.values = v.data() + r * kv_width;
        block.queries = q.data() + r * q_width;
        Status status = in.kv->Append(layer, block);
        if (status.ok()) {
          status = in.kv->Prepare(layer, block.queries, block.num_tokens, &prepared[i]);
        }
        if (status.ok() && windowed) status = CheckPositioned(prepared[i], layer);
        statuses[i] = status;
        jobs[i] = AttentionJob{block.queries, attn.data() + r * q_width, block.num_tokens,
                               block.first_position, &prepared[i]};
      }
    });
    for (const Status& s : statuses) SKV_RETURN_IF_ERROR(s);
    RunAttention(shape, jobs, *pool_);
    for (int i = 0; i < n; ++i) {
      if (inputs[i].finish_prefill) SKV_RETURN_IF_ERROR(inputs[i].kv->FinishPrefill(layer));
    }
    Linear(w.o, attn.data(), proj.data(), rows);
    if (c.post_norms) {
      RmsNorm(proj.data(), w.post_attn_norm.data(), total, hidden, c.rms_norm_eps, proj.data());
    }
    AddInPlace(x.data(), proj.data(), total * hidden);

    RmsNorm(x.data(), w.ffn_norm.data(), total, hidden, c.rms_norm_eps, xn.data());
    Linear(w.gate, xn.data(), gate.data(), rows);
    Linear(w.up, xn.data(), up.data(), rows);
    if (c.activation == FfnActivation::kGeluTanh) {
      GeluTanhGlu(gate.data(), up.data(), total * c.ffn_size);
    } else {
      SwiGlu(gate.data(), up.data(), total * c.ffn_size);
    }
    Linear(w.down, gate.data(), proj.data(), rows);
    if (c.post_norms) {
      RmsNorm(proj.data(), w.post_ffn_norm.data(), total, hidden, c.rms_norm_eps, proj.data());
    }
    AddInPlace(x.data(), proj.data(), total * hidden);
  }

  // Logits: last rows through the mat-vec kernel (as decode), whole inputs through the GEMM.
  std::vector<float> last_rows;
  std::vector<int> last_inputs;
  for (int i : rows.order) {
    const StepInput& in = inputs[i];
    const int64_t count = static_cast<int64_t>(in.tokens.size());
    const float* first = x.data() + rows.first_row[i] * hidden;
    if (in.logits == StepInput::Logits::kLast) {
      last_rows.resize(last_rows.size() + hidden);
      RmsNorm(first + (count - 1) * hidden, weights_.output_norm.data(), 1, hidden, c.rms_norm_eps,
              last_rows.data() + last_rows.size() - hidden);
      last_inputs.push_back(i);
    } else if (in.logits == StepInput::Logits::kAll) {
      std::vector<float> normed(count * hidden);
      RmsNorm(first, weights_.output_norm.data(), count, hidden, c.rms_norm_eps, normed.data());
      if (numerics_ == Numerics::kInt8) {
        RoundActivations(weights_.output.matrix.type, normed.data(), count, hidden, normed.data());
      }
      DequantGemm(weights_.output.matrix, normed.data(), count, in.logits_out, *pool_);
      SoftCap(in.logits_out, count * c.vocab_size, c.final_logit_softcap);
    }
  }
  if (!last_inputs.empty()) {
    std::vector<float> logits(last_inputs.size() * c.vocab_size);
    const int64_t count = static_cast<int64_t>(last_inputs.size());
    if (numerics_ == Numerics::kExact) {
      ExactMatVec(weights_.output.matrix, last_rows.data(), count, logits.data(), *pool_);
    } else {
      QuantMatVec(weights_.output.matrix, last_rows.data(), count, logits.data(), *pool_);
    }
    SoftCap(logits.data(), static_cast<int64_t>(logits.size()), c.final_logit_softcap);
    for (size_t j = 0; j < last_inputs.size(); ++j) {
      std::copy_n(logits.data() + j * c.vocab_size, c.vocab_size,
                  inputs[last_inputs[j]].logits_out);
    }
  }
  return Status::Ok();
}

}  // namespace shadowkv
