// Unicode helpers for the tokenizer: lenient UTF-8 decoding and codepoint classes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shadowkv::unicode {

// Codepoint classes as bit flags: one major general category (none for unassigned codepoints)
// plus the White_Space property. Values are fixed by scripts/gen_unicode_tables.py.
enum CodepointFlag : uint8_t {
  kLetter = 0x01,       // \p{L}
  kNumber = 0x02,       // \p{N}
  kMark = 0x04,         // \p{M}
  kPunctuation = 0x08,  // \p{P}
  kSymbol = 0x10,       // \p{S}
  kSeparator = 0x20,    // \p{Z}
  kOther = 0x40,        // \p{C} except unassigned (Cc, Cf, Cs, Co)
  kWhitespace = 0x80,   // \s: White_Space property
};

// Flags of `codepoint`; codepoints past 0x10FFFF get none.
uint8_t GetFlags(char32_t codepoint);

inline bool IsLetter(char32_t codepoint) { return GetFlags(codepoint) & kLetter; }
inline bool IsNumber(char32_t codepoint) { return GetFlags(codepoint) & kNumber; }
inline bool IsWhitespace(char32_t codepoint) { return GetFlags(codepoint) & kWhitespace; }

// Stands for a byte that does not start a well-formed UTF-8 sequence. It is not a Unicode
// scalar value, so it has no flags: regex-wise it behaves like an unassigned character.
inline constexpr char32_t kInvalidCodepoint = 0xFFFFFFFF;

struct DecodedCodepoint {
  char32_t codepoint;  // kInvalidCodepoint for a malformed byte
  uint32_t num_bytes;  // 1..4; a malformed sequence consumes exactly one byte
};

// Decodes the codepoint starting at text[offset] (offset < text.size()). Overlong forms,
// surrogates, values past 0x10FFFF and truncated sequences are malformed, so every byte of the
// input is covered by exactly one decoded unit and the original bytes can always be recovered.
DecodedCodepoint DecodeUtf8(std::string_view text, size_t offset);

// Appends the UTF-8 encoding of a valid codepoint.
void AppendUtf8(char32_t codepoint, std::string& out);

// Length of the longest prefix of `bytes` that does not end inside an incomplete (but so far
// well-formed) multi-byte sequence. Malformed bytes count as complete: they will never become
// valid, so holding them back would stall a stream forever.
size_t CompleteUtf8PrefixLength(std::string_view bytes);

// Whether every byte of `text` belongs to a well-formed codepoint.
bool IsValidUtf8(std::string_view text);

// Appends `bytes` with every malformed byte replaced by U+FFFD.
void AppendValidUtf8(std::string_view bytes, std::string& out);

namespace internal {
struct CodepointRange {
  char32_t first;
  char32_t last;
  uint8_t flags;
};
extern const CodepointRange kCodepointRanges[];  // sorted, contiguous, covering 0..0x10FFFF
extern const size_t kNumCodepointRanges;
}  // namespace internal

}  // namespace shadowkv::unicode
