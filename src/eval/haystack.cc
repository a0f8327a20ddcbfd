// Haystack text: corpus loading and cleaning, needle insertion, key word lists.
#include "eval/haystack.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

namespace shadowkv::eval {
namespace {

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Typographic punctuation of the corpus in ASCII, so haystacks tokenise like plain English.
std::string AsciiPunctuation(std::string_view text) {
  static const std::pair<std::string_view, std::string_view> kReplacements[] = {
      {"\u201C", "\""}, {"\u201D", "\""}, {"\u2018", "'"},   {"\u2019", "'"},
      {"\u2014", "--"}, {"\u2013", "-"},  {"\u2026", "..."}, {"\u00A0", " "}};
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    bool replaced = false;
    for (const auto& [from, to] : kReplacements) {
      if (text.substr(i, from.size()) == from) {
        out += to;
        i += from.size();
        replaced = true;
        break;
      }
    }
    if (!replaced) out += text[i++];
  }
  return out;
}

bool EndsSentence(std::string_view word) {
  while (!word.empty() && (word.back() == '"' || word.back() == '\'' || word.back() == ')')) {
    word.remove_suffix(1);
  }
  return !word.empty() && (word.back() == '.' || word.back() == '!' || word.back() == '?');
}

std::string ShellQuote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

}  // namespace

Result<std::string> ReadTextFile(const std::string& path) {
  if (EndsWith(path, ".gz")) {
    {
      std::ifstream probe(path, std::ios::binary);
      if (!probe) return Error(ErrorCode::kNotFound, "cannot read '{}'", path);
    }
    const std::string command = "gzip -dc -- " + ShellQuote(path);
    FILE* pipe = popen(command.c_str(), "r");
    if (!pipe) return Error(ErrorCode::kIo, "cannot run '{}'", command);
    std::string text;
    char buffer[1 << 16];
    size_t got;
    while ((got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) text.append(buffer, got);
    if (pclose(pipe) != 0) return Error(ErrorCode::kIo, "'{}' failed", command);
    return text;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Error(ErrorCode::kNotFound, "cannot read '{}'", path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::vector<std::string> ExtractProseWords(std::string_view text, int min_words) {
  std::vector<std::string> words;
  std::vector<std::string> paragraph;
  auto flush = [&] {
    const bool headword = !paragraph.empty() && paragraph.front().front() == ':';
    if (!headword && static_cast<int>(paragraph.size()) >= min_words &&
        EndsSentence(paragraph.back())) {
      words.insert(words.end(), paragraph.begin(), paragraph.end());
    }
    paragraph.clear();
  };
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    const std::string line = AsciiPunctuation(text.substr(begin, end - begin));
    std::istringstream tokens(line);
    std::string word;
    bool any = false;
    while (tokens >> word) {
      std::erase_if(word, [](char c) { return c == '{' || c == '}'; });
      if (word.empty()) continue;
      paragraph.push_back(word);
      any = true;
    }
    if (!any) flush();
    begin = end + 1;
  }
  flush();
  return words;
}

Result<EssayCorpus> LoadEssayCorpus(const std::string& path) {
  EssayCorpus corpus;
  corpus.source = path.empty() ? std::string(kDefaultEssayPath) : path;
  auto text = ReadTextFile(corpus.source);
  if (!text.ok()) {
    if (path.empty()) {
      return Error(text.status().code(),
                   "{} (the default essay haystack comes from the Debian package jargon-text; "
                   "install it or give --haystack FILE)",
                   text.status().message());
    }
    return text.status();
  }
  corpus.words = ExtractProseWords(*text);
  if (corpus.words.size() < 1000) {
    return Error(ErrorCode::kInvalidArgument,
                 "'{}' holds only {} words of prose; an essay haystack needs at least 1000",
                 corpus.source, corpus.words.size());
  }
  return corpus;
}

std::vector<std::string> CorpusVocabulary(const EssayCorpus& corpus) {
  std::set<std::string> unique;
  for (const std::string& raw : corpus.words) {
    std::string_view word = raw;
    while (!word.empty() && !std::isalpha(static_cast<unsigned char>(word.front()))) {
      word.remove_prefix(1);
    }
    while (!word.empty() && !std::isalpha(static_cast<unsigned char>(word.back()))) {
      word.remove_suffix(1);
    }
    if (word.size() < 3 || word.size() > 10) continue;
    std::string lower;
    bool alphabetic = true;
    for (char c : word) {
      if (!std::isalpha(static_cast<unsigned char>(c))) {
        alphabetic = false;
        break;
      }
      lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    if (alphabetic) unique.insert(lower);
  }
  return std::vector<std::string>(unique.begin(), unique.end());
}

std::string BuildEssayContext(const EssayCorpus& corpus, int64_t offset, int64_t num_words,
                              std::span<const Insertion> insertions,
                              std::vector<double>* placed_depths) {
  const int64_t corpus_size = static_cast<int64_t>(corpus.words.size());
  auto word = [&](int64_t i) -> const std::string& {
    return corpus.words[(offset + i) % corpus_size];
  };
  // Word index where each sentence starts.
  std::vector<int64_t> sentence_starts = {0};
  for (int64_t i = 0; i + 1 < num_words; ++i) {
    if (EndsSentence(word(i))) sentence_starts.push_back(i + 1);
  }
  const int64_t num_sentences = static_cast<int64_t>(sentence_starts.size());
  std::vector<std::pair<int64_t, size_t>> places;  // (word index, insertion)
  for (size_t n = 0; n < insertions.size(); ++n) {
    const int64_t sentence = std::clamp<int64_t>(
        static_cast<int64_t>(std::floor(num_sentences * insertions[n].depth / 100.0)), 0,
        num_sentences);
    places.emplace_back(sentence == num_sentences ? num_words : sentence_starts[sentence], n);
  }
  std::stable_sort(places.begin(), places.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (placed_depths) placed_depths->assign(insertions.size(), 0.0);
  std::string text;
  size_t next = 0;
  for (int64_t i = 0; i <= num_words; ++i) {
    for (; next < places.size() && places[next].first == i; ++next) {
      if (!text.empty()) text += ' ';
      text += insertions[places[next].second].text;
      if (placed_depths) {
        (*placed_depths)[places[next].second] = num_words ? 100.0 * i / num_words : 0.0;
      }
    }
    if (i == num_words) break;
    if (!text.empty()) text += ' ';
    text += word(i);
  }
  return text;
}

std::string BuildLineContext(const std::vector<std::string>& lines,
                             std::span<const Insertion> insertions,
                             std::vector<double>* placed_depths) {
  const int64_t num_lines = static_cast<int64_t>(lines.size());
  std::vector<std::pair<int64_t, size_t>> places;
  for (size_t n = 0; n < insertions.size(); ++n) {
    const int64_t line = std::clamp<int64_t>(
        static_cast<int64_t>(std::floor(num_lines * insertions[n].depth / 100.0)), 0, num_lines);
    places.emplace_back(line, n);
  }
  std::stable_sort(places.begin(), places.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (placed_depths) placed_depths->assign(insertions.size(), 0.0);
  std::string text;
  size_t next = 0;
  auto add_line = [&](const std::string& line) {
    if (!text.empty()) text += '\n';
    text += line;
  };
  for (int64_t i = 0; i <= num_lines; ++i) {
    for (; next < places.size() && places[next].first == i; ++next) {
      add_line(insertions[places[next].second].text);
      if (placed_depths) {
        (*placed_depths)[places[next].second] = num_lines ? 100.0 * i / num_lines : 0.0;
      }
    }
    if (i < num_lines) add_line(lines[i]);
  }
  return text;
}

const std::vector<std::string>& KeyAdjectives() {
  static const std::vector<std::string> words = {
      "abrupt",  "agile",    "ancient", "bitter",  "bold",    "brave",     "brisk",    "calm",
      "careful", "cheerful", "clever",  "cloudy",  "crimson", "curious",   "damp",     "daring",
      "distant", "dusty",    "eager",   "early",   "elegant", "empty",     "fancy",    "fierce",
      "fragile", "frozen",   "gentle",  "giant",   "glossy",  "golden",    "graceful", "grumpy",
      "hasty",   "hollow",   "humble",  "icy",     "idle",    "jolly",     "keen",     "lazy",
      "little",  "lively",   "lonely",  "loud",    "lucky",   "massive",   "mellow",   "mighty",
      "misty",   "modest",   "narrow",  "nervous", "noisy",   "odd",       "orange",   "pale",
      "patient", "plain",    "polite",  "proud",   "purple",  "quick",     "quiet",    "rapid",
      "rare",    "restless", "rough",   "rusty",   "scarlet", "shiny",     "silent",   "silver",
      "sleepy",  "slender",  "smooth",  "sober",   "solid",   "sparkling", "steady",   "stormy",
      "strange", "sturdy",   "swift",   "tender",  "tidy",    "tiny",      "vivid",    "wandering",
      "warm",    "wicked",   "wise",    "witty",   "wooden",  "young",     "zealous"};
  return words;
}

const std::vector<std::string>& KeyNouns() {
  static const std::vector<std::string> words = {
      "anchor",  "apple",   "arrow",    "badger", "balloon", "banjo",   "barrel",  "beacon",
      "blanket", "bridge",  "bucket",   "cabin",  "camel",   "candle",  "canyon",  "carpet",
      "castle",  "cellar",  "chimney",  "clock",  "comet",   "compass", "cottage", "crayon",
      "crystal", "dolphin", "dragon",   "drum",   "eagle",   "engine",  "falcon",  "feather",
      "fiddle",  "forest",  "fountain", "garden", "glacier", "goblet",  "harbor",  "harvest",
      "helmet",  "island",  "jacket",   "kettle", "ladder",  "lantern", "lemon",   "lighthouse",
      "magnet",  "meadow",  "mirror",   "monkey", "needle",  "oasis",   "orchard", "otter",
      "paddle",  "parrot",  "pebble",   "pencil", "pillow",  "planet",  "pocket",  "puzzle",
      "quarry",  "rabbit",  "ribbon",   "river",  "rocket",  "saddle",  "sandal",  "scarf",
      "shovel",  "spider",  "statue",   "teapot", "thunder", "ticket",  "tiger",   "tractor",
      "trumpet", "tunnel",  "umbrella", "valley", "velvet",  "violin",  "volcano", "wagon",
      "walrus",  "whistle", "window",   "wizard", "yacht",   "zebra"};
  return words;
}

}  // namespace shadowkv::eval
