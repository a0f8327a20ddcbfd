// Tests for the Unicode tables and lenient UTF-8 handling.
#include "format/unicode.h"

#include <gtest/gtest.h>

namespace shadowkv::unicode {
namespace {

TEST(UnicodeTest, FlagsFollowGeneralCategories) {
  EXPECT_EQ(GetFlags('a'), kLetter);
  EXPECT_EQ(GetFlags('Z'), kLetter);
  EXPECT_EQ(GetFlags(0xE9), kLetter);    // é
  EXPECT_EQ(GetFlags(0x4E00), kLetter);  // CJK ideograph (Lo)
  EXPECT_EQ(GetFlags(0x02B0), kLetter);  // modifier letter small h (Lm)
  EXPECT_EQ(GetFlags('7'), kNumber);
  EXPECT_EQ(GetFlags(0x0663), kNumber);  // Arabic-Indic digit three (Nd)
  EXPECT_EQ(GetFlags(0x2163), kNumber);  // Roman numeral four (Nl)
  EXPECT_EQ(GetFlags(0x00BD), kNumber);  // vulgar fraction one half (No)
  EXPECT_EQ(GetFlags(0x0301), kMark);    // combining acute accent
  EXPECT_EQ(GetFlags('!'), kPunctuation);
  EXPECT_EQ(GetFlags('_'), kPunctuation);
  EXPECT_EQ(GetFlags('$'), kSymbol);
  EXPECT_EQ(GetFlags('+'), kSymbol);
  EXPECT_EQ(GetFlags(0x1F600), kSymbol);  // grinning face
  EXPECT_EQ(GetFlags(0x200D), kOther);    // zero width joiner (Cf)
  EXPECT_EQ(GetFlags(0x0378), 0);         // unassigned
  EXPECT_EQ(GetFlags(0x110000), 0);       // past the last codepoint
}

TEST(UnicodeTest, WhitespaceIsTheWhiteSpaceProperty) {
  for (char32_t codepoint : {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x200A,
                             0x2028, 0x2029, 0x202F, 0x205F, 0x3000}) {
    EXPECT_TRUE(IsWhitespace(codepoint)) << std::hex << static_cast<uint32_t>(codepoint);
  }
  EXPECT_EQ(GetFlags(' '), kWhitespace | kSeparator);
  EXPECT_EQ(GetFlags('\n'), kWhitespace | kOther);
  // Not White_Space, though some libraries call them spaces.
  for (char32_t codepoint : {0x1C, 0x1F, 0x200B, 0x180E, 0xFEFF}) {
    EXPECT_FALSE(IsWhitespace(codepoint)) << std::hex << static_cast<uint32_t>(codepoint);
  }
}

TEST(UnicodeTest, DecodesWellFormedSequences) {
  const std::string text = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";  // a é € 😀
  DecodedCodepoint decoded = DecodeUtf8(text, 0);
  EXPECT_EQ(static_cast<uint32_t>(decoded.codepoint), 0x61u);
  EXPECT_EQ(decoded.num_bytes, 1u);
  decoded = DecodeUtf8(text, 1);
  EXPECT_EQ(static_cast<uint32_t>(decoded.codepoint), 0xE9u);
  EXPECT_EQ(decoded.num_bytes, 2u);
  decoded = DecodeUtf8(text, 3);
  EXPECT_EQ(static_cast<uint32_t>(decoded.codepoint), 0x20ACu);
  EXPECT_EQ(decoded.num_bytes, 3u);
  decoded = DecodeUtf8(text, 6);
  EXPECT_EQ(static_cast<uint32_t>(decoded.codepoint), 0x1F600u);
  EXPECT_EQ(decoded.num_bytes, 4u);
}

TEST(UnicodeTest, MalformedSequencesConsumeOneByte) {
  for (const std::string& bad : {std::string("\x80"),              // lone continuation
                                 std::string("\xC0\x80"),          // overlong NUL
                                 std::string("\xE0\x80\xAF"),      // overlong '/'
                                 std::string("\xED\xA0\x80"),      // surrogate U+D800
                                 std::string("\xF4\x90\x80\x80"),  // U+110000
                                 std::string("\xE2\x82"),          // truncated
                                 std::string("\xC3(")}) {          // lead byte then ASCII
    const DecodedCodepoint decoded = DecodeUtf8(bad, 0);
    EXPECT_TRUE(decoded.codepoint == kInvalidCodepoint) << "input of " << bad.size() << " bytes";
    EXPECT_EQ(decoded.num_bytes, 1u) << bad;
  }
}

TEST(UnicodeTest, AppendUtf8Encodes) {
  std::string out;
  for (char32_t codepoint : {0x24, 0xA2, 0x939, 0x20AC, 0xD55C, 0x10348}) {
    AppendUtf8(codepoint, out);
  }
  EXPECT_EQ(out, "$\xC2\xA2\xE0\xA4\xB9\xE2\x82\xAC\xED\x95\x9C\xF0\x90\x8D\x88");
}

TEST(UnicodeTest, CompletePrefixHoldsBackOnlyUnfinishedCharacters) {
  EXPECT_EQ(CompleteUtf8PrefixLength(""), 0u);
  EXPECT_EQ(CompleteUtf8PrefixLength("ab"), 2u);
  EXPECT_EQ(CompleteUtf8PrefixLength("a\xE2\x82"), 1u);      // € missing its last byte
  EXPECT_EQ(CompleteUtf8PrefixLength("a\xE2\x82\xAC"), 4u);  // € complete
  EXPECT_EQ(CompleteUtf8PrefixLength("\xF0\x9F"), 0u);       // half an emoji
  EXPECT_EQ(CompleteUtf8PrefixLength("\xF0\x9F\x98"), 0u);
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xE0"), 1u);  // E0 needs A0..BF next: still possible
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xED"), 1u);  // ED needs 80..9F next: still possible
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xF4"), 1u);
  // Bytes that can never become valid are passed on rather than held forever.
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xC0"), 2u);
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xFF"), 2u);
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xE0\x80"), 3u);  // overlong already
  EXPECT_EQ(CompleteUtf8PrefixLength("x\xED\xA0"), 3u);  // a surrogate already
  EXPECT_EQ(CompleteUtf8PrefixLength("\x80"), 1u);
}

TEST(UnicodeTest, ValidityAndReplacementOfMalformedBytes) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("caf\xC3\xA9 \xF0\x9F\x99\x82"));
  EXPECT_FALSE(IsValidUtf8("caf\xC3"));        // truncated
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));  // a surrogate
  std::string out = "x";
  AppendValidUtf8("a\xC3\xA9\xFF" "b\xE2\x82", out);
  EXPECT_EQ(out, "xa\xC3\xA9\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD");
}

}  // namespace
}  // namespace shadowkv::unicode
