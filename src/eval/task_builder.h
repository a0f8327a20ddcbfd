// Internal to the task synthesis: a task as a function of its haystack size, the search that
// sizes it to a token target, and the random values the tasks draw.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "eval/rng.h"
#include "eval/tasks.h"

namespace shadowkv::eval::internal {

// One task instance at a given haystack size. A builder draws everything that must not change
// with the size (keys, values, depths) before it is called; what depends on the size is drawn
// from a generator seeded by the size, so Build(units) is a pure function.
struct Built {
  PromptParts parts;
  std::string context;
  std::vector<std::string> answers;
  std::vector<double> depths;
};
using Builder = std::function<Built(int64_t units)>;

// The largest units >= min_units whose rendered prompt takes at most budget_tokens, found by
// a bracketing search from a two-point estimate and then bisection (prompt length is close to
// monotone in units). Fails when even min_units does not fit.
Result<Sample> FitToTarget(const Builder& build, int64_t min_units, int64_t budget_tokens,
                           const TaskContext& context);

std::string RandomUuid(Rng& rng);  // version-4 form, lowercase hex
std::string RandomNumber(Rng& rng, int digits);
std::string RandomWordKey(Rng& rng);  // "adjective-noun"
std::string RandomLetters(Rng& rng, int length, bool upper);
// "a" for one key; "a, b, c, and d" (RULER's form) for several.
std::string JoinQuery(const std::vector<std::string>& keys);

// The variable-tracking, common-words and frequent-words tasks (task_words.cc).
Result<Sample> SynthesizeVariableTracking(const SampleRequest& request, const TaskContext& context,
                                          int max_new_tokens);
Result<Sample> SynthesizeCommonWords(const SampleRequest& request, const TaskContext& context,
                                     int max_new_tokens);
Result<Sample> SynthesizeFrequentWords(const SampleRequest& request, const TaskContext& context,
                                       int max_new_tokens);

}  // namespace shadowkv::eval::internal
