// The CPU forward pass on tiny random models: against a naive fp64 transformer written here,
// chunked vs whole prefill, prefill vs decode paths, qwen2 biases, and bad model files.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/sampler.h"
#include "format/quants.h"
#include "model/cpu_model.h"
#include "tiny_model.h"

namespace shadowkv {
namespace {

using testing::SomeTokens;
using testing::TinyModelSpec;
using testing::WriteTinyModel;

std::vector<double> Dequant(const gguf::GgufFile& file, const std::string& name) {
  auto values = gguf::DequantizeTensor(*file.FindTensor(name)).value();
  return std::vector<double>(values.begin(), values.end());
}

// Naive fp64 llama/qwen2 forward over a whole prompt; returns logits [tokens, vocab].
std::vector<double> NaiveLogits(const CpuModel& model, const std::vector<int32_t>& tokens) {
  const auto& c = model.config();
  const auto& f = model.file();
  const int T = static_cast<int>(tokens.size()), H = c.hidden_size, D = c.head_dim;
  const int nq = c.num_query_heads, nkv = c.num_kv_heads, V = static_cast<int>(c.vocab_size);
  auto matmul = [](const std::vector<double>& x, int rows, int in, const std::vector<double>& w,
                   int out) {  // w is [out][in]
    std::vector<double> y(static_cast<size_t>(rows) * out, 0.0);
    for (int r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o) {
        double s = 0;
        for (int i = 0; i < in; ++i) s += x[r * in + i] * w[static_cast<size_t>(o) * in + i];
        y[r * out + o] = s;
      }
    return y;
  };
  auto norm = [&](const std::vector<double>& x, const std::vector<double>& w) {
    std::vector<double> y(x.size());
    for (int r = 0; r < T; ++r) {
      double ss = 0;
      for (int i = 0; i < H; ++i) ss += x[r * H + i] * x[r * H + i];
      const double scale = 1.0 / std::sqrt(ss / H + c.rms_norm_eps);
      for (int i = 0; i < H; ++i) y[r * H + i] = x[r * H + i] * scale * w[i];
    }
    return y;
  };
  auto rope = [&](std::vector<double>& x, int heads) {
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < D / 2; ++i) {
          const double angle = t * std::pow(c.rope.theta_base, -2.0 * i / D);
          const int a = c.rope.style == RopeConfig::Style::kPairs ? 2 * i : i;
          const int b = c.rope.style == RopeConfig::Style::kPairs ? 2 * i + 1 : i + D / 2;
          double* v = &x[(static_cast<size_t>(t) * heads + h) * D];
          const double x0 = v[a], x1 = v[b];
          v[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
          v[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
        }
  };
  std::vector<double> embd = Dequant(f, "token_embd.weight");
  std::vector<double> x(static_cast<size_t>(T) * H);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H; ++i) x[t * H + i] = embd[static_cast<size_t>(tokens[t]) * H + i];
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    auto xn = norm(x, Dequant(f, p + "attn_norm.weight"));
    auto q = matmul(xn, T, H, Dequant(f, p + "attn_q.weight"), nq * D);
    auto k = matmul(xn, T, H, Dequant(f, p + "attn_k.weight"), nkv * D);
    auto v = matmul(xn, T, H, Dequant(f, p + "attn_v.weight"), nkv * D);
    if (c.qkv_bias) {
      auto bq = Dequant(f, p + "attn_q.bias"), bk = Dequant(f, p + "attn_k.bias"),
           bv = Dequant(f, p + "attn_v.bias");
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < nq * D; ++i) q[t * nq * D + i] += bq[i];
        for (int i = 0; i < nkv * D; ++i) k[t * nkv * D + i] += bk[i], v[t * nkv * D + i] += bv[i];
      }
    }
    rope(q, nq);
    rope(k, nkv);
    std::vector<double> attn(static_cast<size_t>(T) * nq * D, 0.0);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < nq; ++h) {
        const int g = h / (nq / nkv);
        std::vector<double> w(t + 1);
        double mx = -1e300, sum = 0;
        for (int s = 0; s <= t; ++s) {
          double dot = 0;
          for (int i = 0; i < D; ++i) dot += q[(t * nq + h) * D + i] * k[(s * nkv + g) * D + i];
          w[s] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, w[s]);
        }
        for (auto& e : w) sum += (e = std::exp(e - mx));
        for (int s = 0; s <= t; ++s)
          for (int i = 0; i < D; ++i) attn[(t * nq + h) * D + i] += w[s] / sum * v[(s * nkv + g) * D + i];
      }
    auto o = matmul(attn, T, nq * D, Dequant(f, p + "attn_output.weight"), H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    xn = norm(x, Dequant(f, p + "ffn_norm.weight"));
    auto gate = matmul(xn, T, H, Dequant(f, p + "ffn_gate.weight"), c.ffn_size);
    auto up = matmul(xn, T, H, Dequant(f, p + "ffn_up.weight"), c.ffn_size);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
    auto down = matmul(gate, T, c.ffn_size, Dequant(f, p + "ffn_down.weight"), H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
  }
  auto xn = norm(x, Dequant(f, "output_norm.weight"));
  return matmul(xn, T, H, Dequant(f, c.tied_embeddings ? "token_embd.weight" : "output.weight"), V);
}

// Prefills `tokens` in chunks of `chunk` and returns every position's logits.
std::vector<float> PrefillLogits(CpuModel& model, const std::vector<int32_t>& tokens, int chunk) {
  auto policy = kv::MakeKvPolicy(kv::KvPolicyConfig{}, model.kv_geometry()).value();
  auto kv = policy->NewSequence().value();
  const int V = static_cast<int>(model.config().vocab_size);
  std::vector<float> logits(tokens.size() * V);
  for (size_t done = 0; done < tokens.size(); done += chunk) {
    const size_t count = std::min<size_t>(chunk, tokens.size() - done);
    StepInput in;
    in.kv = kv.get();
    in.tokens = std::span<const int32_t>(tokens.data() + done, count);
    in.logits = StepInput::Logits::kAll;
    in.logits_out = logits.data() + done * V;
    in.finish_prefill = done + count == tokens.size();
    EXPECT_TRUE(model.Forward(std::span<const StepInput>(&in, 1)).ok());
  }
  return logits;
}

void ExpectMatchesNaive(const TinyModelSpec& spec, const std::string& tag) {
  auto model = CpuModel::Load(WriteTinyModel(spec, tag), 2);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const auto tokens = SomeTokens(40, spec.seed);
  const auto expected = NaiveLogits(**model, tokens);
  const auto got = PrefillLogits(**model, tokens, 16);
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    max_err = std::max(max_err, std::abs(got[i] - expected[i]));
    max_ref = std::max(max_ref, std::abs(expected[i]));
  }
  EXPECT_LT(max_err, 1e-4 * std::max(1.0, max_ref)) << "max |logit| " << max_ref;
}

TEST(ModelForwardTest, LlamaPrefillMatchesNaiveFp64Transformer) {
  ExpectMatchesNaive(TinyModelSpec{}, "llama");
}

TEST(ModelForwardTest, Qwen2WithBiasAndUntiedOutputMatchesNaive) {
  TinyModelSpec spec;
  spec.architecture = "qwen2";
  spec.tied = false;
  spec.weight_type = gguf::GgmlType::kQ4_1;
  spec.seed = 5;
  ExpectMatchesNaive(spec, "qwen2");
}

TEST(ModelForwardTest, ChunkingDoesNotChangePrefill) {
  auto model = CpuModel::Load(WriteTinyModel(TinyModelSpec{}, "chunks"), 2).value();
  const auto tokens = SomeTokens(50, 3);
  const auto whole = PrefillLogits(*model, tokens, 64);
  const auto chunked = PrefillLogits(*model, tokens, 9);  // no 1-token (decode-path) chunk
  for (size_t i = 0; i < whole.size(); ++i) ASSERT_NEAR(whole[i], chunked[i], 1e-4);
}

// Asking for logits without a buffer for them is an error naming the input, not a write through
// a null pointer; asking for none needs no buffer.
TEST(ModelForwardTest, LogitsWithoutABufferAreRefused) {
  auto model = CpuModel::Load(WriteTinyModel(TinyModelSpec{}, "no_buffer"), 1).value();
  auto policy = kv::MakeKvPolicy(kv::KvPolicyConfig{}, model->kv_geometry()).value();
  auto kv = policy->NewSequence().value();
  const auto tokens = SomeTokens(5, 4);
  StepInput in;
  in.kv = kv.get();
  in.tokens = tokens;
  const Status refused = model->Forward(std::span<const StepInput>(&in, 1));
  EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("no buffer"), std::string::npos) << refused.ToString();
  EXPECT_EQ(kv->num_tokens(), 0);
  in.logits = StepInput::Logits::kNone;
  EXPECT_TRUE(model->Forward(std::span<const StepInput>(&in, 1)).ok());
  EXPECT_EQ(kv->num_tokens(), 5);
}

// Decode rows (mat-vec kernels) against prefill rows (GEMM) of the same tokens. In exact
// numerics they agree to fp32 summation order; int8 numerics round the decode activations to 8
// bits and the GEMM path's the same way, so they agree closely too.
void ExpectDecodeAgreesWithPrefill(Numerics numerics, double tolerance, int min_agree) {
  auto model =
      CpuModel::Load(WriteTinyModel(TinyModelSpec{}, "decode"), 2, numerics).value();
  const auto tokens = SomeTokens(30, 9);
  const auto prefill = PrefillLogits(*model, tokens, 64);
  auto policy = kv::MakeKvPolicy(kv::KvPolicyConfig{}, model->kv_geometry()).value();
  auto kv = policy->NewSequence().value();
  const int V = static_cast<int>(model->config().vocab_size);
  std::vector<float> logits(V);
  int agree = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    StepInput in;
    in.kv = kv.get();
    in.tokens = std::span<const int32_t>(&tokens[t], 1);
    in.logits_out = logits.data();
    ASSERT_TRUE(model->Forward(std::span<const StepInput>(&in, 1)).ok());
    double max_err = 0, max_ref = 0;
    for (int i = 0; i < V; ++i) {
      max_err = std::max<double>(max_err, std::abs(logits[i] - prefill[t * V + i]));
      max_ref = std::max<double>(max_ref, std::abs(prefill[t * V + i]));
    }
    EXPECT_LT(max_err, tolerance * max_ref) << "position " << t;
    agree += Argmax(logits) == Argmax(std::span<const float>(prefill.data() + t * V, V));
  }
  EXPECT_GE(agree, min_agree);
}

TEST(ModelForwardTest, ExactDecodePathMatchesPrefillPath) {
  ExpectDecodeAgreesWithPrefill(Numerics::kExact, 1e-5, 30);
}

TEST(ModelForwardTest, Int8DecodePathCloseToPrefillPath) {
  ExpectDecodeAgreesWithPrefill(Numerics::kInt8, 0.02, 27);
}

TEST(ModelForwardTest, BadModelsGiveClearErrors) {
  TinyModelSpec missing;
  missing.skip_ffn_down = true;
  auto result = CpuModel::Load(WriteTinyModel(missing, "missing"), 1);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("blk.0.ffn_down.weight"), std::string::npos)
      << result.status().ToString();

  TinyModelSpec unknown;
  unknown.architecture = "mamba";
  result = CpuModel::Load(WriteTinyModel(unknown, "arch"), 1);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(result.status().message().find("llama, qwen2"), std::string::npos);

  result = CpuModel::Load("/nonexistent/model.gguf", 1);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("/nonexistent/model.gguf"), std::string::npos);
}

}  // namespace
}  // namespace shadowkv
