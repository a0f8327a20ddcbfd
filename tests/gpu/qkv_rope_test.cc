// GPU bias + QK norm + RoPE + KV-cache append against the CPU ops (AddBias, RmsNorm per head,
// Rope::Apply), both rotation styles, partial rotary dims, per-pair frequency factors, large
// positions, and head dims from 16 to 256.
#include "ops/cuda/rope/qkv_rope.cuh"

#include "core/rope.h"
#include "gpu_test_util.h"
#include "ops/cpu/elementwise.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

struct QkvCase {
  RopeConfig::Style style = RopeConfig::Style::kPairs;
  int rotary_dim = 128;
  bool with_bias = false;
  int head_dim = 128;
  bool qk_norm = false;
  std::vector<float> freq_factors;  // LongRoPE-style divisors, or empty
};

void CheckQkvRope(const QkvCase& t) {
  const RopeConfig::Style style = t.style;
  const int rotary_dim = t.rotary_dim, head_dim = t.head_dim;
  const bool with_bias = t.with_bias;
  std::mt19937 rng(rotary_dim * 3 + (with_bias ? 1 : 0) + static_cast<int>(style) * 100 +
                   head_dim * 7 + (t.qk_norm ? 5 : 0));
  const int num_query_heads = 8, num_kv_heads = 2;
  const int q_width = num_query_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const int width = q_width + 2 * kv_width;
  const std::vector<int32_t> positions = {0, 3, 1000, 65535, 70000, 126000};
  const std::vector<int32_t> slots = {0, 1, 1, 0, 1, 0};
  const int rows = static_cast<int>(positions.size());
  const int layer = 1;

  RopeConfig config;
  config.rotary_dim = rotary_dim;
  config.theta_base = 500000.0f;
  config.style = style;
  config.freq_factors = t.freq_factors;
  const Rope rope(config);
  std::vector<float> inv_freq(rotary_dim / 2);
  for (int i = 0; i < rotary_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / rotary_dim) /
                                     (t.freq_factors.empty() ? 1.0 : t.freq_factors[i]));
  }

  const std::vector<float> qkv = RandomFloats(static_cast<int64_t>(rows) * width, rng);
  const std::vector<float> bias = RandomFloats(width, rng, 0.1f);
  const std::vector<float> q_norm = RandomFloats(head_dim, rng, 0.2f, 1.0f);
  const std::vector<float> k_norm = RandomFloats(head_dim, rng, 0.2f, 0.7f);
  KvCacheView cache;
  cache.num_slots = 2;
  cache.num_layers = 2;
  cache.num_kv_heads = num_kv_heads;
  cache.head_dim = head_dim;
  cache.capacity = 126001;
  const int64_t cache_count = cache.HeadOffset(cache.num_slots, 0, 0);
  auto keys = Poisoned<uint16_t>(cache_count);
  auto values = Poisoned<uint16_t>(cache_count);
  cache.keys = reinterpret_cast<__nv_bfloat16*>(keys.get());
  cache.values = reinterpret_cast<__nv_bfloat16*>(values.get());
  auto device_qkv = ToDevice(qkv);
  auto device_bias = ToDevice(bias);
  auto device_q_norm = ToDevice(q_norm);
  auto device_k_norm = ToDevice(k_norm);
  auto device_freq = ToDevice(inv_freq);
  auto device_positions = ToDevice(positions);
  auto device_slots = ToDevice(slots);
  auto queries = Poisoned<uint16_t>(static_cast<int64_t>(rows) * q_width);

  QkvRopeParams p;
  p.qkv = device_qkv.get();
  p.bias = with_bias ? device_bias.get() : nullptr;
  if (t.qk_norm) {
    p.q_norm = device_q_norm.get();
    p.k_norm = device_k_norm.get();
    p.norm_eps = 1e-6f;
  }
  p.inv_freq = device_freq.get();
  p.positions = device_positions.get();
  p.slots = device_slots.get();
  p.queries = reinterpret_cast<__nv_bfloat16*>(queries.get());
  p.cache = cache;
  p.layer = layer;
  p.rows = rows;
  p.num_query_heads = num_query_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.rotary_dim = rotary_dim;
  p.halves = style == RopeConfig::Style::kHalves;
  SKV_ASSERT_CUDA(LaunchQkvRope(p, nullptr));
  const std::vector<float> got_q = ToHostBf16(queries);
  const std::vector<uint16_t> got_keys = ToHost(keys), got_values = ToHost(values);

  // CPU: bias, the QK norm of each q and k head, then RoPE of q and k at each row's position; v
  // as is.
  std::vector<float> want = qkv;
  if (with_bias) AddBias(want.data(), bias.data(), rows, width);
  std::vector<float> got_k, want_k, got_v, want_v;
  for (int r = 0; r < rows; ++r) {
    float* row = want.data() + static_cast<int64_t>(r) * width;
    if (t.qk_norm) {
      RmsNorm(row, q_norm.data(), num_query_heads, head_dim, 1e-6f, row);
      RmsNorm(row + q_width, k_norm.data(), num_kv_heads, head_dim, 1e-6f, row + q_width);
    }
    rope.Apply(row, num_query_heads, head_dim, positions[r]);
    rope.Apply(row + q_width, num_kv_heads, head_dim, positions[r]);
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t at = cache.HeadOffset(slots[r], layer, h) +
                         static_cast<int64_t>(positions[r]) * head_dim;
      for (int d = 0; d < head_dim; ++d) {
        got_k.push_back(Bf16ToFp32(got_keys[at + d]));
        got_v.push_back(Bf16ToFp32(got_values[at + d]));
        want_k.push_back(row[q_width + h * head_dim + d]);
        want_v.push_back(row[q_width + kv_width + h * head_dim + d]);
      }
    }
  }
  std::vector<float> want_q;
  for (int r = 0; r < rows; ++r) {
    const float* row = want.data() + static_cast<int64_t>(r) * width;
    want_q.insert(want_q.end(), row, row + q_width);
  }
  EXPECT_LT(RelativeError(got_q, want_q), kBf16OutputTolerance);
  EXPECT_LT(RelativeError(got_k, want_k), kBf16OutputTolerance);
  EXPECT_LT(RelativeError(got_v, want_v), kBf16OutputTolerance);
  // Nothing but the rows' own cache entries was written.
  int64_t written = 0;
  for (uint16_t bits : got_keys) written += bits != 0xFFFF;
  EXPECT_EQ(written, static_cast<int64_t>(rows) * kv_width);
}

// A case with the given rotation, and head dim 128, no QK norm, no frequency factors unless set.
QkvCase Case(RopeConfig::Style style, int rotary_dim, bool with_bias, int head_dim = 128,
             bool qk_norm = false) {
  QkvCase c;
  c.style = style;
  c.rotary_dim = rotary_dim;
  c.with_bias = with_bias;
  c.head_dim = head_dim;
  c.qk_norm = qk_norm;
  return c;
}

TEST(CudaQkvRopeTest, PairsStyleWithBias) {
  SKV_SKIP_WITHOUT_GPU();
  CheckQkvRope(Case(RopeConfig::Style::kPairs, 128, true));
}

TEST(CudaQkvRopeTest, HalvesStyle) {
  SKV_SKIP_WITHOUT_GPU();
  CheckQkvRope(Case(RopeConfig::Style::kHalves, 128, false));
}

TEST(CudaQkvRopeTest, PartialRotaryDimsPassThrough) {
  SKV_SKIP_WITHOUT_GPU();
  CheckQkvRope(Case(RopeConfig::Style::kPairs, 64, true));
  CheckQkvRope(Case(RopeConfig::Style::kHalves, 32, true));
  // GLM-4's tiny model: head dim 16, the first 8 dims rotated in interleaved pairs, biases.
  CheckQkvRope(Case(RopeConfig::Style::kPairs, 8, true, 16));
}

// The per-head norm reduces over whole warps (head dim 64 and 128) or within one (32 and 16,
// Gemma 3's tiny model and smaller).
TEST(CudaQkvRopeTest, QkNormEveryHeadDim) {
  SKV_SKIP_WITHOUT_GPU();
  for (int head_dim : {16, 32, 64, 128, 256}) {
    SCOPED_TRACE(head_dim);
    CheckQkvRope(Case(RopeConfig::Style::kHalves, head_dim, true, head_dim, true));
  }
  CheckQkvRope(Case(RopeConfig::Style::kPairs, 16, false, 32, true));
}

// Head dims whose halves neither fit a warp's power-of-two lanes nor whole warps (96, 48) have no
// QK norm; the model refuses them at load.
TEST(CudaQkvRopeTest, QkNormHeadDims) {
  for (int head_dim : {2, 4, 8, 16, 32, 64, 128, 256, 512}) {
    EXPECT_TRUE(QkvRopeNormSupports(head_dim)) << head_dim;
  }
  for (int head_dim : {0, 24, 48, 96, 192, 1024}) {
    EXPECT_FALSE(QkvRopeNormSupports(head_dim)) << head_dim;
  }
}

// LongRoPE: each pair's angle divided by its factor (Phi-3's tiny model: head dim 16).
TEST(CudaQkvRopeTest, FrequencyFactors) {
  SKV_SKIP_WITHOUT_GPU();
  QkvCase c = Case(RopeConfig::Style::kHalves, 16, false, 16);
  c.freq_factors = {1.0f, 1.75f, 2.5f, 3.25f, 4.0f, 4.75f, 5.5f, 6.25f};
  CheckQkvRope(c);
}

}  // namespace
}  // namespace shadowkv::cuda
