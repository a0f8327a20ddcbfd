// The variable-tracking (vt), common-words (cwe) and frequent-words (fwe) tasks.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <set>

#include "eval/task_builder.h"

namespace shadowkv::eval::internal {
namespace {

// `count` chain lines' depths: sorted uniform draws, or all at `fixed`.
std::vector<double> ChainDepths(Rng& rng, int count, double fixed) {
  std::vector<double> depths(count, std::min(fixed, 100.0));
  if (fixed < 0) {
    for (double& d : depths) d = 100.0 * rng.Unit();
    std::sort(depths.begin(), depths.end());
  }
  return depths;
}

struct Chain {
  std::vector<std::string> names;  // names[0] = value, names[i] = names[i - 1]
  std::string value;
  std::vector<std::string> lines;
};

Chain DrawChain(Rng& rng, int hops, int name_length) {
  Chain chain;
  std::set<std::string> seen;
  while (static_cast<int>(chain.names.size()) < hops + 1) {
    std::string name = RandomLetters(rng, name_length, /*upper=*/true);
    if (seen.insert(name).second) chain.names.push_back(name);
  }
  chain.value = std::to_string(rng.Range(10000, 99998));
  chain.lines.push_back(fmt::format("VAR {} = {}", chain.names[0], chain.value));
  for (int i = 1; i <= hops; ++i) {
    chain.lines.push_back(fmt::format("VAR {} = VAR {}", chain.names[i], chain.names[i - 1]));
  }
  return chain;
}

PromptParts VtPrompt(const std::string& context, const Chain& chain) {
  PromptParts parts;
  parts.user = fmt::format(
      "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
      "{}\nQuestion: Find all variables that are assigned the value {} in the text above.",
      context, chain.value);
  parts.answer_prefix = fmt::format(
      " Answer: According to the chain(s) of variable assignment in the text above, {} variables "
      "are assigned the value {}, they are:",
      chain.names.size(), chain.value);
  return parts;
}

std::string VtContext(const Chain& chain, const std::vector<double>& depths, int64_t noise_lines,
                      std::vector<double>* placed) {
  std::vector<Insertion> insertions;
  for (size_t i = 0; i < chain.lines.size(); ++i) insertions.push_back({depths[i], chain.lines[i]});
  return BuildLineContext(std::vector<std::string>(noise_lines, std::string(kNoiseSentence)),
                          insertions, placed);
}

// A numbered word list: `common` words `common_repeats` times each, the others
// `other_repeats` times, shuffled: "1. word 2. word ...".
std::string NumberedList(Rng& rng, const std::vector<std::string>& common,
                         const std::vector<std::string>& others, int common_repeats,
                         int other_repeats) {
  std::vector<const std::string*> list;
  for (const auto& w : common) list.insert(list.end(), common_repeats, &w);
  for (const auto& w : others) list.insert(list.end(), other_repeats, &w);
  rng.Shuffle(list);
  std::string text;
  for (size_t i = 0; i < list.size(); ++i) {
    if (i) text += ' ';
    text += fmt::format("{}. {}", i + 1, *list[i]);
  }
  return text;
}

PromptParts CwePrompt(const std::string& context) {
  PromptParts parts;
  parts.user = fmt::format(
      "Below is a numbered list of words. In these words, some appear more often than others. "
      "Memorize the ones that appear most often.\n{}\nQuestion: What are the 10 most common "
      "words in the above list?",
      context);
  parts.answer_prefix = " Answer: The top 10 words that appear most often in the list are:";
  return parts;
}

}  // namespace

Result<Sample> SynthesizeVariableTracking(const SampleRequest& request, const TaskContext& context,
                                          int max_new_tokens) {
  constexpr int kHops = 4;
  Rng rng(DeriveSeed(request.seed, request.task, request.target_tokens, request.index));
  const Chain chain = DrawChain(rng, kHops, 5);
  const std::vector<double> depths = ChainDepths(rng, kHops + 1, request.depth);
  // One worked example (RULER's: 3-letter names, a noise haystack of about 500 tokens).
  const Chain example_chain = DrawChain(rng, kHops, 3);
  const std::vector<double> example_depths = ChainDepths(rng, kHops + 1, -1);
  const int64_t budget = request.target_tokens - max_new_tokens;
  TaskContext plain = context;
  plain.render = [](const PromptParts& parts) { return parts.user; };
  Builder build_example = [&](int64_t units) {
    Built b;
    const PromptParts parts =
        VtPrompt(VtContext(example_chain, example_depths, units, nullptr), example_chain);
    b.parts.user = parts.user + parts.answer_prefix;
    for (const std::string& name : example_chain.names) b.parts.user += " " + name;
    b.parts.user += "\n";
    return b;
  };
  SKV_ASSIGN_OR_RETURN(Sample example,
                       FitToTarget(build_example, 1, std::min<int64_t>(500, budget / 4), plain));

  Builder build = [&](int64_t units) {
    Built b;
    b.context = VtContext(chain, depths, units, &b.depths);
    b.parts = VtPrompt(b.context, chain);
    b.parts.user = example.parts.user + "\n" + b.parts.user;
    b.answers = chain.names;
    return b;
  };
  return FitToTarget(build, 1, budget, context);
}

Result<Sample> SynthesizeCommonWords(const SampleRequest& request, const TaskContext& context,
                                     int max_new_tokens) {
  if (!context.vocabulary || context.vocabulary->empty()) {
    return Error(ErrorCode::kInvalidArgument, "the common-words task needs a word pool");
  }
  constexpr int kCommon = 10;
  // RULER's repetitions: fewer below 4K tokens, where 30/3 would not fit.
  const bool short_context = request.target_tokens < 4096;
  const int common_repeats = short_context ? 6 : 30, other_repeats = short_context ? 1 : 3;
  const int example_words = short_context ? 20 : 40;
  const int example_common = short_context ? 3 : 10, example_other = short_context ? 1 : 3;
  Rng rng(DeriveSeed(request.seed, request.task, request.target_tokens, request.index));
  const uint64_t words_seed = rng.Next();
  const std::vector<std::string>& pool = *context.vocabulary;

  Builder build = [&](int64_t units) {
    Rng r(DeriveSeed(words_seed, "cwe", units));
    const int64_t needed = example_words + units;
    std::vector<std::string> words;
    for (int64_t i :
         r.Distinct(static_cast<int64_t>(pool.size()), std::min<int64_t>(needed, pool.size()))) {
      words.push_back(pool[i]);
    }
    // Past the pool, made-up words (RULER switches to a larger word list there).
    std::set<std::string> used(words.begin(), words.end());
    while (static_cast<int64_t>(words.size()) < needed) {
      std::string word = RandomLetters(r, 7, /*upper=*/false);
      if (used.insert(word).second) words.push_back(word);
    }
    auto part = [&](int64_t begin, int64_t end) {
      return std::vector<std::string>(words.begin() + begin, words.begin() + end);
    };
    const auto example_top = part(0, kCommon);
    const std::string example_list =
        NumberedList(r, example_top, part(kCommon, example_words), example_common, example_other);
    Built b;
    const auto top = part(example_words, example_words + kCommon);
    b.context =
        NumberedList(r, top, part(example_words + kCommon, needed), common_repeats, other_repeats);
    const PromptParts example = CwePrompt(example_list);
    std::string answer;
    for (int i = 0; i < kCommon; ++i) answer += fmt::format(" {}. {}", i + 1, example_top[i]);
    b.parts = CwePrompt(b.context);
    b.parts.user = example.user + example.answer_prefix + answer + "\n" + b.parts.user;
    b.answers = top;
    return b;
  };
  return FitToTarget(build, kCommon + 10, request.target_tokens - max_new_tokens, context);
}

Result<Sample> SynthesizeFrequentWords(const SampleRequest& request, const TaskContext& context,
                                       int max_new_tokens) {
  constexpr double kAlpha = 2.0;
  const double zeta = std::numbers::pi * std::numbers::pi / 6.0;  // zeta(2)
  Rng rng(DeriveSeed(request.seed, request.task, request.target_tokens, request.index));
  const int64_t budget = request.target_tokens - max_new_tokens;
  const int64_t vocab_size = std::max<int64_t>(16, budget / 50);
  std::vector<std::string> vocab;
  std::set<std::string> seen;
  while (static_cast<int64_t>(vocab.size()) < vocab_size) {
    std::string word = RandomLetters(rng, 6, /*upper=*/false);
    if (seen.insert(word).second) vocab.push_back(word);
  }
  vocab[0] = "...";  // the most frequent "word" is noise; the answer is ranks 2-4
  const uint64_t shuffle_seed = rng.Next();

  Builder build = [&](int64_t units) {
    std::vector<const std::string*> words;
    for (int64_t k = 1; k <= vocab_size; ++k) {
      const auto count =
          static_cast<int64_t>(units * std::pow(static_cast<double>(k), -kAlpha) / zeta);
      words.insert(words.end(), count, &vocab[k - 1]);
    }
    Rng r(DeriveSeed(shuffle_seed, "fwe", units));
    r.Shuffle(words);
    Built b;
    for (size_t i = 0; i < words.size(); ++i) {
      if (i) b.context += ' ';
      b.context += *words[i];
    }
    b.parts.user = fmt::format(
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text?",
        b.context);
    b.parts.answer_prefix =
        " Answer: According to the coded text above, the three most frequently appeared words "
        "are:";
    b.answers = {vocab[1], vocab[2], vocab[3]};
    return b;
  };
  return FitToTarget(build, 200, budget, context);
}

}  // namespace shadowkv::eval::internal
