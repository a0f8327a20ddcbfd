// ModelWeights::Load: tensor names and shapes of the supported layouts in GGUF (llama.cpp names).
#include "model/weights.h"

#include "format/quants.h"

namespace shadowkv {
namespace {

Result<const gguf::TensorInfo*> FindShaped(const gguf::GgufFile& file, const std::string& name,
                                           std::vector<int64_t> shape) {
  const gguf::TensorInfo* t = file.FindTensor(name);
  if (!t) return Error(ErrorCode::kNotFound, "tensor '{}' is missing from {}", name, file.path());
  if (t->shape != shape) {
    return Error(ErrorCode::kCorrupt, "tensor '{}' has shape [{}], expected [{}]", name,
                 fmt::join(t->shape, ", "), fmt::join(shape, ", "));
  }
  return t;
}

Result<std::vector<float>> LoadVector(const gguf::GgufFile& file, const std::string& name,
                                      int64_t size) {
  SKV_ASSIGN_OR_RETURN(const gguf::TensorInfo* t, FindShaped(file, name, {size}));
  return gguf::DequantizeTensor(*t);
}

// Binds a [in, out] GGUF matrix (row length `in`) as a [out, in] QuantMatrix.
Result<QuantMatrix> BindMatrix(const gguf::TensorInfo& t) {
  auto traits = gguf::GetTypeTraits(static_cast<uint32_t>(t.type));
  if (!traits.ok()) return traits.status();
  std::vector<float> probe(t.row_length());
  // Every weight type must at least dequantise (the GEMM path and repacking need it).
  Status status = gguf::DequantizeRow(t.type, t.data, probe.data(), t.row_length());
  if (!status.ok()) {
    return Error(ErrorCode::kUnsupported, "tensor '{}': {}", t.name, status.message());
  }
  return QuantMatrix{t.type, t.data, t.rows(), t.row_length(), t.row_bytes()};
}

Result<LinearWeight> LoadLinear(const gguf::GgufFile& file, const std::string& name, int64_t in,
                                int64_t out, bool with_bias) {
  SKV_ASSIGN_OR_RETURN(const gguf::TensorInfo* t, FindShaped(file, name + ".weight", {in, out}));
  LinearWeight linear;
  SKV_ASSIGN_OR_RETURN(linear.matrix, BindMatrix(*t));
  if (!QuantMatVecSupports(linear.matrix.type)) {
    if (in % 32 != 0) {
      return Error(ErrorCode::kUnsupported,
                   "tensor '{}': type {} with row length {} (not a multiple of 32) cannot be "
                   "repacked",
                   t->name, gguf::TypeName(t->type), in);
    }
    SKV_ASSIGN_OR_RETURN(std::vector<float> dense, gguf::DequantizeTensor(*t));
    linear.repacked = QuantizeRowsQ8_0(dense.data(), out, in);
    linear.matrix = QuantMatrix{gguf::GgmlType::kQ8_0, linear.repacked.data(), out, in,
                                QuantRowBytes(gguf::GgmlType::kQ8_0, in)};
  } else {
    // Used as stored, so nothing else decodes it before the first step reads it.
    SKV_RETURN_IF_ERROR(gguf::CheckTensorFinite(*t));
  }
  if (with_bias) {
    SKV_ASSIGN_OR_RETURN(linear.bias, LoadVector(file, name + ".bias", out));
  }
  return linear;
}

// A fused [in, sum(parts)] tensor (phi3's attn_qkv, ffn_up) as one linear layer per part, each
// the part's rows of the fused matrix (and bias).
Result<std::vector<LinearWeight>> LoadFusedLinear(const gguf::GgufFile& file,
                                                  const std::string& name, int64_t in,
                                                  std::vector<int64_t> parts, bool with_bias) {
  int64_t total = 0;
  for (int64_t part : parts) total += part;
  SKV_ASSIGN_OR_RETURN(LinearWeight fused, LoadLinear(file, name, in, total, with_bias));
  std::vector<LinearWeight> split(parts.size());
  int64_t first = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const size_t row_bytes = fused.matrix.row_bytes;
    const uint8_t* rows = fused.matrix.data + first * row_bytes;
    LinearWeight& w = split[i];
    if (!fused.repacked.empty()) {  // each part owns its copy of the repacked rows
      w.repacked.assign(rows, rows + parts[i] * row_bytes);
      rows = w.repacked.data();
    }
    w.matrix = QuantMatrix{fused.matrix.type, rows, parts[i], in, row_bytes};
    if (with_bias) {
      w.bias.assign(fused.bias.begin() + first, fused.bias.begin() + first + parts[i]);
    }
    first += parts[i];
  }
  return split;
}

}  // namespace

Result<ModelWeights> ModelWeights::Load(const gguf::GgufFile& file, const ModelConfig& c) {
  ModelWeights w;
  const int64_t hidden = c.hidden_size;
  const int64_t q_width = static_cast<int64_t>(c.num_query_heads) * c.head_dim;
  const int64_t kv_width = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  SKV_ASSIGN_OR_RETURN(const gguf::TensorInfo* embd,
                       FindShaped(file, "token_embd.weight", {hidden, c.vocab_size}));
  SKV_ASSIGN_OR_RETURN(w.token_embd, BindMatrix(*embd));
  if (c.tied_embeddings) {
    // Loading it as the output layer checks its values too.
    SKV_ASSIGN_OR_RETURN(w.output, LoadLinear(file, "token_embd", hidden, c.vocab_size, false));
  } else {
    SKV_RETURN_IF_ERROR(gguf::CheckTensorFinite(*embd));
    SKV_ASSIGN_OR_RETURN(w.output, LoadLinear(file, "output", hidden, c.vocab_size, false));
  }
  SKV_ASSIGN_OR_RETURN(w.output_norm, LoadVector(file, "output_norm.weight", hidden));
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    LayerWeights layer;
    SKV_ASSIGN_OR_RETURN(layer.attn_norm, LoadVector(file, p + "attn_norm.weight", hidden));
    SKV_ASSIGN_OR_RETURN(layer.ffn_norm, LoadVector(file, p + "ffn_norm.weight", hidden));
    if (c.qk_norm) {
      SKV_ASSIGN_OR_RETURN(layer.q_norm, LoadVector(file, p + "attn_q_norm.weight", c.head_dim));
      SKV_ASSIGN_OR_RETURN(layer.k_norm, LoadVector(file, p + "attn_k_norm.weight", c.head_dim));
    }
    if (c.post_norms) {
      SKV_ASSIGN_OR_RETURN(layer.post_attn_norm,
                           LoadVector(file, p + "post_attention_norm.weight", hidden));
      SKV_ASSIGN_OR_RETURN(layer.post_ffn_norm,
                           LoadVector(file, p + "post_ffw_norm.weight", hidden));
    }
    if (c.fused_qkv) {
      SKV_ASSIGN_OR_RETURN(
          std::vector<LinearWeight> qkv,
          LoadFusedLinear(file, p + "attn_qkv", hidden, {q_width, kv_width, kv_width}, c.qkv_bias));
      layer.q = std::move(qkv[0]);
      layer.k = std::move(qkv[1]);
      layer.v = std::move(qkv[2]);
    } else {
      SKV_ASSIGN_OR_RETURN(layer.q, LoadLinear(file, p + "attn_q", hidden, q_width, c.qkv_bias));
      SKV_ASSIGN_OR_RETURN(layer.k, LoadLinear(file, p + "attn_k", hidden, kv_width, c.qkv_bias));
      SKV_ASSIGN_OR_RETURN(layer.v, LoadLinear(file, p + "attn_v", hidden, kv_width, c.qkv_bias));
    }
    SKV_ASSIGN_OR_RETURN(layer.o, LoadLinear(file, p + "attn_output", q_width, hidden, false));
    if (c.fused_gate_up) {
      SKV_ASSIGN_OR_RETURN(
          std::vector<LinearWeight> gate_up,
          LoadFusedLinear(file, p + "ffn_up", hidden, {c.ffn_size, c.ffn_size}, false));
      layer.gate = std::move(gate_up[0]);
      layer.up = std::move(gate_up[1]);
    } else {
      SKV_ASSIGN_OR_RETURN(layer.gate, LoadLinear(file, p + "ffn_gate", hidden, c.ffn_size, false));
      SKV_ASSIGN_OR_RETURN(layer.up, LoadLinear(file, p + "ffn_up", hidden, c.ffn_size, false));
    }
    SKV_ASSIGN_OR_RETURN(layer.down, LoadLinear(file, p + "ffn_down", c.ffn_size, hidden, false));
    w.layers.push_back(std::move(layer));
  }
  return w;
}

int64_t ModelWeights::ByteSize() const {
  auto bytes = [](const LinearWeight& l) {
    return static_cast<int64_t>(l.matrix.rows * l.matrix.row_bytes);
  };
  int64_t total = bytes(output);
  for (const auto& l : layers) {
    total += bytes(l.q) + bytes(l.k) + bytes(l.v) + bytes(l.o) + bytes(l.gate) + bytes(l.up) +
             bytes(l.down);
  }
  return total;
}

}  // namespace shadowkv
