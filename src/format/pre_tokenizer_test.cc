// Tests for the pre-tokenizers: pieces worked out by hand from each type's regex.
#include "format/pre_tokenizer.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace shadowkv {
namespace {

using Pieces = std::vector<std::string>;

Pieces Split(PreTokenizerType type, std::string_view text) {
  std::vector<std::string_view> views;
  PreTokenize(type, text, views);
  return Pieces(views.begin(), views.end());
}

TEST(PreTokenizerTest, ParsesGgufNames) {
  EXPECT_EQ(ParsePreTokenizerType("smollm").value(), PreTokenizerType::kSmolLM);
  EXPECT_EQ(ParsePreTokenizerType("llama-bpe").value(), PreTokenizerType::kLlama3);
  EXPECT_EQ(ParsePreTokenizerType("qwen2").value(), PreTokenizerType::kQwen2);
  EXPECT_EQ(ParsePreTokenizerType("glm4").value(), PreTokenizerType::kLlama3);
  EXPECT_EQ(ParsePreTokenizerType("chatglm-bpe").value(), PreTokenizerType::kLlama3);
  EXPECT_EQ(ParsePreTokenizerType("gpt-2").value(), PreTokenizerType::kGpt2);
  EXPECT_EQ(ParsePreTokenizerType("default").value(), PreTokenizerType::kGpt2);
  EXPECT_EQ(ParsePreTokenizerType("").value(), PreTokenizerType::kGpt2);
  const Result<PreTokenizerType> unknown = ParsePreTokenizerType("deepseek-llm");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(unknown.status().message().find("deepseek-llm"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("smollm"), std::string::npos);
}

TEST(PreTokenizerTest, Gpt2) {
  const auto gpt2 = PreTokenizerType::kGpt2;
  EXPECT_EQ(Split(gpt2, ""), Pieces{});
  EXPECT_EQ(Split(gpt2, "Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(Split(gpt2, "I'm here's"), (Pieces{"I", "'m", " here", "'s"}));
  EXPECT_EQ(Split(gpt2, "we'll they've"), (Pieces{"we", "'ll", " they", "'ve"}));
  // Contractions are case-sensitive here: "'" is punctuation on its own.
  EXPECT_EQ(Split(gpt2, "IT'S"), (Pieces{"IT", "'", "S"}));
  EXPECT_EQ(Split(gpt2, "abc 123 4567"), (Pieces{"abc", " 123", " 4567"}));
  EXPECT_EQ(Split(gpt2, "a!!! ?"), (Pieces{"a", "!!!", " ?"}));
  // A whitespace run before text leaves its last character to prefix the next piece.
  EXPECT_EQ(Split(gpt2, "don't  stop"), (Pieces{"don", "'t", " ", " stop"}));
  EXPECT_EQ(Split(gpt2, "x   \n\ny"), (Pieces{"x", "   \n", "\n", "y"}));
  EXPECT_EQ(Split(gpt2, "end   "), (Pieces{"end", "   "}));
  EXPECT_EQ(Split(gpt2, "\tfoo"), (Pieces{"\t", "foo"}));
  EXPECT_EQ(Split(gpt2, "caf\xC3\xA9 na\xC3\xAFve"), (Pieces{"caf\xC3\xA9", " na\xC3\xAFve"}));
  // 日本語 テキスト
  EXPECT_EQ(Split(gpt2, "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xE3\x83\x86\xE3\x82\xAD"),
            (Pieces{"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", " \xE3\x83\x86\xE3\x82\xAD"}));
  // Emoji are symbols; a combining mark is not a letter, so it splits "e" from its accent.
  EXPECT_EQ(Split(gpt2, "\xF0\x9F\x98\x80\xF0\x9F\x98\x80 x"),
            (Pieces{"\xF0\x9F\x98\x80\xF0\x9F\x98\x80", " x"}));
  EXPECT_EQ(Split(gpt2, "e\xCC\x81t"), (Pieces{"e", "\xCC\x81", "t"}));
}

TEST(PreTokenizerTest, SmolLMIsolatesEveryDigit) {
  const auto smollm = PreTokenizerType::kSmolLM;
  EXPECT_EQ(Split(smollm, "abc 123"), (Pieces{"abc", " ", "1", "2", "3"}));
  EXPECT_EQ(Split(smollm, "x1y"), (Pieces{"x", "1", "y"}));
  // The text between digits is split as if it ended there.
  EXPECT_EQ(Split(smollm, "1  2"), (Pieces{"1", "  ", "2"}));
  EXPECT_EQ(Split(smollm, "a  1"), (Pieces{"a", "  ", "1"}));
  EXPECT_EQ(Split(smollm, "v2.0's"), (Pieces{"v", "2", ".", "0", "'s"}));
  EXPECT_EQ(Split(smollm, "\xC2\xBD"), (Pieces{"\xC2\xBD"}));  // ½ is \p{N} too
  EXPECT_EQ(Split(smollm, "Hi there!"), (Pieces{"Hi", " there", "!"}));
}

TEST(PreTokenizerTest, Llama3) {
  const auto llama3 = PreTokenizerType::kLlama3;
  EXPECT_EQ(Split(llama3, "Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(Split(llama3, "I'M"), (Pieces{"I", "'M"}));  // case-insensitive contractions
  EXPECT_EQ(Split(llama3, "1234567"), (Pieces{"123", "456", "7"}));
  EXPECT_EQ(Split(llama3, " 12"), (Pieces{" ", "12"}));
  // Any one non-letter, non-digit, non-newline character may prefix a word.
  EXPECT_EQ(Split(llama3, "(hello)"), (Pieces{"(hello", ")"}));
  EXPECT_EQ(Split(llama3, "\tfoo"), (Pieces{"\tfoo"}));
  EXPECT_EQ(Split(llama3, "\nfoo"), (Pieces{"\n", "foo"}));
  // Punctuation takes the line breaks after it; whitespace runs end at their last line break.
  EXPECT_EQ(Split(llama3, "a...\n\nb"), (Pieces{"a", "...\n\n", "b"}));
  EXPECT_EQ(Split(llama3, "x\n\n  y"), (Pieces{"x", "\n\n", " ", " y"}));
  EXPECT_EQ(Split(llama3, "x \n \n  "), (Pieces{"x", " \n \n", "  "}));
  EXPECT_EQ(Split(llama3, "a ?!\r\n"), (Pieces{"a", " ?!\r\n"}));
}

TEST(PreTokenizerTest, Qwen2SplitsDigitsOneByOne) {
  const auto qwen2 = PreTokenizerType::kQwen2;
  EXPECT_EQ(Split(qwen2, "1234"), (Pieces{"1", "2", "3", "4"}));
  EXPECT_EQ(Split(qwen2, "ab12 x"), (Pieces{"ab", "1", "2", " x"}));
  EXPECT_EQ(Split(qwen2, "(hello)\n\n"), (Pieces{"(hello", ")\n\n"}));
}

TEST(PreTokenizerTest, MalformedBytesAreKept) {
  EXPECT_EQ(Split(PreTokenizerType::kGpt2, "a\xFF\xFE\x62"), (Pieces{"a", "\xFF\xFE", "b"}));
  EXPECT_EQ(Split(PreTokenizerType::kLlama3, "\xC3\x62"), (Pieces{"\xC3\x62"}));
}

TEST(PreTokenizerTest, PiecesCoverRandomInputExactly) {
  std::mt19937 rng(7);
  const std::string alphabet[] = {
      "a",    "Z",        "7",           " ", "  ",       "\n",           "\r\n",
      "\t",   "'",        "s",           "!", "\xC3\xA9", "\xE4\xB8\xAD", "\xF0\x9F\x98\x80",
      "\xFF", "\xCC\x81", "\xE3\x80\x80"};
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    const int length = std::uniform_int_distribution<int>(0, 40)(rng);
    for (int i = 0; i < length; ++i) {
      text += alphabet[std::uniform_int_distribution<size_t>(0, std::size(alphabet) - 1)(rng)];
    }
    for (auto type : {PreTokenizerType::kGpt2, PreTokenizerType::kSmolLM, PreTokenizerType::kLlama3,
                      PreTokenizerType::kQwen2}) {
      std::string joined;
      for (const std::string& piece : Split(type, text)) {
        ASSERT_FALSE(piece.empty());
        joined += piece;
      }
      EXPECT_EQ(joined, text) << PreTokenizerName(type);
    }
  }
}

}  // namespace
}  // namespace shadowkv
