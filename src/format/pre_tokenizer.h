// Pre-tokenizers: split text into the pieces that byte-level BPE then encodes one by one.
#pragma once

#include <string_view>
#include <vector>

#include "core/status.h"

namespace shadowkv {

// The splitting rules of one model family. Each is a hand-written matcher for the regex its
// tokenizer definition uses (\s is White_Space, \p{L}/\p{N} are Unicode categories):
enum class PreTokenizerType {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // Every \p{N} codepoint is a piece on its own; the text between digits is split as kGpt2.
  // (SmolLM, StarCoder.)
  kSmolLM,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  // As kLlama3 but \p{N} one codepoint at a time. (Qwen2, Qwen2.5.)
  kQwen2,
};

// Maps a GGUF `tokenizer.ggml.pre` name; unknown names are kUnsupported with the list of
// supported ones. An empty name (key absent) means the original GPT-2 rules.
Result<PreTokenizerType> ParsePreTokenizerType(std::string_view name);
const char* PreTokenizerName(PreTokenizerType type);

// Appends to `pieces` the split of `text`: consecutive, non-empty views into `text` that
// together cover it exactly. Bytes that are not well-formed UTF-8 are kept, each one
// classed like an unassigned codepoint, so no input is ever lost.
void PreTokenize(PreTokenizerType type, std::string_view text,
                 std::vector<std::string_view>& pieces);

}  // namespace shadowkv
