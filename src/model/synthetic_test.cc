// Synthetic model shapes against docs/DESIGN.md's numbers and the SmolLM2 GGUF metadata give.
#include "model/synthetic.h"

#include <gtest/gtest.h>

namespace shadowkv {
namespace {

TEST(SyntheticModelConfigTest, Llama3_8bHasTheSpecShapes) {
  auto config = SyntheticModelConfig("llama3-8b");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->architecture, "llama");
  EXPECT_EQ(config->num_layers, 32);
  EXPECT_EQ(config->hidden_size, 4096);
  EXPECT_EQ(config->num_query_heads, 32);
  EXPECT_EQ(config->num_kv_heads, 8);
  EXPECT_EQ(config->head_dim, 128);
  EXPECT_EQ(config->ffn_size, 14336);
  EXPECT_EQ(config->vocab_size, 128256);
  EXPECT_FLOAT_EQ(config->rope.theta_base, 500000.0f);
  EXPECT_EQ(config->rope.rotary_dim, 128);
  EXPECT_FALSE(config->tied_embeddings);
  EXPECT_NE(config->name.find("synthetic"), std::string::npos);
}

TEST(SyntheticModelConfigTest, SmolLm2MatchesItsGgufMetadata) {
  auto config = SyntheticModelConfig("smollm2-135m");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->num_layers, 30);
  EXPECT_EQ(config->hidden_size, 576);
  EXPECT_EQ(config->num_query_heads, 9);
  EXPECT_EQ(config->num_kv_heads, 3);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->ffn_size, 1536);
  EXPECT_EQ(config->vocab_size, 49152);
  EXPECT_TRUE(config->tied_embeddings);
}

TEST(SyntheticModelConfigTest, UnknownNameListsTheKnownOnes) {
  auto config = SyntheticModelConfig("gpt-5");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(config.status().message().find("llama3-8b"), std::string::npos);
}

}  // namespace
}  // namespace shadowkv
