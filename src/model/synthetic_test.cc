// Synthetic model shapes against docs/DESIGN.md's numbers and the SmolLM2 GGUF metadata give.
#include "model/synthetic.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "format/chat_template.h"
#include "format/tokenizer.h"

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

// Qwen2.5-Coder-0.5B-Instruct's GGUF: 24 layers, hidden 896, 14 / 2 heads of 64, FFN 4864.
TEST(SyntheticModelConfigTest, Qwen05bHasTheLongContextModelsShapes) {
  auto config = SyntheticModelConfig("qwen2.5-0.5b");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->num_layers, 24);
  EXPECT_EQ(config->hidden_size, 896);
  EXPECT_EQ(config->num_query_heads, 14);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->ffn_size, 4864);
  EXPECT_EQ(config->vocab_size, 151936);
  EXPECT_EQ(config->context_length, 32768);
  EXPECT_TRUE(config->tied_embeddings);
}

TEST(SyntheticModelConfigTest, UnknownNameListsTheKnownOnes) {
  auto config = SyntheticModelConfig("gpt-5");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(config.status().message().find("llama3-8b"), std::string::npos);
}

TEST(SyntheticVocabularyTest, TextEncodesToByteTokensAndRoundTrips) {
  auto config = SyntheticModelConfig("llama3-8b");
  ASSERT_TRUE(config.ok());
  auto file = SyntheticVocabularyFile(config->vocab_size);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto tokenizer = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  EXPECT_EQ((*tokenizer)->vocab_size(), config->vocab_size);
  const std::string text = "lorem ipsum \xC3\xA9t\xC3\xA9 42";
  const std::vector<int32_t> ids = (*tokenizer)->Encode(text, true, false);
  ASSERT_EQ(ids.size(), text.size());  // one token per byte, no BOS
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(ids[i], static_cast<uint8_t>(text[i])) << "byte " << i;
  }
  EXPECT_EQ((*tokenizer)->Decode(ids), text);
}

TEST(SyntheticVocabularyTest, EndsWithTurnTokensAndEndOfText) {
  const int64_t vocab = 49152;
  auto file = SyntheticVocabularyFile(vocab);
  ASSERT_TRUE(file.ok());
  auto tokenizer = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tokenizer.ok());
  const Tokenizer& t = **tokenizer;
  EXPECT_EQ(t.eos_id(), vocab - 1);
  EXPECT_EQ(t.Decode(std::vector<int32_t>{static_cast<int32_t>(vocab - 1)}), kSyntheticEndOfText);
  EXPECT_TRUE(t.IsEndOfGeneration(static_cast<int32_t>(vocab - 1)));
  // A filler decodes to its own word.
  EXPECT_EQ(t.Decode(std::vector<int32_t>{300, 301}), " t300 t301");
  // The chat template is ChatML, and a rendered chat opens with the turn token.
  auto chat_template = DetectChatTemplate(**file);
  ASSERT_TRUE(chat_template.ok()) << chat_template.status().ToString();
  EXPECT_EQ(chat_template->format, ChatFormat::kChatML);
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  const std::vector<int32_t> chat = EncodeChat(t, *chat_template, messages, true);
  ASSERT_FALSE(chat.empty());
  EXPECT_EQ(chat.front(), vocab - 3);
}

TEST(SyntheticVocabularyTest, RefusesSizesWithoutRoomForBytesAndSpecials) {
  for (int64_t vocab : {int64_t{0}, int64_t{258}, kMaxVocab + 1}) {
    auto file = SyntheticVocabularyFile(vocab);
    ASSERT_FALSE(file.ok()) << vocab;
    EXPECT_EQ(file.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(file.status().message().find(std::to_string(vocab)), std::string::npos);
  }
  EXPECT_TRUE(SyntheticVocabularyFile(259).ok());
}

}  // namespace
}  // namespace shadowkv
