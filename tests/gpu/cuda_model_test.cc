// Whole-model parity: CudaModel against CpuModel (logits) on tiny random GGUF models of every
// family: chunked prefill, several sequences of different lengths, mixed prefill + decode steps,
// graph-replayed decode steps; and the model's errors (out of memory, bad inputs, a head dim the
// kernels do not take) as Status values.
#include "gpu/model/cuda_model.h"

#include <cstdio>

#include "engine/sampler.h"
#include "eval/prefill_record.h"
#include "gpu_test_util.h"
#include "kv/kv_policy.h"
#include "model/cpu_model.h"
#include "model/model_path.h"
#include "model/synthetic.h"
#include "tiny_model.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;
using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::SmallSpec;
using shadowkv::testing::SomeTokens;
using shadowkv::testing::WriteTinyModel;

class ParityChecker {
 public:
  ParityChecker(std::string what, double tolerance) : what_(std::move(what)), tolerance_(tolerance) {}
  ~ParityChecker() {
    std::printf("[ parity   ] %s: %d comparisons, worst relative error %.2e (tolerance %.0e)\n",
                what_.c_str(), count_, worst_, tolerance_);
  }
  void Check(const std::vector<float>& gpu, const std::vector<float>& cpu, const std::string& at) {
    const double error = RelativeError(gpu, cpu);
    worst_ = std::max(worst_, error);
    ++count_;
    EXPECT_LT(error, tolerance_) << what_ << ", " << at;
  }

 private:
  std::string what_;
  double tolerance_;
  double worst_ = 0.0;
  int count_ = 0;
};

// The model at `path`, whose context holds at least 156 tokens.
// Options for `batch` sequences and `step_tokens` tokens a step, graphs on.
CudaModelOptions Options(int batch, int step_tokens) {
  CudaModelOptions options;
  options.max_batch = batch;
  options.max_step_tokens = step_tokens;
  return options;
}

void CheckModelParity(const std::string& path, const std::string& tag, double tolerance) {
  auto cpu = CpuModel::Load(path, 2, Numerics::kExact);  // fp32 activations and KV
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  auto gpu = CudaModel::Load(path, Options(4, 256));
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  const Status allocated =
      (*gpu)->AllocateKvCache(4, std::min<int64_t>(512, (*cpu)->config().context_length));
  ASSERT_TRUE(allocated.ok()) << allocated.ToString();
  const int vocab = static_cast<int>((*cpu)->config().vocab_size);
  auto policy = kv::MakeKvPolicy(kv::KvPolicyConfig{}, (*cpu)->kv_geometry()).value();
  std::vector<std::unique_ptr<kv::SequenceKv>> sequences;
  for (int i = 0; i < 4; ++i) sequences.push_back(policy->NewSequence().value());
  ParityChecker parity(tag, tolerance);

  auto cpu_forward = [&](std::vector<std::pair<int, std::vector<int32_t>>> work) {
    std::vector<std::vector<float>> logits(work.size(), std::vector<float>(vocab));
    std::vector<StepInput> inputs(work.size());
    for (size_t i = 0; i < work.size(); ++i) {
      inputs[i].kv = sequences[work[i].first].get();
      inputs[i].tokens = work[i].second;
      inputs[i].finish_prefill = work[i].second.size() > 1;
      inputs[i].logits_out = logits[i].data();
    }
    EXPECT_TRUE((*cpu)->Forward(inputs).ok());
    return logits;
  };
  auto gpu_forward = [&](std::vector<std::pair<int, std::vector<int32_t>>> work) {
    std::vector<std::vector<float>> logits(work.size(), std::vector<float>(vocab));
    std::vector<CudaStepInput> inputs(work.size());
    for (size_t i = 0; i < work.size(); ++i) {
      inputs[i].slot = work[i].first;
      inputs[i].tokens = work[i].second;
      inputs[i].logits_out = logits[i].data();
    }
    const Status status = (*gpu)->Forward(inputs);
    EXPECT_TRUE(status.ok()) << status.ToString();
    return logits;
  };

  // Prompts of 150, 40 and 97 tokens, each whole on the CPU; on the GPU the first in chunks of
  // 64, the other two together in one step.
  const std::vector<std::vector<int32_t>> prompts = {SomeTokens(150, 1), SomeTokens(40, 2),
                                                     SomeTokens(97, 3)};
  std::vector<std::vector<float>> prefill_want(3);
  std::vector<int32_t> next(3);
  for (int s = 0; s < 3; ++s) {
    prefill_want[s] = cpu_forward({{s, prompts[s]}})[0];
    next[s] = Argmax(prefill_want[s]);
  }
  std::vector<float> chunked;
  for (size_t done = 0; done < prompts[0].size(); done += 64) {
    const size_t count = std::min<size_t>(64, prompts[0].size() - done);
    chunked = gpu_forward(
        {{0, std::vector<int32_t>(prompts[0].begin() + done, prompts[0].begin() + done + count)}})[0];
  }
  parity.Check(chunked, prefill_want[0], "prefill of 150 tokens in chunks of 64");
  const auto together = gpu_forward({{1, prompts[1]}, {2, prompts[2]}});
  parity.Check(together[0], prefill_want[1], "two prompts prefilled in one step (40 tokens)");
  parity.Check(together[1], prefill_want[2], "two prompts prefilled in one step (97 tokens)");

  // Six decode steps of the three sequences: two through Forward (the second one also prefills
  // a fourth prompt in the same step), then four replayed from the captured graph.
  const std::vector<int32_t> fourth = SomeTokens(33, 4);
  for (int step = 0; step < 6; ++step) {
    const std::string at = "decode step " + std::to_string(step);
    const auto want = cpu_forward({{0, {next[0]}}, {1, {next[1]}}, {2, {next[2]}}});
    if (step < 2) {
      std::vector<std::pair<int, std::vector<int32_t>>> work = {
          {0, {next[0]}}, {1, {next[1]}}, {2, {next[2]}}};
      if (step == 1) work.push_back({3, fourth});
      const auto got = gpu_forward(work);
      for (int s = 0; s < 3; ++s) parity.Check(got[s], want[s], at);
      if (step == 1) {
        const auto want_fourth = cpu_forward({{3, fourth}})[0];
        parity.Check(got[3], want_fourth, "prefill mixed with decode rows");
      }
    } else {
      std::vector<float> got(3 * static_cast<size_t>(vocab));
      std::vector<int32_t> tokens = next;
      const std::vector<int> slots = {0, 1, 2};
      const Status status = (*gpu)->DecodeStep(slots, tokens, CudaSampling{}, got.data());
      ASSERT_TRUE(status.ok()) << status.ToString();
      for (int s = 0; s < 3; ++s) {
        const std::vector<float> row(got.begin() + s * vocab, got.begin() + (s + 1) * vocab);
        parity.Check(row, want[s], at + " (graph)");
        EXPECT_EQ(tokens[s], Argmax(row)) << "the GPU sampler's greedy choice";
      }
    }
    for (int s = 0; s < 3; ++s) next[s] = Argmax(want[s]);
  }
  EXPECT_EQ((*gpu)->slot_length(0), 156);
  EXPECT_EQ((*gpu)->slot_length(3), 33);
}

void CheckModelParity(const TinyModelSpec& spec, const std::string& tag, double tolerance) {
  CheckModelParity(WriteTinyModel(spec, tag), tag, tolerance);
}

std::string TinyFamilyPath(const std::string& family) {
  return shadowkv::testing::DataPath("goldens/tiny_" + family + ".gguf");
}

TEST(CudaModelParityTest, LlamaF32Weights) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32, true, 1), "gpu_llama_f32", 3e-2);
}

TEST(CudaModelParityTest, Qwen2BiasUntiedGroupOf4) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(SmallSpec("qwen2", 256, 4, 1, gguf::GgmlType::kF32, false, 2), "gpu_qwen2", 3e-2);
}

TEST(CudaModelParityTest, LlamaQ8WeightsHeadDim128GroupOf3) {
  SKV_SKIP_WITHOUT_GPU();
  // Both sides use the dequantised Q8_0 values (the GPU rounds them to bf16).
  CheckModelParity(SmallSpec("llama", 768, 6, 2, gguf::GgmlType::kQ8_0, true, 3), "gpu_llama_q8", 3e-2);
}

// qwen3: the per-head QK norm inside the QKV/RoPE kernel, head dim 64 wider than hidden/heads.
TEST(CudaModelParityTest, Qwen3QkNormTinyFamilyModel) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(TinyFamilyPath("qwen3"), "gpu_qwen3", 3e-2);
}

// The other families' tiny models (tests/data/goldens/, head dims 16 and 32): gemma3's sliding
// and global layers with their own RoPE bases, post norms, GELU FFN, embedding scale and
// soft-cap; phi3's fused tensors and LongRoPE; glm4's biases, half rotation in pairs and post
// norms; chatglm's fused QKV with its bias and head dim 32 over hidden 64; mistral's window in
// every layer. The window of 8 is far below these prompts, so the
// prefill chunks of 64 and the mixed steps read across it. (Against transformers:
// cuda_family_test.cc.)
TEST(CudaModelParityTest, Gemma3SlidingAndGlobalLayers) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(TinyFamilyPath("gemma3"), "gpu_gemma3", 3e-2);
}

TEST(CudaModelParityTest, Phi3FusedTensorsLongRope) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(TinyFamilyPath("phi3"), "gpu_phi3", 3e-2);
}

TEST(CudaModelParityTest, Glm4BiasesPartialRotaryPostNorms) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(TinyFamilyPath("glm4"), "gpu_glm4", 3e-2);
}

TEST(CudaModelParityTest, ChatGlmFusedQkvBiasPartialRotary) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(TinyFamilyPath("chatglm"), "gpu_chatglm", 3e-2);
}

TEST(CudaModelParityTest, MistralWindowInEveryLayer) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(TinyFamilyPath("mistral"), "gpu_mistral", 3e-2);
}

// Head dim 96 (Phi-3-mini's) in the phi3 form and 256 (Gemma 3's) in the llama form: the decode
// kernel's partial lanes and the prefill kernel's 16-row warps at those widths.
TEST(CudaModelParityTest, HeadDims96And256) {
  SKV_SKIP_WITHOUT_GPU();
  // bf16 against fp32 through the layers: on the H200 (2026-12-02) the worst row was 3.9e-2
  // here, where the head-dim-64 form stays under 2.3e-2.
  CheckModelParity(SmallSpec("phi3", 384, 4, 2, gguf::GgmlType::kF32, true, 7), "gpu_phi3_d96",
                   5e-2);
  CheckModelParity(SmallSpec("llama", 512, 2, 1, gguf::GgmlType::kF32, true, 8), "gpu_llama_d256",
                   3e-2);
}

// phi3 and glm4 forms of the small models (tiny_model.h) at head dim 64 and 128, the shapes of
// released models' kernels (the GLM-4 one untied, with a group of 4).
TEST(CudaModelParityTest, Phi3AndGlm4AtHeadDims64And128) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(SmallSpec("phi3", 256, 4, 2, gguf::GgmlType::kF32, true, 5), "gpu_phi3_d64",
                   3e-2);
  // The worst row measured on the H200 (2026-12-02): 3.3e-2.
  CheckModelParity(SmallSpec("glm4", 512, 4, 1, gguf::GgmlType::kF32, false, 6), "gpu_glm4_d128",
                   5e-2);
}

// GLM-4-9B's 16 query heads per KV head (here at head dim 64 and 128, one KV head): full
// attention on the GPU against the CPU model, and ShadowKV runs on the GPU
// (shadowkv_model_test.cc has its parity). A group the ShadowKV kernels are not built for (12)
// runs full attention and has ShadowKV refused, naming the group.
TEST(CudaModelParityTest, SixteenQueryHeadsPerKvHead) {
  SKV_SKIP_WITHOUT_GPU();
  CheckModelParity(SmallSpec("glm4", 1024, 16, 1, gguf::GgmlType::kF32, false, 12),
                   "gpu_glm4_g16_d64", 5e-2);
  const std::string path =
      WriteTinyModel(SmallSpec("glm4", 2048, 16, 1, gguf::GgmlType::kF32, false, 13),
                     "gpu_glm4_g16_d128");
  CheckModelParity(path, "gpu_glm4_g16_d128_parity", 5e-2);
  auto gpu = CudaModel::Load(path, Options(2, 128)).value();
  EXPECT_TRUE(gpu->ShadowKvRunsHere().ok()) << gpu->ShadowKvRunsHere().ToString();
  kv::KvPolicyConfig shadowkv;
  shadowkv.policy = "shadowkv";
  EXPECT_TRUE(gpu->AllocateShadowKv(shadowkv, 1, 512).ok());

  const std::string twelve =
      WriteTinyModel(SmallSpec("glm4", 768, 12, 1, gguf::GgmlType::kF32, false, 16),
                     "gpu_glm4_g12_d64");
  CheckModelParity(twelve, "gpu_glm4_g12_d64_parity", 5e-2);
  auto other = CudaModel::Load(twelve, Options(2, 128)).value();
  const Status refused = other->ShadowKvRunsHere();
  EXPECT_EQ(refused.code(), ErrorCode::kUnsupported);
  EXPECT_NE(refused.message().find("12 query heads per KV head"), std::string::npos)
      << refused.message();
  EXPECT_EQ(other->AllocateShadowKv(shadowkv, 1, 512).code(), ErrorCode::kUnsupported);
  EXPECT_EQ(other->ShadowKvBytesPerSequence(shadowkv, 512).status().code(),
            ErrorCode::kUnsupported);
}

// ExportSlot hands a GPU prefill to the CPU policies (eval --device cuda): the exported keys
// (both sides of RoPE) and values of every layer match the CPU's own prefill record.
TEST(CudaModelTest, ExportedSlotMatchesTheCpuPrefill) {
  SKV_SKIP_WITHOUT_GPU();
  const std::string path =
      WriteTinyModel(SmallSpec("qwen2", 256, 4, 2, gguf::GgmlType::kF32, false, 11), "gpu_export");
  auto cpu = CpuModel::Load(path, 2, Numerics::kExact).value();
  auto gpu = CudaModel::Load(path, Options(2, 128)).value();
  ASSERT_TRUE(gpu->AllocateKvCache(2, 512, /*keep_pre_rope_keys=*/true).ok());
  const std::vector<int32_t> prompt = SomeTokens(300, 12);
  for (size_t done = 0; done < prompt.size(); done += 128) {
    const size_t count = std::min<size_t>(128, prompt.size() - done);
    const std::vector<int32_t> chunk(prompt.begin() + done, prompt.begin() + done + count);
    ASSERT_TRUE(gpu->Forward(std::vector<CudaStepInput>{{1, chunk, nullptr}}).ok());
  }
  const eval::PrefillRecord want = eval::RecordPrefill(*cpu, prompt, 128).value();
  auto got = gpu->ExportSlot(1, 280);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->num_tokens, 280);
  ParityChecker parity("exported slot", 2e-2);
  const size_t count = 280 * static_cast<size_t>(want.kv_width);
  auto head = [&](const std::vector<float>& all) {
    return std::vector<float>(all.begin(), all.begin() + count);
  };
  for (int layer = 0; layer < cpu->config().num_layers; ++layer) {
    const std::string at = "layer " + std::to_string(layer);
    ASSERT_EQ(got->keys[layer].size(), count);
    parity.Check(got->keys[layer], head(want.keys[layer]), at + " keys");
    parity.Check(got->values[layer], head(want.values[layer]), at + " values");
    parity.Check(got->keys_pre_rope[layer], head(want.keys_pre_rope[layer]), at + " pre-RoPE keys");
  }
  EXPECT_EQ(gpu->ExportSlot(1, 301).status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(gpu->ExportSlot(2, 1).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(gpu->ExportSlot(0, 0).value().keys.size(), static_cast<size_t>(cpu->config().num_layers));
}

TEST(CudaModelTest, ErrorsAreStatuses) {
  SKV_SKIP_WITHOUT_GPU();
  const std::string path =
      WriteTinyModel(SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32, true, 9), "gpu_errors");
  auto model = CudaModel::Load(path, Options(2, 64)).value();
  // Far more KV cache than any GPU has: a status, and the model stays usable.
  Status status = model->AllocateKvCache(1'000'000, 512);
  EXPECT_EQ(status.code(), ErrorCode::kResourceExhausted) << status.ToString();
  ASSERT_TRUE(model->AllocateKvCache(2, 16).ok());
  const std::vector<int32_t> ten = SomeTokens(10, 5), twenty = SomeTokens(20, 6);
  const std::vector<int32_t> bad_token = {300};
  EXPECT_EQ(model->Forward(std::vector<CudaStepInput>{{5, ten, nullptr}}).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(model->Forward(std::vector<CudaStepInput>{{0, twenty, nullptr}}).code(),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(model->Forward(std::vector<CudaStepInput>{{0, bad_token, nullptr}}).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(model->Forward(std::vector<CudaStepInput>{{0, ten, nullptr}, {0, ten, nullptr}}).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(model->slot_length(0), 0);  // rejected inputs change nothing
  EXPECT_TRUE(model->Forward(std::vector<CudaStepInput>{{0, ten, nullptr}}).ok());
  EXPECT_EQ(model->slot_length(0), 10);
  // head_dim 24: the attention kernels do not support it.
  TinyModelSpec head24;
  head24.hidden = 96;
  auto unsupported = CudaModel::Load(WriteTinyModel(head24, "gpu_head24"), {});
  EXPECT_EQ(unsupported.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(unsupported.status().message().find("head_dim 24"), std::string::npos)
      << unsupported.status().message();
}

TEST(CudaModelTest, SyntheticModelDecodesCopiedSlotsIdentically) {
  SKV_SKIP_WITHOUT_GPU();
  const ModelConfig config = SyntheticModelConfig("smollm2-135m").value();
  auto model = CudaModel::CreateSynthetic(config, 7, Options(4, 512));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_TRUE((*model)->AllocateKvCache(3, 1024).ok());
  std::vector<float> prefill_logits(config.vocab_size);
  const std::vector<int32_t> prompt = SomeTokens(300, 8);
  ASSERT_TRUE((*model)->Forward(std::vector<CudaStepInput>{{0, prompt, prefill_logits.data()}}).ok());
  for (float v : prefill_logits) ASSERT_TRUE(std::isfinite(v));
  ASSERT_TRUE((*model)->CopySlot(0, 1).ok());
  ASSERT_TRUE((*model)->CopySlot(0, 2).ok());
  EXPECT_EQ((*model)->slot_length(2), 300);

  // Slot 2 through Forward (no graph), slots 0 and 1 through the graph: the same sequence, the
  // same logits.
  const int32_t first = Argmax(prefill_logits);
  std::vector<float> graph_logits(2 * config.vocab_size), plain_logits(config.vocab_size);
  std::vector<int32_t> tokens = {first, first};
  const std::vector<int32_t> single = {first};
  ASSERT_TRUE((*model)->DecodeStep(std::vector<int>{0, 1}, tokens, CudaSampling{}, graph_logits.data()).ok());
  ASSERT_TRUE((*model)->Forward(std::vector<CudaStepInput>{{2, single, plain_logits.data()}}).ok());
  EXPECT_EQ(tokens[0], tokens[1]);
  const std::vector<float> row0(graph_logits.begin(), graph_logits.begin() + config.vocab_size);
  const std::vector<float> row1(graph_logits.begin() + config.vocab_size, graph_logits.end());
  EXPECT_LT(RelativeError(row1, row0), 1e-6);
  // Batch 1 against batch 2: other GEMM tilings round some bf16 intermediates differently.
  EXPECT_LT(RelativeError(plain_logits, row0), 2e-2);

  auto breakdown = (*model)->ProfileDecodeStep(std::vector<int>{0, 1}, tokens);
  ASSERT_TRUE(breakdown.ok()) << breakdown.status().ToString();
  EXPECT_GT(breakdown->gemm_ms, 0.0);
  EXPECT_GT(breakdown->attention_ms, 0.0);
  EXPECT_NEAR(breakdown->total_ms,
              breakdown->gemm_ms + breakdown->attention_ms + breakdown->other_ms, 1e-6);
  EXPECT_EQ((*model)->slot_length(0), 302);
}

}  // namespace
}  // namespace shadowkv::cuda
