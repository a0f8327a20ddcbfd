// CpuModel::Load on tiny models broken after writing: non-finite weights in norms and in matrices
// used as stored must be refused at load, naming the tensor; and the phi3, glm4 and chatglm forms
// of the tiny model (what the GPU ShadowKV tests use) load as those families.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <limits>

#include "format/quants.h"
#include "model/cpu_model.h"
#include "tiny_model.h"

namespace shadowkv {
namespace {

using testing::MakeTinyModel;
using testing::TinyModelSpec;

// Overwrites `bytes` at byte `offset` of tensor `name`'s data in the image.
void Poke(std::vector<uint8_t>& image, const std::string& name, size_t offset, const void* bytes,
          size_t count) {
  auto parsed = gguf::GgufFile::FromBytes(image);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const gguf::TensorInfo* tensor = (*parsed)->FindTensor(name);
  ASSERT_NE(tensor, nullptr) << name;
  ASSERT_LE(offset + count, tensor->size_bytes);
  const size_t start = (*parsed)->data_offset() + tensor->offset + offset;
  std::memcpy(image.data() + start, bytes, count);
}

Status LoadImage(const std::vector<uint8_t>& image, const std::string& tag) {
  const std::string path = ::testing::TempDir() + "/model_load_" + tag + "_" +
                           std::to_string(static_cast<long>(getpid())) + ".gguf";
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(image.data(), 1, image.size(), f);
  std::fclose(f);
  auto model = CpuModel::Load(path, 1);
  std::remove(path.c_str());
  return model.status();
}

void ExpectNonFiniteRefused(const std::vector<uint8_t>& image, const std::string& tensor,
                            const std::string& tag) {
  const Status status = LoadImage(image, tag);
  EXPECT_EQ(status.code(), ErrorCode::kCorrupt) << status.ToString();
  EXPECT_NE(status.message().find("tensor '" + tensor + "' holds a non-finite"), std::string::npos)
      << status.message();
}

TEST(ModelLoadTest, TinyPhi3AndGlmSpecsLoadAsTheirFamilies) {
  TinyModelSpec spec;
  spec.hidden = 256;
  spec.context = 1024;
  spec.weight_type = gguf::GgmlType::kF32;
  spec.architecture = "phi3";
  const std::string phi3_path = testing::WriteTinyModel(spec, "load_phi3");
  auto phi3 = CpuModel::Load(phi3_path, 1);
  ASSERT_TRUE(phi3.ok()) << phi3.status().ToString();
  const ModelConfig& p = (*phi3)->config();
  EXPECT_TRUE(p.fused_qkv);
  EXPECT_TRUE(p.fused_gate_up);
  EXPECT_EQ(p.head_dim, 64);
  ASSERT_EQ(p.rope.freq_factors.size(), 32u);
  EXPECT_EQ(p.rope.freq_factors[1], 1.25f);   // the long factors: the context exceeds 512
  EXPECT_GT(p.attention_scale, 1.0f / 8.0f);  // LongRoPE's attention factor squared
  spec.architecture = "glm4";
  auto glm4 = CpuModel::Load(testing::WriteTinyModel(spec, "load_glm4"), 1);
  ASSERT_TRUE(glm4.ok()) << glm4.status().ToString();
  const ModelConfig& g = (*glm4)->config();
  EXPECT_TRUE(g.qkv_bias);
  EXPECT_TRUE(g.post_norms);
  EXPECT_TRUE(g.fused_gate_up);
  EXPECT_FALSE(g.fused_qkv);
  EXPECT_EQ(g.rope.rotary_dim, 32);
  EXPECT_EQ(g.rope.style, RopeConfig::Style::kPairs);
  // chatglm as llama.cpp converts GlmForCausalLM: glm4's form, separate Q/K/V, no post norms.
  spec.architecture = "chatglm";
  auto chatglm = CpuModel::Load(testing::WriteTinyModel(spec, "load_chatglm"), 1);
  ASSERT_TRUE(chatglm.ok()) << chatglm.status().ToString();
  const ModelConfig& c = (*chatglm)->config();
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.post_norms);
  EXPECT_TRUE(c.fused_gate_up);
  EXPECT_FALSE(c.fused_qkv);
  EXPECT_EQ(c.rope.rotary_dim, 32);
  EXPECT_EQ(c.rope.style, RopeConfig::Style::kPairs);
}

TEST(ModelLoadTest, RefusesNonFiniteWeights) {
  TinyModelSpec spec;
  spec.layers = 2;
  const std::vector<uint8_t> clean = MakeTinyModel(spec);
  ASSERT_TRUE(LoadImage(clean, "clean").ok());

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> image = clean;
  Poke(image, "blk.1.attn_norm.weight", 5 * sizeof(float), &nan, sizeof(nan));
  ExpectNonFiniteRefused(image, "blk.1.attn_norm.weight", "norm");

  image = clean;
  Poke(image, "output_norm.weight", 0, &inf, sizeof(inf));
  ExpectNonFiniteRefused(image, "output_norm.weight", "output_norm");

  // Q8_0 matrices are used as stored; a NaN scale (the block's first two bytes) spoils a block.
  const uint16_t nan_half = 0x7e00;
  for (const char* matrix : {"blk.0.ffn_down.weight", "blk.1.attn_q.weight", "token_embd.weight"}) {
    image = clean;
    Poke(image, matrix, 3 * sizeof(gguf::BlockQ8_0), &nan_half, sizeof(nan_half));
    ExpectNonFiniteRefused(image, matrix, "q8");
  }
}

TEST(ModelLoadTest, RefusesNonFiniteWeightsInFloatAndUntiedMatrices) {
  TinyModelSpec spec;
  spec.weight_type = gguf::GgmlType::kF32;
  spec.tied = false;
  const std::vector<uint8_t> clean = MakeTinyModel(spec);
  ASSERT_TRUE(LoadImage(clean, "f32_clean").ok());
  const float inf = -std::numeric_limits<float>::infinity();
  for (const char* matrix : {"output.weight", "token_embd.weight", "blk.1.ffn_up.weight"}) {
    std::vector<uint8_t> image = clean;
    Poke(image, matrix, 77 * sizeof(float), &inf, sizeof(inf));
    ExpectNonFiniteRefused(image, matrix, "f32");
  }
}

}  // namespace
}  // namespace shadowkv
