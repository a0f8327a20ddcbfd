// Tests for byte-level BPE on a hand-made vocabulary, with merge results worked out by hand.
#include "format/tokenizer.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <utility>

#include "format/gguf.h"
#include "format/gguf_writer.h"

namespace shadowkv {
namespace {

using Ids = std::vector<int32_t>;

// GPT-2's byte-to-unicode form of one byte: printable Latin-1 stands for itself, the other
// bytes take U+0100.. in order (so ' ' is U+0120 'Ġ' and '\n' is U+010A 'Ċ').
std::string MappedByte(int byte) {
  static const std::vector<int> kUnprintable = [] {
    std::vector<int> bytes;
    for (int b = 0; b < 256; ++b) {
      if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
        bytes.push_back(b);
      }
    }
    return bytes;
  }();
  const auto it = std::find(kUnprintable.begin(), kUnprintable.end(), byte);
  const char32_t codepoint =
      it == kUnprintable.end() ? byte : 256 + static_cast<char32_t>(it - kUnprintable.begin());
  std::string out;
  if (codepoint < 0x80) {
    out.push_back(static_cast<char>(codepoint));
  } else {
    out.push_back(static_cast<char>(0xC0 | (codepoint >> 6)));
    out.push_back(static_cast<char>(0x80 | (codepoint & 0x3F)));
  }
  return out;
}

// Ids 0..255 are the bytes themselves; then merge results and special tokens.
constexpr int32_t kAb = 256, kAbc = 257, kSpaceA = 258, kBc = 259, kCc = 260;
constexpr int32_t kImStart = 261, kUser = 262, kImEnd = 263, kBos = 264, kEndOfText = 265;

TokenizerConfig SmallConfig(std::string pre = "gpt2") {
  TokenizerConfig config;
  for (int byte = 0; byte < 256; ++byte) config.tokens.push_back(MappedByte(byte));
  config.tokens.insert(config.tokens.end(),
                       {"ab", "abc", "\xC4\xA0\x61", "bc", "cc", "<|im_start|>", "<user>",
                        "<|im_end|>", "<s>", "<|endoftext|>"});
  config.token_types.assign(config.tokens.size(), TokenType::kNormal);
  config.token_types[kImStart] = TokenType::kControl;
  config.token_types[kUser] = TokenType::kUserDefined;
  config.token_types[kImEnd] = TokenType::kControl;
  config.token_types[kBos] = TokenType::kControl;
  config.token_types[kEndOfText] = TokenType::kControl;
  // Ranks 0..4 in this order.
  config.merges = {"a b", "ab c", "\xC4\xA0 a", "b c", "c c"};
  config.pre = std::move(pre);
  config.bos_id = kBos;
  config.eos_id = kImEnd;
  return config;
}

std::unique_ptr<Tokenizer> MakeTokenizer(TokenizerConfig config) {
  Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create(std::move(config));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

Ids Bytes(std::string_view text) {
  Ids ids;
  for (const char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

TEST(TokenizerTest, MergesApplyInRankOrder) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  // a·b (rank 0) first, then ab·c (rank 1).
  EXPECT_EQ(tokenizer->Encode("abc", false, false), (Ids{kAbc}));
  // b·c (rank 3) beats c·c (rank 4); bc·c is no merge.
  EXPECT_EQ(tokenizer->Encode("bcc", false, false), (Ids{kBc, 'c'}));
  // Two equal-rank pairs overlap: the leftmost wins.
  EXPECT_EQ(tokenizer->Encode("ccc", false, false), (Ids{kCc, 'c'}));
  // " abc" is one piece. Ġ·a (rank 2) loses to a·b (rank 0), and Ġ·ab is no merge.
  EXPECT_EQ(tokenizer->Encode(" abc", false, false), (Ids{' ', kAbc}));
  EXPECT_EQ(tokenizer->Encode(" a", false, false), (Ids{kSpaceA}));
  // Pieces never merge across their boundaries: "c" + " " + "c".
  EXPECT_EQ(tokenizer->Encode("c  c", false, false), (Ids{'c', ' ', ' ', 'c'}));
  EXPECT_EQ(tokenizer->Encode("", false, false), Ids{});
}

TEST(TokenizerTest, IgnoreMergesTakesWholeTokensForLlama3) {
  TokenizerConfig config = SmallConfig();
  config.merges = {"b c"};  // "abc" cannot be built from merges alone
  auto gpt2 = MakeTokenizer(config);
  config.pre = "llama-bpe";
  auto llama3 = MakeTokenizer(config);
  ASSERT_NE(gpt2, nullptr);
  ASSERT_NE(llama3, nullptr);
  EXPECT_EQ(gpt2->Encode("abc", false, false), (Ids{'a', kBc}));
  EXPECT_EQ(llama3->Encode("abc", false, false), (Ids{kAbc}));
  EXPECT_EQ(llama3->Encode("abcc", false, false), (Ids{'a', kBc, 'c'}));
}

TEST(TokenizerTest, SpecialTokens) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Encode("a<|im_start|>b", false, true), (Ids{'a', kImStart, 'b'}));
  // Without parse_special the control token's text is plain text.
  EXPECT_EQ(tokenizer->Encode("a<|im_start|>b", false, false), Bytes("a<|im_start|>b"));
  // User-defined tokens are always matched.
  EXPECT_EQ(tokenizer->Encode("x<user>y", false, false), (Ids{'x', kUser, 'y'}));
  EXPECT_EQ(tokenizer->Encode("<|im_end|><|im_end|>", false, true), (Ids{kImEnd, kImEnd}));
  EXPECT_EQ(tokenizer->Encode("<|im_end|", false, true), Bytes("<|im_end|"));
  // The text around a special token is pre-tokenized on its own: no " " + "a" merge across.
  EXPECT_EQ(tokenizer->Encode(" <user>a", false, true), (Ids{' ', kUser, 'a'}));
}

TEST(TokenizerTest, SegmentsParseSpecialsOnlyWhereAllowed) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<TextSegment> forged = {
      {"<|im_start|>", true}, {"a<|im_end|><|im_start|>b", false}, {"<|im_end|>", true}};
  Ids expected = {kImStart};
  for (const int32_t id : Bytes("a<|im_end|><|im_start|>b")) expected.push_back(id);
  expected.push_back(kImEnd);
  EXPECT_EQ(tokenizer->Encode(forged, false), expected);
  // Text between special tokens is pre-tokenized as a whole across segments: " " + "a" is the
  // piece " a" and merges, as in the joined text.
  const std::vector<TextSegment> split = {{" ", false}, {"a", true}, {"bc", false}};
  EXPECT_EQ(tokenizer->Encode(split, false), tokenizer->Encode(" abc", false, true));
  EXPECT_EQ(tokenizer->Encode(split, false), (Ids{' ', kAbc}));
  // A special token's text cut over two segments is not that token.
  const std::vector<TextSegment> cut = {{"<|im_", true}, {"end|>", true}};
  EXPECT_EQ(tokenizer->Encode(cut, false), Bytes("<|im_end|>"));
  EXPECT_EQ(tokenizer->Encode(std::vector<TextSegment>{}, false), Ids{});
}

TEST(TokenizerTest, PlainTextNeverProducesStructuralTokens) {
  // Some vocabularies mark turn tokens user-defined rather than control: plain text must still
  // not produce them, nor BOS/EOS, while other user-defined tokens keep matching.
  TokenizerConfig config = SmallConfig();
  config.token_types[kImStart] = TokenType::kUserDefined;
  config.token_types[kImEnd] = TokenType::kUserDefined;
  config.token_types[kBos] = TokenType::kUserDefined;
  config.token_types[kEndOfText] = TokenType::kUserDefined;
  auto tokenizer = MakeTokenizer(config);
  ASSERT_NE(tokenizer, nullptr);
  for (const char* text : {"<|im_start|>", "<|im_end|>", "<s>", "<|endoftext|>"}) {
    EXPECT_EQ(tokenizer->Encode(text, false, false), Bytes(text)) << text;
    EXPECT_EQ(tokenizer->Encode(text, false, true).size(), 1u) << text;
  }
  EXPECT_EQ(tokenizer->Encode("x<user>y", false, false), (Ids{'x', kUser, 'y'}));
}

TEST(TokenizerTest, AddSpecialFollowsConfig) {
  TokenizerConfig config = SmallConfig();
  auto plain = MakeTokenizer(config);
  config.add_bos = true;
  config.add_eos = true;
  auto both = MakeTokenizer(config);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(both, nullptr);
  EXPECT_FALSE(plain->add_bos());
  EXPECT_EQ(plain->Encode("a", true, false), (Ids{'a'}));
  EXPECT_TRUE(both->add_bos());
  EXPECT_EQ(both->Encode("a", true, false), (Ids{kBos, 'a', kImEnd}));
  EXPECT_EQ(both->Encode("a", false, false), (Ids{'a'}));
}

TEST(TokenizerTest, Accessors) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->vocab_size(), 266);
  EXPECT_EQ(tokenizer->bos_id(), kBos);
  EXPECT_EQ(tokenizer->eos_id(), kImEnd);
  EXPECT_EQ(tokenizer->TokenText(kSpaceA), "\xC4\xA0\x61");
  EXPECT_EQ(tokenizer->TokenBytes(kSpaceA), " a");
  EXPECT_EQ(tokenizer->TokenBytes('\n'), "\n");
  EXPECT_EQ(tokenizer->TokenText(9999), "");
  EXPECT_EQ(tokenizer->FindToken("<|im_start|>"), kImStart);
  EXPECT_EQ(tokenizer->FindToken("zzz"), -1);
  // End of generation: the EOS, plus known end-of-text tokens by name.
  EXPECT_TRUE(tokenizer->IsEndOfGeneration(kImEnd));
  EXPECT_TRUE(tokenizer->IsEndOfGeneration(kEndOfText));
  EXPECT_FALSE(tokenizer->IsEndOfGeneration(kImStart));
  EXPECT_FALSE(tokenizer->IsEndOfGeneration('a'));
  // No eot_id in the config: <|im_end|> is the end-of-turn token.
  EXPECT_EQ(tokenizer->eot_id(), kImEnd);
}

// A GLM-4 vocabulary (no <|im_end|> or <|eot_id|>) whose file names no eot token: the model
// ends its turn by opening the user's, so <|user|> ends generation.
TEST(TokenizerTest, GlmUserMarkerEndsTheTurnWhenNoEotIsNamed) {
  TokenizerConfig config;
  for (int byte = 0; byte < 256; ++byte) config.tokens.push_back(MappedByte(byte));
  config.tokens.insert(config.tokens.end(),
                       {"<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>"});
  config.token_types.assign(256, TokenType::kNormal);
  config.token_types.resize(config.tokens.size(), TokenType::kControl);
  config.eos_id = 256;
  auto tokenizer = MakeTokenizer(std::move(config));
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->eot_id(), 259);
  EXPECT_TRUE(tokenizer->IsEndOfGeneration(259));
  EXPECT_TRUE(tokenizer->IsEndOfGeneration(256));
  EXPECT_FALSE(tokenizer->IsEndOfGeneration(260));
}

TEST(TokenizerTest, Decode) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  const Ids ids = {kAbc, ' ', kImStart, kUser, '\n', 9999, -1};
  EXPECT_EQ(tokenizer->Decode(ids), "abc <|im_start|><user>\n");
  EXPECT_EQ(tokenizer->Decode(ids, /*skip_special=*/true), "abc <user>\n");
}

TEST(TokenizerTest, RoundTripsArbitraryBytes) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    std::string text;
    const int length = std::uniform_int_distribution<int>(0, 64)(rng);
    for (int i = 0; i < length; ++i) {
      // Mostly a, b, c and spaces so that merges fire, plus any byte at all.
      const int pick = std::uniform_int_distribution<int>(0, 9)(rng);
      text.push_back(pick < 6 ? "abc  "[pick % 5] : static_cast<char>(rng() & 0xFF));
    }
    EXPECT_EQ(tokenizer->Decode(tokenizer->Encode(text, false, false)), text);
  }
}

TEST(TokenizerTest, BytesWithoutTokensAreDropped) {
  TokenizerConfig config = SmallConfig();
  config.tokens[0x04] = "<unused-4>";  // byte 0x04 loses its token
  auto tokenizer = MakeTokenizer(config);
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Encode("a\x04\x62", false, false), (Ids{'a', 'b'}));

  config = SmallConfig();
  config.tokens[0xF0] = "<unused-f0>";
  tokenizer = MakeTokenizer(config);
  ASSERT_NE(tokenizer, nullptr);
  // "a\U00010400b" is one piece (three letters); the tokenless lead byte 0xF0 of the middle one
  // still separates a and b, so they do not merge.
  EXPECT_EQ(tokenizer->Encode("a\xF0\x90\x90\x80\x62", false, false),
            (Ids{'a', 0x90, 0x90, 0x80, 'b'}));
}

TEST(TokenizerTest, RejectsVocabulariesThatCannotSpellText) {
  // A letter without its byte token: text holding it would lose bytes.
  TokenizerConfig config = SmallConfig();
  config.tokens['q'] = "<unused-q>";
  Result<std::unique_ptr<Tokenizer>> result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(result.status().message().find("no token for byte 0x71 (byte-level text 'q')"),
            std::string::npos)
      << result.status().message();

  // Every token text empty: the error counts them and names the first.
  config = SmallConfig();
  for (std::string& token : config.tokens) token.clear();
  config.merges.clear();
  result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(result.status().message().find("266 tokens are empty (first: token 0)"),
            std::string::npos)
      << result.status().message();

  // Byte texts stored raw instead of byte-mapped: 0x80..0xFF alone are not valid UTF-8.
  config = SmallConfig();
  for (int byte = 0; byte < 256; ++byte)
    config.tokens[byte] = std::string(1, static_cast<char>(byte));
  config.merges.clear();
  result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("no token for byte 0x09"), std::string::npos)
      << result.status().message();
  EXPECT_NE(
      result.status().message().find("128 token texts are not valid UTF-8 (first: token 128)"),
      std::string::npos)
      << result.status().message();

  config = SmallConfig();
  config.token_types[7] = static_cast<TokenType>(42);
  result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().message(), "token 7 has type 42; token types are 0..6");
}

TEST(TokenizerTest, ToleratesAFewOddTokens) {
  // Real vocabularies hold the odd empty or malformed token (and some lack rare control bytes):
  // the model must still load, and text must encode as before.
  TokenizerConfig config = SmallConfig();
  config.tokens.push_back("");
  config.tokens.push_back("\xFF\xFE");
  config.token_types.push_back(TokenType::kNormal);
  config.token_types.push_back(TokenType::kUserDefined);
  config.tokens[0x13] = "<unused-13>";
  auto tokenizer = MakeTokenizer(config);
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Encode(" abc<|im_end|>", false, true), (Ids{' ', kAbc, kImEnd}));
  EXPECT_EQ(tokenizer->Encode("a\x13q", false, false), (Ids{'a', 'q'}));
}

TEST(TokenizerTest, LongRepetitiveInput) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  // One 200K-byte piece: "ab" x 100000 merges pairwise to kAb everywhere.
  std::string text;
  for (int i = 0; i < 100000; ++i) text += "ab";
  const Ids ids = tokenizer->Encode(text, false, false);
  ASSERT_EQ(ids.size(), 100000u);
  EXPECT_TRUE(std::all_of(ids.begin(), ids.end(), [](int32_t id) { return id == kAb; }));
}

TEST(TokenizerTest, RejectsBadConfigs) {
  TokenizerConfig config = SmallConfig("tekken");
  Result<std::unique_ptr<Tokenizer>> result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(result.status().message().find("llama-bpe"), std::string::npos);

  config = SmallConfig();
  config.token_types.pop_back();
  result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kCorrupt);

  config = SmallConfig();
  config.merges.push_back("abc");
  result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kCorrupt);

  config = SmallConfig();
  config.eos_id = 100000;
  result = Tokenizer::Create(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kCorrupt);
}

// A GGUF image holding SmallConfig() as tokenizer.ggml.* metadata (add_bos_token true unless
// `with_add_bos` is false, which leaves the key out).
std::vector<uint8_t> SmallGguf(const std::string& model, const std::string& pre,
                               bool with_add_bos = true) {
  const TokenizerConfig config = SmallConfig();
  gguf::GgufWriter writer;
  writer.AddString("general.architecture", "llama");
  writer.AddString("tokenizer.ggml.model", model);
  writer.AddString("tokenizer.ggml.pre", pre);
  writer.AddStringArray("tokenizer.ggml.tokens", config.tokens);
  std::vector<int32_t> types;
  for (const TokenType type : config.token_types) types.push_back(static_cast<int32_t>(type));
  writer.AddInt32Array("tokenizer.ggml.token_type", types);
  writer.AddStringArray("tokenizer.ggml.merges", config.merges);
  writer.AddUint32("tokenizer.ggml.bos_token_id", kBos);
  writer.AddUint32("tokenizer.ggml.eos_token_id", kImEnd);
  writer.AddUint32("tokenizer.ggml.padding_token_id", kEndOfText);
  if (with_add_bos) writer.AddBool("tokenizer.ggml.add_bos_token", true);
  return writer.Finish();
}

// Without add_bos_token, a Llama 3 vocabulary takes a BOS; GLM-4's (the same split, pre
// chatglm-bpe or glm4) does not: its template opens every prompt with [gMASK]<sop>.
TEST(TokenizerTest, GlmVocabulariesTakeNoBosByDefault) {
  for (const auto& [pre, want_bos] : std::vector<std::pair<std::string, bool>>{
           {"llama-bpe", true}, {"chatglm-bpe", false}, {"glm4", false}}) {
    auto file = gguf::GgufFile::FromBytes(SmallGguf("gpt2", pre, /*with_add_bos=*/false));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(*file.value());
    ASSERT_TRUE(tokenizer.ok()) << pre << ": " << tokenizer.status().ToString();
    EXPECT_EQ((*tokenizer)->pre_tokenizer(), PreTokenizerType::kLlama3) << pre;
    EXPECT_EQ((*tokenizer)->add_bos(), want_bos) << pre;
  }
}

TEST(TokenizerTest, FromGguf) {
  auto file = gguf::GgufFile::FromBytes(SmallGguf("gpt2", "smollm"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(*file.value());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  const Tokenizer& loaded = *tokenizer.value();
  EXPECT_EQ(loaded.pre_tokenizer(), PreTokenizerType::kSmolLM);
  EXPECT_EQ(loaded.padding_id(), kEndOfText);
  EXPECT_TRUE(loaded.add_bos());
  EXPECT_FALSE(loaded.add_eos());
  EXPECT_EQ(loaded.Encode(" abc<|im_end|>", true, true), (Ids{kBos, ' ', kAbc, kImEnd}));
}

TEST(TokenizerTest, FromGgufRejectsUnsupportedModels) {
  auto wordpiece = gguf::GgufFile::FromBytes(SmallGguf("bert", "default"));
  ASSERT_TRUE(wordpiece.ok()) << wordpiece.status().ToString();
  Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(*wordpiece.value());
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(tokenizer.status().message().find("gpt2"), std::string::npos);
  EXPECT_NE(tokenizer.status().message().find("llama (SentencePiece)"), std::string::npos);

  auto pre = gguf::GgufFile::FromBytes(SmallGguf("gpt2", "chameleon"));
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  tokenizer = Tokenizer::FromGguf(*pre.value());
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(tokenizer.status().message().find("chameleon"), std::string::npos);
  EXPECT_NE(tokenizer.status().message().find("qwen2"), std::string::npos);
}

TEST(StreamingDecoderTest, HoldsSplitCharacters) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  StreamingDecoder decoder(*tokenizer);
  EXPECT_EQ(decoder.Push(kAbc), "abc");
  EXPECT_EQ(decoder.Push(0xC3), "");  // first byte of é
  EXPECT_EQ(decoder.Push(0xA9), "\xC3\xA9");
  EXPECT_EQ(decoder.Push(0xF0), "");  // 😀 in four tokens
  EXPECT_EQ(decoder.Push(0x9F), "");
  EXPECT_EQ(decoder.Push(0x98), "");
  EXPECT_EQ(decoder.Push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(decoder.Push(kImStart), "<|im_start|>");
  EXPECT_EQ(decoder.Flush(), "");
}

TEST(StreamingDecoderTest, ReplacesMalformedBytes) {
  auto tokenizer = MakeTokenizer(SmallConfig());
  ASSERT_NE(tokenizer, nullptr);
  StreamingDecoder decoder(*tokenizer, /*skip_special=*/true);
  EXPECT_EQ(decoder.Push(0xFF), "\xEF\xBF\xBD");
  EXPECT_EQ(decoder.Push(kImStart), "");  // skipped
  EXPECT_EQ(decoder.Push(0xE2), "");
  EXPECT_EQ(decoder.Push('x'), "\xEF\xBF\xBDx");  // € cut short by 'x'
  EXPECT_EQ(decoder.Push(0xE2), "");
  EXPECT_EQ(decoder.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(decoder.Push('y'), "y");
}

// A SentencePiece vocabulary: U+2581 for spaces, merges by score, <0xAB> byte fallback (only
// for the bytes of 'c' and of U+00E9; the byte 0xFF has no token).
constexpr const char* kSp = "\xE2\x96\x81";
std::unique_ptr<Tokenizer> SentencePieceTokenizer(bool add_space_prefix) {
  TokenizerConfig config;
  config.sentencepiece = true;
  config.add_space_prefix = add_space_prefix;
  const auto add = [&](std::string text, TokenType type, float score) {
    config.tokens.push_back(std::move(text));
    config.token_types.push_back(type);
    config.scores.push_back(score);
  };
  add("<unk>", TokenType::kUnknown, 0.0f);                  // 0
  add("<bos>", TokenType::kControl, 0.0f);                  // 1
  add(kSp, TokenType::kNormal, -5.0f);                      // 2
  add("a", TokenType::kNormal, -3.0f);                      // 3
  add("b", TokenType::kNormal, -3.0f);                      // 4
  add(std::string(kSp) + "a", TokenType::kNormal, -1.0f);   // 5
  add("ab", TokenType::kNormal, -2.0f);                     // 6
  add(std::string(kSp) + "ab", TokenType::kNormal, -0.5f);  // 7
  add("<0x63>", TokenType::kByte, 0.0f);                    // 8: 'c'
  add("<0xC3>", TokenType::kByte, 0.0f);                    // 9
  add("<0xA9>", TokenType::kByte, 0.0f);                    // 10
  add("<start_of_turn>", TokenType::kControl, 0.0f);        // 11
  config.bos_id = 1;
  config.add_bos = true;
  auto tokenizer = Tokenizer::Create(std::move(config));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

TEST(SentencePieceTokenizerTest, MergesByScoreAndFallsBackToBytes) {
  const auto tokenizer = SentencePieceTokenizer(false);
  ASSERT_NE(tokenizer, nullptr);
  using Ids = std::vector<int32_t>;
  // "a▁ab": ▁a (-1) merges first, then ▁a+b = ▁ab (-0.5); "ab" (-2) never gets its turn.
  EXPECT_EQ(tokenizer->Encode("a ab", false, false), (Ids{3, 7}));
  EXPECT_EQ(tokenizer->Encode("ab", true, false), (Ids{1, 6}));
  // Characters without a token become their byte tokens; a byte without one is dropped.
  EXPECT_EQ(tokenizer->Encode("c\xC3\xA9\xFF", false, false), (Ids{8, 9, 10}));
  EXPECT_EQ(tokenizer->Encode("<start_of_turn>ab", false, true), (Ids{11, 6}));
  // Unparsed, a control token's text is only characters: here just its 'a' has a token.
  EXPECT_EQ(tokenizer->Encode("<start_of_turn>", false, false), Ids{3});
  EXPECT_EQ(tokenizer->Decode(Ids{3, 7, 8, 9, 10}), "a abc\xC3\xA9");
  EXPECT_EQ(tokenizer->Decode(Ids{1, 3}, /*skip_special=*/true), "a");
  EXPECT_EQ(tokenizer->TokenBytes(7), " ab");
}

TEST(SentencePieceTokenizerTest, SpacePrefixOpensEachRunOfText) {
  const auto tokenizer = SentencePieceTokenizer(true);
  ASSERT_NE(tokenizer, nullptr);
  using Ids = std::vector<int32_t>;
  EXPECT_EQ(tokenizer->Encode("ab", false, false), (Ids{7}));
  EXPECT_EQ(tokenizer->Encode("ab<start_of_turn>ab", false, true), (Ids{7, 11, 7}));
}

TEST(SentencePieceTokenizerTest, RefusesScoresThatDoNotFit) {
  TokenizerConfig config;
  config.sentencepiece = true;
  config.tokens = {"a", "b"};
  config.scores = {0.0f};
  auto tokenizer = Tokenizer::Create(config);
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_NE(tokenizer.status().message().find("2 tokens but 1 scores"), std::string::npos);
  config.scores = {0.0f, std::numeric_limits<float>::quiet_NaN()};
  tokenizer = Tokenizer::Create(config);
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), ErrorCode::kCorrupt);
}

// From GGUF: tokenizer.ggml.model "llama" with scores; without scores it is refused.
TEST(SentencePieceTokenizerTest, ReadsGguf) {
  const auto write = [](bool with_scores) {
    gguf::GgufWriter writer;
    writer.AddString("tokenizer.ggml.model", "llama");
    writer.AddStringArray("tokenizer.ggml.tokens", {"<unk>", "a", std::string(kSp) + "a"});
    if (with_scores) {
      gguf::Value scores;
      scores.type = gguf::ValueType::kArray;
      scores.element_type = gguf::ValueType::kFloat32;
      std::vector<gguf::Value> elements;
      for (double score : {0.0, -2.0, -1.0}) {
        elements.push_back(gguf::MakeFloat(gguf::ValueType::kFloat32, score));
      }
      scores.data = std::move(elements);
      EXPECT_TRUE(writer.AddValue("tokenizer.ggml.scores", scores).ok());
    }
    writer.AddBool("tokenizer.ggml.add_bos_token", false);
    return gguf::GgufFile::FromBytes(writer.Finish());
  };
  auto file = write(true);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto tokenizer = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  // add_space_prefix defaults to true, as llama.cpp reads SentencePiece files.
  EXPECT_EQ((*tokenizer)->Encode("a", true, false), (std::vector<int32_t>{2}));
  file = write(false);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  tokenizer = Tokenizer::FromGguf(**file);
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_NE(tokenizer.status().message().find("tokenizer.ggml.scores"), std::string::npos);
}

}  // namespace
}  // namespace shadowkv
