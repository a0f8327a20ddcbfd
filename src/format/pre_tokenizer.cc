// Pre-tokenizers as hand-written matchers: each alternative of the regex is tried in order at
// the current position, and the first that matches gives the next piece.
#include "format/pre_tokenizer.h"

#include <algorithm>

#include "format/unicode.h"

namespace shadowkv {
namespace {

using unicode::kLetter;
using unicode::kNumber;
using unicode::kWhitespace;

struct Unit {
  uint32_t offset;  // byte offset in the text
  char32_t codepoint;
  uint8_t flags;
};

// A run of text decoded into codepoints. Matchers work on [begin, end) of it: for kSmolLM,
// end is the next digit, and lookaheads such as (?!\S) see the segment end as end of text.
class Matcher {
 public:
  explicit Matcher(std::string_view text) {
    units_.reserve(text.size() + 1);
    for (size_t offset = 0; offset < text.size();) {
      const unicode::DecodedCodepoint decoded = unicode::DecodeUtf8(text, offset);
      units_.push_back(
          {static_cast<uint32_t>(offset), decoded.codepoint, unicode::GetFlags(decoded.codepoint)});
      offset += decoded.num_bytes;
    }
    units_.push_back({static_cast<uint32_t>(text.size()), 0, 0});  // sentinel
  }

  size_t size() const { return units_.size() - 1; }
  uint32_t offset(size_t i) const { return units_[i].offset; }
  char32_t codepoint(size_t i) const { return units_[i].codepoint; }
  bool Has(size_t i, uint8_t flag) const { return i < end_ && (units_[i].flags & flag); }
  // [^\s\p{L}\p{N}]: anything else, unassigned codepoints and malformed bytes included.
  bool IsOther(size_t i) const {
    return i < end_ && !(units_[i].flags & (kLetter | kNumber | kWhitespace));
  }
  bool IsNewline(size_t i) const {
    return i < end_ && (units_[i].codepoint == '\r' || units_[i].codepoint == '\n');
  }
  void set_end(size_t end) { end_ = end; }

  size_t RunEnd(size_t i, uint8_t flag) const {
    while (Has(i, flag)) ++i;
    return i;
  }
  size_t OtherRunEnd(size_t i) const {
    while (IsOther(i)) ++i;
    return i;
  }

  // 's|'t|'re|'ve|'m|'ll|'d, optionally ignoring ASCII case; returns the match length or 0.
  size_t MatchContraction(size_t i, bool ignore_case) const {
    if (codepoint(i) != '\'' || i + 1 >= end_) return 0;
    const auto letter_at = [&](size_t k) -> char32_t {
      const char32_t c = codepoint(k);
      return ignore_case && c >= 'A' && c <= 'Z' ? c + ('a' - 'A') : c;
    };
    const char32_t first = letter_at(i + 1);
    if (first == 's' || first == 't' || first == 'm' || first == 'd') return 2;
    if (i + 2 >= end_) return 0;
    const char32_t second = letter_at(i + 2);
    if ((first == 'r' && second == 'e') || (first == 'v' && second == 'e') ||
        (first == 'l' && second == 'l')) {
      return 3;
    }
    return 0;
  }

  // \s+(?!\S)|\s+ at a whitespace codepoint: a run followed by more text gives back its last
  // whitespace, which then prefixes the next piece.
  size_t MatchWhitespace(size_t i) const {
    const size_t run = RunEnd(i, kWhitespace) - i;
    return run >= 2 && i + run < end_ ? run - 1 : run;
  }

  size_t MatchGpt2(size_t i) const {
    if (size_t length = MatchContraction(i, /*ignore_case=*/false)) return length;
    // " ?" prefixes the next three alternatives.
    const size_t body = codepoint(i) == ' ' && i + 1 < end_ ? i + 1 : i;
    if (Has(body, kLetter)) return RunEnd(body, kLetter) - i;
    if (Has(body, kNumber)) return RunEnd(body, kNumber) - i;
    if (IsOther(body)) return OtherRunEnd(body) - i;
    return MatchWhitespace(i);
  }

  size_t MatchLlama3(size_t i, size_t max_digits) const {
    if (size_t length = MatchContraction(i, /*ignore_case=*/true)) return length;
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (Has(i, kLetter)) return RunEnd(i, kLetter) - i;
    if (!IsNewline(i) && !Has(i, kNumber) && Has(i + 1, kLetter)) {
      return RunEnd(i + 1, kLetter) - i;
    }
    // \p{N}{1,max_digits}
    if (Has(i, kNumber)) return std::min(RunEnd(i, kNumber) - i, max_digits);
    // " ?[^\s\p{L}\p{N}]+[\r\n]*"
    const size_t body = codepoint(i) == ' ' && i + 1 < end_ ? i + 1 : i;
    if (IsOther(body)) {
      size_t stop = OtherRunEnd(body);
      while (IsNewline(stop)) ++stop;
      return stop - i;
    }
    // \s*[\r\n]+ : the whitespace run up to its last line break.
    const size_t run_end = RunEnd(i, kWhitespace);
    for (size_t k = run_end; k > i; --k) {
      if (IsNewline(k - 1)) return k - i;
    }
    return MatchWhitespace(i);
  }

 private:
  std::vector<Unit> units_;
  size_t end_ = 0;
};

void Emit(const Matcher& matcher, std::string_view text, size_t begin, size_t end,
          std::vector<std::string_view>& pieces) {
  pieces.push_back(text.substr(matcher.offset(begin), matcher.offset(end) - matcher.offset(begin)));
}

}  // namespace

Result<PreTokenizerType> ParsePreTokenizerType(std::string_view name) {
  if (name.empty() || name == "default" || name == "gpt2" || name == "gpt-2") {
    return PreTokenizerType::kGpt2;
  }
  if (name == "smollm" || name == "starcoder") return PreTokenizerType::kSmolLM;
  // GLM-4's split (llama.cpp's chatglm4) is Llama 3's expression, contractions included.
  if (name == "llama-bpe" || name == "llama3" || name == "llama-v3" || name == "glm4" ||
      name == "chatglm-bpe") {
    return PreTokenizerType::kLlama3;
  }
  if (name == "qwen2") return PreTokenizerType::kQwen2;
  return Error(ErrorCode::kUnsupported,
               "pre-tokenizer '{}' is not supported; supported: smollm (starcoder), llama-bpe "
               "(llama3, llama-v3, glm4, chatglm-bpe), qwen2, gpt2 (gpt-2, default)",
               name);
}

const char* PreTokenizerName(PreTokenizerType type) {
  switch (type) {
    case PreTokenizerType::kGpt2:
      return "gpt2";
    case PreTokenizerType::kSmolLM:
      return "smollm";
    case PreTokenizerType::kLlama3:
      return "llama-bpe";
    case PreTokenizerType::kQwen2:
      return "qwen2";
  }
  return "unknown";
}

void PreTokenize(PreTokenizerType type, std::string_view text,
                 std::vector<std::string_view>& pieces) {
  Matcher matcher(text);
  const size_t size = matcher.size();
  size_t segment_begin = 0;
  while (segment_begin < size) {
    size_t segment_end = size;
    if (type == PreTokenizerType::kSmolLM) {
      // Digits are isolated before the GPT-2 rules see the text between them.
      matcher.set_end(size);
      segment_end = segment_begin;
      while (segment_end < size && !matcher.Has(segment_end, kNumber)) ++segment_end;
    }
    matcher.set_end(segment_end);
    for (size_t i = segment_begin; i < segment_end;) {
      size_t length = 0;
      switch (type) {
        case PreTokenizerType::kGpt2:
        case PreTokenizerType::kSmolLM:
          length = matcher.MatchGpt2(i);
          break;
        case PreTokenizerType::kLlama3:
          length = matcher.MatchLlama3(i, 3);
          break;
        case PreTokenizerType::kQwen2:
          length = matcher.MatchLlama3(i, 1);
          break;
      }
      Emit(matcher, text, i, i + length, pieces);
      i += length;
    }
    if (segment_end < size) {  // the digit that ended a kSmolLM segment
      Emit(matcher, text, segment_end, segment_end + 1, pieces);
      ++segment_end;
    }
    segment_begin = segment_end;
  }
}

}  // namespace shadowkv
