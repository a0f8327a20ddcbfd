// Haystacks for the synthetic long-context tasks: the noise sentence, an essay corpus read from a
// text file (the Jargon File by default), needle insertion at a depth, and word lists.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace shadowkv::eval {

// RULER's noise haystack: this line, repeated.
inline constexpr std::string_view kNoiseSentence =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

// The default essay corpus: The Jargon File from Debian's jargon-text package.
inline constexpr std::string_view kDefaultEssayPath = "/usr/share/doc/jargon-text/jargon.txt.gz";

// Natural prose as words in reading order (whitespace-separated, punctuation kept).
struct EssayCorpus {
  std::string source;              // where it was read from
  std::vector<std::string> words;  // [num_words]
};

// Reads a whole file; a name ending in ".gz" is decompressed through `gzip -dc`.
Result<std::string> ReadTextFile(const std::string& path);

// The prose paragraphs of a text: paragraphs (blank-line separated) of at least `min_words`
// words that end a sentence, with markup removed (Jargon File headword lines ":word:", cross
// reference braces) and typographic quotes and dashes turned into ASCII.
std::vector<std::string> ExtractProseWords(std::string_view text, int min_words = 12);

// Loads `path` (empty: kDefaultEssayPath) as an essay corpus; fails when it has too little
// prose to build a haystack from.
Result<EssayCorpus> LoadEssayCorpus(const std::string& path);

// Lowercase alphabetic words of the corpus (3..10 letters), distinct, sorted: the word pool of
// the common-words task.
std::vector<std::string> CorpusVocabulary(const EssayCorpus& corpus);

// A needle (or any sentence) to place at `depth`: the percentage of the haystack before it.
struct Insertion {
  double depth = 0.0;
  std::string text;
};

// `num_words` words of the corpus starting at `offset` (wrapping around), joined by spaces,
// with each insertion placed at the start of sentence floor(num_sentences * depth / 100).
// Insertions at the same place keep their order. `placed_depths` (optional) receives the
// depth each insertion actually got (percent of haystack words before it).
std::string BuildEssayContext(const EssayCorpus& corpus, int64_t offset, int64_t num_words,
                              std::span<const Insertion> insertions,
                              std::vector<double>* placed_depths = nullptr);

// `lines` joined by "\n", with each insertion as its own line before line
// floor(num_lines * depth / 100) of the haystack.
std::string BuildLineContext(const std::vector<std::string>& lines,
                             std::span<const Insertion> insertions,
                             std::vector<double>* placed_depths = nullptr);

// Adjectives and nouns for needle keys ("adjective-noun", as RULER's word keys).
const std::vector<std::string>& KeyAdjectives();
const std::vector<std::string>& KeyNouns();

}  // namespace shadowkv::eval
