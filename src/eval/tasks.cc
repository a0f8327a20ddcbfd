// Task registry, sizing to a token target, the NIAH family, passkey and multi-turn NIAH.
#include "eval/tasks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "eval/task_builder.h"

namespace shadowkv::eval {

using internal::Builder;
using internal::Built;

const std::vector<TaskInfo>& AllTasks() {
  static const std::vector<TaskInfo> tasks = {
      {"niah_single_1", 128, Metric::kStringMatchAll, "noise haystack, word key, 7-digit number"},
      {"niah_single_2", 128, Metric::kStringMatchAll, "essay haystack, word key, 7-digit number"},
      {"niah_single_3", 128, Metric::kStringMatchAll, "essay haystack, word key, UUID"},
      {"niah_multikey_1", 128, Metric::kStringMatchAll, "essay haystack, 4 keys, ask one"},
      {"niah_multikey_2", 128, Metric::kStringMatchAll, "every line a distractor needle"},
      {"niah_multikey_3", 128, Metric::kStringMatchAll, "distractor needles, UUID keys and values"},
      {"niah_multivalue", 128, Metric::kStringMatchAll, "one key, 4 values"},
      {"niah_multiquery", 128, Metric::kStringMatchAll, "4 keys, ask all"},
      {"vt", 30, Metric::kStringMatchAll, "variable tracking, 1 chain of 4 hops"},
      {"cwe", 120, Metric::kStringMatchAll, "10 most common words of a list"},
      {"fwe", 50, Metric::kStringMatchAll, "3 most frequent coded words (Zipf)"},
      {"passkey", 16, Metric::kStringMatchAll, "passkey in a noise haystack"},
  };
  return tasks;
}

const TaskInfo* FindTask(std::string_view name) {
  for (const TaskInfo& task : AllTasks()) {
    if (task.name == name) return &task;
  }
  return nullptr;
}

const std::vector<double>& DefaultDepths() {
  static const std::vector<double> depths = [] {
    std::vector<double> d;
    for (int i = 0; i < 40; ++i) d.push_back(std::round(100.0 * i / 39.0));
    return d;
  }();
  return depths;
}

namespace internal {

Result<Sample> FitToTarget(const Builder& build, int64_t min_units, int64_t budget_tokens,
                           const TaskContext& context) {
  auto measure = [&](int64_t units, Built* built) {
    *built = build(units);
    return context.count_tokens(context.render(built->parts));
  };
  Built best;
  const int64_t smallest = measure(min_units, &best);
  if (smallest > budget_tokens) {
    return Error(ErrorCode::kOutOfRange,
                 "the smallest haystack gives a prompt of {} tokens, more than the {} the "
                 "target leaves",
                 smallest, budget_tokens);
  }
  int64_t good = min_units;
  Built probe;
  const int64_t second = 2 * min_units;
  const int64_t second_tokens = measure(second, &probe);
  const double per_unit =
      std::max(1e-3, static_cast<double>(second_tokens - smallest) / (second - min_units));
  if (second_tokens <= budget_tokens) {
    good = second;
    best = probe;
  }
  // Bracket [good fits, bad does not] around the linear estimate, then bisect.
  const int64_t guess = min_units + static_cast<int64_t>((budget_tokens - smallest) / per_unit);
  int64_t bad = -1;
  int64_t step = std::max<int64_t>(1, guess / 50);
  int64_t x = std::max(good + 1, guess - step);
  while (bad < 0) {
    if (measure(x, &probe) <= budget_tokens) {
      good = x;
      best = probe;
      x = good + step;
      step *= 2;
    } else {
      bad = x;
    }
  }
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    if (measure(mid, &probe) <= budget_tokens) {
      good = mid;
      best = probe;
    } else {
      bad = mid;
    }
  }
  Sample sample;
  sample.parts = std::move(best.parts);
  sample.context = std::move(best.context);
  sample.answers = std::move(best.answers);
  sample.depths = std::move(best.depths);
  sample.prompt = context.render(sample.parts);
  sample.prompt_tokens = context.count_tokens(sample.prompt);
  sample.haystack_units = good;
  return sample;
}

std::string RandomUuid(Rng& rng) {
  uint64_t high = rng.Next(), low = rng.Next();
  high = (high & ~0xF000ull) | 0x4000ull;                // version 4
  low = (low & ~(0xC000ull << 48)) | (0x8000ull << 48);  // variant 10xx
  const std::string hex = fmt::format("{:016x}{:016x}", high, low);
  return hex.substr(0, 8) + "-" + hex.substr(8, 4) + "-" + hex.substr(12, 4) + "-" +
         hex.substr(16, 4) + "-" + hex.substr(20, 12);
}

std::string RandomNumber(Rng& rng, int digits) {
  int64_t low = 1;
  for (int i = 1; i < digits; ++i) low *= 10;
  return std::to_string(rng.Range(low, low * 10 - 1));
}

std::string RandomWordKey(Rng& rng) {
  const auto& adjectives = KeyAdjectives();
  const auto& nouns = KeyNouns();
  return adjectives[rng.Below(adjectives.size())] + "-" + nouns[rng.Below(nouns.size())];
}

std::string RandomLetters(Rng& rng, int length, bool upper) {
  std::string word;
  for (int i = 0; i < length; ++i) word += static_cast<char>((upper ? 'A' : 'a') + rng.Below(26));
  return word;
}

std::string JoinQuery(const std::vector<std::string>& keys) {
  if (keys.size() == 1) return keys[0];
  std::string out;
  for (size_t i = 0; i + 1 < keys.size(); ++i) out += keys[i] + ", ";
  return out + "and " + keys.back();
}

}  // namespace internal

namespace {

using internal::RandomNumber;
using internal::RandomUuid;
using internal::RandomWordKey;

enum class Haystack { kNoise, kEssay, kNeedles };
enum class Kind { kWord, kNumber, kUuid };

struct NiahSpec {
  Haystack haystack = Haystack::kEssay;
  Kind key = Kind::kWord;
  Kind value = Kind::kNumber;
  int num_keys = 1, num_values = 1, num_queries = 1;
};

NiahSpec NiahSpecOf(std::string_view task) {
  NiahSpec s;
  if (task == "niah_single_1") s.haystack = Haystack::kNoise;
  if (task == "niah_single_3") s.value = Kind::kUuid;
  if (task == "niah_multikey_1") s.num_keys = 4;
  if (task == "niah_multikey_2") s.haystack = Haystack::kNeedles;
  if (task == "niah_multikey_3") {
    s.haystack = Haystack::kNeedles;
    s.key = s.value = Kind::kUuid;
  }
  if (task == "niah_multivalue") s.num_values = 4;
  if (task == "niah_multiquery") s.num_keys = s.num_queries = 4;
  return s;
}

std::string Draw(Rng& rng, Kind kind) {
  switch (kind) {
    case Kind::kWord:
      return RandomWordKey(rng);
    case Kind::kNumber:
      return RandomNumber(rng, 7);
    case Kind::kUuid:
      return RandomUuid(rng);
  }
  return {};
}

std::string NeedleText(std::string_view type_plural, std::string_view key, std::string_view value) {
  return fmt::format("One of the special magic {} for {} is: {}.", type_plural, key, value);
}

// `count` depths: all at `fixed` when it is set, else distinct draws from the default grid.
std::vector<double> NeedleDepths(Rng& rng, int count, double fixed) {
  if (fixed >= 0) return std::vector<double>(count, std::min(fixed, 100.0));
  const auto& grid = DefaultDepths();
  std::vector<double> depths;
  for (int64_t i : rng.Distinct(static_cast<int64_t>(grid.size()), count)) {
    depths.push_back(grid[i]);
  }
  std::sort(depths.begin(), depths.end());
  return depths;
}

// RULER's NIAH prompt; singular wording when one value is asked for.
PromptParts NiahPrompt(const std::string& context, const std::string& query, bool singular,
                       bool uuid_values) {
  const std::string type = uuid_values ? "uuid" : "number";
  const std::string types = type + "s";
  PromptParts parts;
  if (singular) {
    parts.user = fmt::format(
        "A special magic {0} is hidden within the following text. Make sure to memorize it. I "
        "will quiz you about the {0} afterwards.\n{1}\nWhat is the special magic {0} for {2} "
        "mentioned in the provided text?",
        type, context, query);
    parts.answer_prefix =
        fmt::format(" The special magic {} for {} mentioned in the provided text is", type, query);
  } else {
    parts.user = fmt::format(
        "Some special magic {0} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {0} afterwards.\n{1}\nWhat are all the special magic {0} for "
        "{2} mentioned in the provided text?",
        types, context, query);
    parts.answer_prefix = fmt::format(
        " The special magic {} for {} mentioned in the provided text are", types, query);
  }
  return parts;
}

Result<Sample> SynthesizeNiah(const SampleRequest& request, const TaskContext& context,
                              int max_new_tokens) {
  const NiahSpec spec = NiahSpecOf(request.task);
  Rng rng(DeriveSeed(request.seed, request.task, request.target_tokens, request.index));
  const std::string types = spec.value == Kind::kUuid ? "uuids" : "numbers";
  std::vector<std::string> keys;
  std::vector<std::vector<std::string>> values;
  std::vector<std::string> needles;
  while (static_cast<int>(keys.size()) < spec.num_keys) {
    std::string key = Draw(rng, spec.key);
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
    keys.push_back(key);
    values.emplace_back();
    for (int v = 0; v < spec.num_values; ++v) {
      values.back().push_back(Draw(rng, spec.value));
      needles.push_back(NeedleText(types, key, values.back().back()));
    }
  }
  rng.Shuffle(needles);
  const std::vector<double> depths =
      NeedleDepths(rng, static_cast<int>(needles.size()), request.depth);
  std::vector<std::string> queried;
  std::vector<std::string> answers;
  for (int64_t k : rng.Distinct(spec.num_keys, spec.num_queries)) {
    queried.push_back(keys[k]);
    answers.insert(answers.end(), values[k].begin(), values[k].end());
  }
  const std::string query = internal::JoinQuery(queried);
  const bool singular = spec.num_queries * spec.num_values == 1;
  const int64_t offset =
      context.corpus ? rng.Below(std::max<size_t>(context.corpus->words.size(), 1)) : 0;
  const uint64_t distractor_seed = rng.Next();
  if (spec.haystack == Haystack::kEssay && !context.corpus) {
    return Error(ErrorCode::kInvalidArgument, "task {} needs an essay corpus", request.task);
  }

  Builder build = [&](int64_t units) {
    Built b;
    std::vector<Insertion> insertions;
    for (size_t i = 0; i < needles.size(); ++i) insertions.push_back({depths[i], needles[i]});
    if (spec.haystack == Haystack::kEssay) {
      b.context = BuildEssayContext(*context.corpus, offset, units, insertions, &b.depths);
    } else {
      std::vector<std::string> lines;
      if (spec.haystack == Haystack::kNoise) {
        lines.assign(units, std::string(kNoiseSentence));
      } else {
        Rng distractors(DeriveSeed(distractor_seed, "distractors", units));
        while (static_cast<int64_t>(lines.size()) < units) {
          std::string key = Draw(distractors, spec.key);
          if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
          lines.push_back(NeedleText(types, key, Draw(distractors, spec.value)));
        }
      }
      b.context = BuildLineContext(lines, insertions, &b.depths);
    }
    b.parts = NiahPrompt(b.context, query, singular, spec.value == Kind::kUuid);
    b.answers = answers;
    return b;
  };
  const int64_t min_units = spec.haystack == Haystack::kEssay ? 64 : 4;
  return internal::FitToTarget(build, min_units, request.target_tokens - max_new_tokens, context);
}

Result<Sample> SynthesizePasskey(const SampleRequest& request, const TaskContext& context,
                                 int max_new_tokens) {
  Rng rng(DeriveSeed(request.seed, request.task, request.target_tokens, request.index));
  const std::string passkey = RandomNumber(rng, 5);
  const double depth = NeedleDepths(rng, 1, request.depth)[0];
  Builder build = [&](int64_t units) {
    Built b;
    const std::vector<std::string> lines(units, std::string(kNoiseSentence));
    const Insertion needle{
        depth, fmt::format("The pass key is {0}. Remember it. {0} is the pass key.", passkey)};
    b.context = BuildLineContext(lines, std::span<const Insertion>(&needle, 1), &b.depths);
    b.parts.user =
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.\n" +
        b.context + "\nWhat is the pass key?";
    b.parts.answer_prefix = " The pass key is";
    b.answers = {passkey};
    return b;
  };
  return internal::FitToTarget(build, 4, request.target_tokens - max_new_tokens, context);
}

}  // namespace

Result<Sample> SynthesizeSample(const SampleRequest& request, const TaskContext& context) {
  const TaskInfo* task = FindTask(request.task);
  if (!task) {
    return Error(ErrorCode::kInvalidArgument, "unknown task '{}' ({})", request.task,
                 kUnavailableTasksNote);
  }
  if (!context.render || !context.count_tokens) {
    return Error(ErrorCode::kInvalidArgument, "task context has no renderer or token counter");
  }
  Result<Sample> sample = Error(ErrorCode::kInternal, "no synthesis for {}", request.task);
  if (request.task.starts_with("niah_")) {
    sample = SynthesizeNiah(request, context, task->max_new_tokens);
  } else if (request.task == "passkey") {
    sample = SynthesizePasskey(request, context, task->max_new_tokens);
  } else if (request.task == "vt") {
    sample = internal::SynthesizeVariableTracking(request, context, task->max_new_tokens);
  } else if (request.task == "cwe") {
    sample = internal::SynthesizeCommonWords(request, context, task->max_new_tokens);
  } else if (request.task == "fwe") {
    sample = internal::SynthesizeFrequentWords(request, context, task->max_new_tokens);
  }
  if (!sample.ok()) {
    return Error(sample.status().code(), "{} at {} tokens: {}", request.task, request.target_tokens,
                 sample.status().message());
  }
  sample->task = request.task;
  sample->index = request.index;
  sample->max_new_tokens = task->max_new_tokens;
  return sample;
}

Result<MultiTurnSample> SynthesizeMultiTurn(int num_needles, int64_t target_tokens, uint64_t seed,
                                            int index, const TaskContext& context) {
  if (num_needles < 1) {
    return Error(ErrorCode::kInvalidArgument, "multi-turn needs at least one needle");
  }
  if (!context.corpus)
    return Error(ErrorCode::kInvalidArgument, "multi-turn needs an essay corpus");
  constexpr int kMaxNewTokens = 128;
  Rng rng(DeriveSeed(seed, "multi_turn", target_tokens,
                     static_cast<uint64_t>(index) * 1000 + num_needles));
  MultiTurnSample result;
  while (static_cast<int>(result.keys.size()) < num_needles) {
    std::string key = RandomWordKey(rng);
    if (std::find(result.keys.begin(), result.keys.end(), key) != result.keys.end()) continue;
    result.keys.push_back(key);
    result.values.push_back(RandomNumber(rng, 7));
  }
  // Needle i (at the i-th smallest depth) holds key order[i]: the questions, asked in key
  // order, visit the depths in a random order.
  std::vector<int> order(num_needles);
  for (int i = 0; i < num_needles; ++i) order[i] = i;
  rng.Shuffle(order);
  const std::vector<double> depths =
      num_needles <= 40 ? NeedleDepths(rng, num_needles, -1) : std::vector<double>();
  std::vector<Insertion> insertions;
  for (int i = 0; i < num_needles; ++i) {
    insertions.push_back({depths.empty() ? 100.0 * i / num_needles : depths[i],
                          NeedleText("numbers", result.keys[order[i]], result.values[order[i]])});
  }
  const int64_t offset = rng.Below(context.corpus->words.size());
  for (int turn = 1; turn < num_needles; ++turn) {
    PromptParts q;
    q.user = fmt::format("What is the special magic number for {} mentioned in the provided text?",
                         result.keys[turn]);
    q.answer_prefix = fmt::format(
        " The special magic number for {} mentioned in the provided text is", result.keys[turn]);
    result.followups.push_back(q);
  }
  // Room for every turn: its answer, its question and the chat markup around them.
  int64_t reserved = kMaxNewTokens;
  for (const PromptParts& q : result.followups) {
    reserved += kMaxNewTokens + context.count_tokens(q.user + q.answer_prefix) + 16;
  }
  Builder build = [&](int64_t units) {
    Built b;
    b.context = BuildEssayContext(*context.corpus, offset, units, insertions, &b.depths);
    b.parts = NiahPrompt(b.context, result.keys[0], /*singular=*/true, /*uuid_values=*/false);
    b.parts.user.replace(0, b.parts.user.find('\n'),
                         "Some special magic numbers are hidden within the following text. Make "
                         "sure to memorize them. I will quiz you about the numbers afterwards.");
    b.answers = {result.values[0]};
    return b;
  };
  auto first = internal::FitToTarget(build, 64, target_tokens - reserved, context);
  if (!first.ok()) {
    return Error(first.status().code(), "multi-turn NIAH at {} tokens: {}", target_tokens,
                 first.status().message());
  }
  result.first = std::move(first).value();
  result.first.task = "niah_multi_turn";
  result.first.index = index;
  result.first.max_new_tokens = kMaxNewTokens;
  result.key_depths.resize(num_needles);
  for (int i = 0; i < num_needles; ++i) result.key_depths[order[i]] = result.first.depths[i];
  return result;
}

}  // namespace shadowkv::eval
