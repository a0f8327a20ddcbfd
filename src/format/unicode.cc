// Unicode helpers: table lookups and UTF-8 decoding that never loses a byte.
#include "format/unicode.h"

#include <algorithm>
#include <array>

namespace shadowkv::unicode {
namespace {

// ASCII dominates most text, so it skips the binary search.
std::array<uint8_t, 128> BuildAsciiFlags() {
  std::array<uint8_t, 128> flags{};
  const internal::CodepointRange* range = internal::kCodepointRanges;
  for (char32_t codepoint = 0; codepoint < 128; ++codepoint) {
    while (codepoint > range->last) ++range;
    flags[codepoint] = range->flags;
  }
  return flags;
}

const std::array<uint8_t, 128> kAsciiFlags = BuildAsciiFlags();

}  // namespace

uint8_t GetFlags(char32_t codepoint) {
  if (codepoint < 128) return kAsciiFlags[codepoint];
  if (codepoint > 0x10FFFF) return 0;
  const internal::CodepointRange* begin = internal::kCodepointRanges;
  const internal::CodepointRange* end = begin + internal::kNumCodepointRanges;
  const internal::CodepointRange* range = std::upper_bound(
      begin, end, codepoint,
      [](char32_t value, const internal::CodepointRange& r) { return value < r.first; });
  return (range - 1)->flags;  // the table starts at 0, so range > begin
}

DecodedCodepoint DecodeUtf8(std::string_view text, size_t offset) {
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte_at(offset);
  if (lead < 0x80) return {lead, 1};

  uint32_t num_bytes;
  char32_t codepoint;
  char32_t min_value;  // smallest value this length may encode (rejects overlong forms)
  if ((lead & 0xE0) == 0xC0) {
    num_bytes = 2, codepoint = lead & 0x1F, min_value = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    num_bytes = 3, codepoint = lead & 0x0F, min_value = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    num_bytes = 4, codepoint = lead & 0x07, min_value = 0x10000;
  } else {
    return {kInvalidCodepoint, 1};  // continuation byte or 0xF8..0xFF
  }
  if (offset + num_bytes > text.size()) return {kInvalidCodepoint, 1};
  for (uint32_t i = 1; i < num_bytes; ++i) {
    const uint8_t byte = byte_at(offset + i);
    if ((byte & 0xC0) != 0x80) return {kInvalidCodepoint, 1};
    codepoint = (codepoint << 6) | (byte & 0x3F);
  }
  if (codepoint < min_value || codepoint > 0x10FFFF ||
      (codepoint >= 0xD800 && codepoint <= 0xDFFF)) {
    return {kInvalidCodepoint, 1};
  }
  return {codepoint, num_bytes};
}

void AppendUtf8(char32_t codepoint, std::string& out) {
  if (codepoint < 0x80) {
    out.push_back(static_cast<char>(codepoint));
  } else if (codepoint < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (codepoint >> 6)));
    out.push_back(static_cast<char>(0x80 | (codepoint & 0x3F)));
  } else if (codepoint < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (codepoint >> 12)));
    out.push_back(static_cast<char>(0x80 | ((codepoint >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (codepoint & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (codepoint >> 18)));
    out.push_back(static_cast<char>(0x80 | ((codepoint >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((codepoint >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (codepoint & 0x3F)));
  }
}

size_t CompleteUtf8PrefixLength(std::string_view bytes) {
  // Only the last 3 bytes can belong to an unfinished sequence.
  const size_t size = bytes.size();
  for (size_t back = 1; back <= 3 && back <= size; ++back) {
    const uint8_t byte = static_cast<uint8_t>(bytes[size - back]);
    if ((byte & 0xC0) == 0x80) continue;  // continuation: keep looking for the lead byte
    uint32_t needed = 0;
    if ((byte & 0xE0) == 0xC0) {
      needed = 2;
    } else if ((byte & 0xF0) == 0xE0) {
      needed = 3;
    } else if ((byte & 0xF8) == 0xF0) {
      needed = 4;
    }
    if (needed <= back) return size;  // ASCII, malformed lead, or a finished sequence
    // An unfinished sequence is held back only while what has arrived could still be valid.
    // The lowest or the highest continuation byte completes every valid prefix (E0 and F0 need
    // a high second byte, ED and F4 a low one).
    for (const char pad : {'\x80', '\xBF'}) {
      std::string completed(bytes.substr(size - back));
      completed.append(needed - back, pad);
      if (DecodeUtf8(completed, 0).codepoint != kInvalidCodepoint) return size - back;
    }
    return size;
  }
  return size;
}

bool IsValidUtf8(std::string_view text) {
  for (size_t offset = 0; offset < text.size();) {
    const DecodedCodepoint decoded = DecodeUtf8(text, offset);
    if (decoded.codepoint == kInvalidCodepoint) return false;
    offset += decoded.num_bytes;
  }
  return true;
}

void AppendValidUtf8(std::string_view bytes, std::string& out) {
  for (size_t offset = 0; offset < bytes.size();) {
    const DecodedCodepoint decoded = DecodeUtf8(bytes, offset);
    if (decoded.codepoint == kInvalidCodepoint) {
      out += "\xEF\xBF\xBD";
    } else {
      out.append(bytes.substr(offset, decoded.num_bytes));
    }
    offset += decoded.num_bytes;
  }
}

}  // namespace shadowkv::unicode
