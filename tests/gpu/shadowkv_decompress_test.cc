// DecompressShadowKv on the GPU: a ShadowKV sequence written back into a full-cache slot holds
// what full attention's slot holds and decodes as it does (plain and sliding-window models), and
// a sequence that kept its prompt's exact keys (AllocateShadowKvKeys) decompresses them exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu_test_util.h"
#include "kv/kv_config.h"
#include "shadowkv_test_util.h"
#include "tiny_model.h"
#include "tp_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;
using shadowkv::testing::SomeTokens;
using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::WriteTinyModel;

// DecompressShadowKv: a ShadowKV sequence at full rank, after decode steps that graduated a
// chunk, written back into a full-cache slot holds what full attention's slot holds along the
// same tokens (keys, pre-RoPE keys and values of every layer; a windowed layer's last window
// tokens), decodes as that slot does, and compressed again from there decodes on. A plain
// 2-layer model and a sliding-window one (the rings back at their positions). The prompt's
// 33 chunks fill the budget exactly; the chunk graduated at step 4 leaves one unselected from
// step 5 on, so from there the tokens' keys and values differ a little (bound 1e-1, not 2e-2).
TEST(CudaShadowKvParityTest, DecompressedSequencesDecodeAsTheFullCache) {
  SKV_SKIP_WITHOUT_GPU();
  for (const std::vector<bool>& windowed :
       {std::vector<bool>{false, false}, std::vector<bool>{true, false, true, false}}) {
    TinyModelSpec spec = shadowkv::testing::SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32,
                                                      true, 7);
    spec.layers = static_cast<int>(windowed.size());
    const bool sliding = windowed.front();
    if (sliding) {
      spec.sliding_window = 64;
      spec.windowed = windowed;
    }
    SCOPED_TRACE(::testing::Message() << spec.layers << " layers, sliding " << sliding);
    auto gpu_or = CudaModel::Load(WriteTinyModel(spec, "gpu_shadowkv_decompress"), tp_testing::SmallOptions());
    ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
    CudaModel& gpu = **gpu_or;
    const int vocab = static_cast<int>(gpu.config().vocab_size);
    const int width = 2 * 64;
    const int64_t prompt_tokens = 300;
    const std::vector<int32_t> prompt = SomeTokens(prompt_tokens, 31);
    kv::KvPolicyConfig config = EveryChunkAtFullRank(width);
    std::vector<float> full(vocab), other(vocab);
    const Status prepared = PrefillTwoSlotsCompressFirst(gpu, prompt, config, &full);
    ASSERT_TRUE(prepared.ok()) << prepared.ToString();
    int32_t next = Argmax(full);
    // One step of full attention in slot 1 and of slot 0 (ShadowKV sequence 0, or the slot).
    auto step_both = [&](bool on_shadowkv, double bound) {
      std::vector<int32_t> full_token = {next}, other_token = {next};
      ASSERT_TRUE(gpu.DecodeStep(std::vector<int>{1}, full_token, CudaSampling{}, full.data()).ok());
      const Status decoded =
          on_shadowkv ? gpu.ShadowKvDecodeStep(std::vector<int>{0}, other_token, CudaSampling{},
                                               other.data())
                      : gpu.DecodeStep(std::vector<int>{0}, other_token, CudaSampling{},
                                       other.data());
      ASSERT_TRUE(decoded.ok()) << decoded.ToString();
      EXPECT_LT(RelativeError(other, full), bound);
      next = Argmax(full);
    };
    for (int step = 0; step < 6; ++step) step_both(true, step < 4 ? 2e-2 : 1e-1);
    const Status back = gpu.DecompressShadowKv(0, 0);
    ASSERT_TRUE(back.ok()) << back.ToString();
    ASSERT_EQ(gpu.slot_length(0), gpu.shadowkv_length(0));
    ASSERT_EQ(gpu.slot_length(0), gpu.slot_length(1));
    const int64_t n = gpu.slot_length(0);
    auto got = gpu.ExportSlot(0, n), want = gpu.ExportSlot(1, n);
    ASSERT_TRUE(got.ok() && want.ok());
    // [prompt part, decoded part] worst relative errors of keys, pre-RoPE keys, values.
    double worst[2][3] = {};
    for (int layer = 0; layer < spec.layers; ++layer) {
      // A windowed layer's older rows are not held (its decode reads its window only).
      const int64_t from = windowed[layer] ? n - 63 : 0;
      for (int part = 0; part < 2; ++part) {
        const int64_t begin = part == 0 ? from : std::max(from, prompt_tokens);
        const int64_t end = part == 0 ? prompt_tokens : n;
        if (begin >= end) continue;
        auto rows = [&](const std::vector<float>& all) {
          return std::vector<float>(all.begin() + begin * width, all.begin() + end * width);
        };
        double* w = worst[part];
        w[0] = std::max(w[0], RelativeError(rows(got->keys[layer]), rows(want->keys[layer])));
        if (!windowed[layer]) {
          w[1] = std::max(w[1], RelativeError(rows(got->keys_pre_rope[layer]),
                                              rows(want->keys_pre_rope[layer])));
        }
        w[2] = std::max(w[2], RelativeError(rows(got->values[layer]), rows(want->values[layer])));
      }
    }
    for (int k = 0; k < 3; ++k) {
      EXPECT_LT(worst[0][k], 2e-2) << "prompt part, " << k;
      EXPECT_LT(worst[1][k], 1e-1) << "decoded part, " << k;
    }
    std::printf("[ decomp   ] %d layers, sliding %d: %lld tokens back in a slot; worst relative "
                "error of keys / pre-RoPE keys / values: prompt %.2e / %.2e / %.2e, decoded "
                "%.2e / %.2e / %.2e\n",
                spec.layers, sliding ? 1 : 0, static_cast<long long>(n), worst[0][0],
                worst[0][1], worst[0][2], worst[1][0], worst[1][1], worst[1][2]);
    for (int step = 0; step < 3; ++step) step_both(false, 5e-2);  // the slot decodes as slot 1
    // Compressed again with a budget that selects every chunk the slot now forms.
    const int64_t chunks = (gpu.slot_length(0) - config.local_window) / config.chunk_size;
    config.budget_tokens = chunks * config.chunk_size;
    gpu.FreeShadowKv();
    ASSERT_TRUE(gpu.AllocateShadowKv(config, 1, 512).ok());
    ASSERT_TRUE(gpu.AllocateShadowKvValues(0, false).ok());
    ASSERT_TRUE(gpu.CompressToShadowKv(0, 0).ok());
    for (int step = 0; step < 3; ++step) step_both(true, 5e-2);
  }
}

// AllocateShadowKvKeys: at a rank below the keys' width, a sequence that kept its prompt's exact
// keys decompresses them exactly (pre-RoPE bit for bit, post-RoPE up to the rotation's rounding),
// where one that did not rebuilds them at rank r (far off on a random model); chunks graduated
// after the compression are rebuilt either way, and a fork carries the copy.
TEST(CudaShadowKvParityTest, DecompressionUsesThePromptsKeptKeys) {
  SKV_SKIP_WITHOUT_GPU();
  TinyModelSpec spec = shadowkv::testing::SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32,
                                                    true, 7);
  auto gpu_or = CudaModel::Load(WriteTinyModel(spec, "gpu_shadowkv_kept_keys"), tp_testing::SmallOptions());
  ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
  CudaModel& gpu = **gpu_or;
  const int width = 2 * 64;
  const int64_t prompt_tokens = 300;
  const std::vector<int32_t> prompt = SomeTokens(prompt_tokens, 33);
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  config.rank = 32;
  config.budget_tokens = 128;
  ASSERT_TRUE(gpu.AllocateKvCache(2, 512, true).ok());
  ASSERT_TRUE(gpu.AllocateShadowKv(config, 3, 512).ok());
  std::vector<float> logits(gpu.config().vocab_size);
  CudaStepInput in;
  in.slot = 1;  // slot 1 keeps the prompt as prefilled
  in.tokens = prompt;
  in.logits_out = logits.data();
  ASSERT_TRUE(gpu.Forward(std::span<const CudaStepInput>(&in, 1)).ok());
  for (int seq = 0; seq < 3; ++seq) ASSERT_TRUE(gpu.AllocateShadowKvValues(seq, false).ok());
  ASSERT_TRUE(gpu.AllocateShadowKvKeys(0).ok());
  ASSERT_TRUE(gpu.AllocateShadowKvKeys(2).ok());
  ASSERT_TRUE(gpu.CompressToShadowKv(1, 0).ok());
  ASSERT_TRUE(gpu.CompressToShadowKv(1, 1).ok());  // no kept keys
  ASSERT_TRUE(gpu.CopyShadowKvSequence(0, 2).ok());
  auto want = gpu.ExportSlot(1, prompt_tokens);
  ASSERT_TRUE(want.ok());
  const int64_t chunked = (prompt_tokens - config.local_window) / 8 * 8;
  auto errors = [&](int seq, double* pre, double* post) {
    ASSERT_TRUE(gpu.DecompressShadowKv(seq, 0).ok());
    auto got = gpu.ExportSlot(0, prompt_tokens);
    ASSERT_TRUE(got.ok());
    *pre = *post = 0.0;
    for (int layer = 0; layer < spec.layers; ++layer) {
      auto rows = [&](const std::vector<float>& all) {
        return std::vector<float>(all.begin(), all.begin() + chunked * width);
      };
      *pre = std::max(*pre, RelativeError(rows(got->keys_pre_rope[layer]),
                                          rows(want->keys_pre_rope[layer])));
      *post = std::max(*post, RelativeError(rows(got->keys[layer]), rows(want->keys[layer])));
    }
  };
  double kept_pre, kept_post, rebuilt_pre, rebuilt_post, fork_pre, fork_post;
  errors(0, &kept_pre, &kept_post);
  errors(1, &rebuilt_pre, &rebuilt_post);
  errors(2, &fork_pre, &fork_post);
  std::printf("[ kept     ] rank 32 of 128: the prompt's chunked keys decompressed, relative error "
              "pre-RoPE / post-RoPE: kept %.2e / %.2e, rebuilt %.2e / %.2e, forked %.2e / %.2e\n",
              kept_pre, kept_post, rebuilt_pre, rebuilt_post, fork_pre, fork_post);
  EXPECT_EQ(kept_pre, 0.0);
  EXPECT_LT(kept_post, 1e-2);  // the rotation of bf16 pre-RoPE keys against the QKV kernel's
  EXPECT_EQ(fork_pre, 0.0);
  EXPECT_GT(rebuilt_pre, 1e-1);  // rank 32 of a random model's 128-wide keys
}

}  // namespace
}  // namespace shadowkv::cuda
