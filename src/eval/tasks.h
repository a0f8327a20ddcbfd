// Synthetic long-context tasks after NVIDIA RULER (NIAH family, variable tracking, common and
// frequent words) plus passkey retrieval: deterministic from a seed, sized to a token target.
//
// A sample's prompt is sized like RULER's: the largest haystack whose rendered prompt plus the
// task's generation cap fits in the target (binary search on the haystack size, counting with
// the caller's token counter, so the real model's tokenizer in the app and a whitespace count
// in tests). The prompt is rendered by the caller (chat template, then the answer prefix after
// the assistant header, as RULER appends it after the model template).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "eval/haystack.h"

namespace shadowkv::eval {

enum class Metric {
  kStringMatchAll,   // fraction of the expected strings found in the output
  kStringMatchPart,  // 1 when any expected string is found
};

struct TaskInfo {
  std::string name;
  int max_new_tokens = 0;  // generation cap (RULER's tokens_to_generate)
  Metric metric = Metric::kStringMatchAll;
  std::string summary;
};

// Every task, in RULER's order, then passkey.
const std::vector<TaskInfo>& AllTasks();
const TaskInfo* FindTask(std::string_view name);
// RULER tasks left out, and why (printed with every report).
inline constexpr std::string_view kUnavailableTasksNote =
    "qa_1, qa_2: not available (SQuAD/HotpotQA cannot be fetched here)";

// What a task asks: the user turn, and the start of the answer the model continues.
struct PromptParts {
  std::string user;
  std::string answer_prefix;
};
// The full prompt text the model reads (chat template + answer prefix).
using PromptRenderer = std::function<std::string(const PromptParts&)>;
// Tokens a text takes.
using TokenCounter = std::function<int64_t(const std::string&)>;

struct TaskContext {
  const EssayCorpus* corpus = nullptr;                   // essay haystacks
  const std::vector<std::string>* vocabulary = nullptr;  // common-words pool
  PromptRenderer render;
  TokenCounter count_tokens;
};

// The default needle depths: RULER's 40 evenly spaced percentages (rounded), 0..100.
const std::vector<double>& DefaultDepths();

struct SampleRequest {
  std::string task;
  int64_t target_tokens = 4096;  // prompt + generation cap
  uint64_t seed = 42;
  int index = 0;        // sample number: each index is an independent draw
  double depth = -1.0;  // percent of the haystack before the needle(s); < 0: random per sample
};

struct Sample {
  std::string task;
  int index = 0;
  PromptParts parts;
  std::string context;  // the haystack with its needles (part of parts.user)
  std::string prompt;   // rendered
  int64_t prompt_tokens = 0;
  int64_t haystack_units = 0;        // noise lines, essay words, list entries
  std::vector<std::string> answers;  // expected strings
  std::vector<double> depths;        // needle depths as placed (percent), in needle order
  int max_new_tokens = 0;
};

Result<Sample> SynthesizeSample(const SampleRequest& request, const TaskContext& context);

// Multi-turn NIAH: one essay haystack with `num_needles` needles (word keys, 7-digit values);
// turn 1 is a NIAH prompt asking for keys[0]; each later turn asks for the next key.
struct MultiTurnSample {
  Sample first;                        // the context and the first question
  std::vector<std::string> keys;       // in the order asked
  std::vector<std::string> values;     // values[i] answers keys[i]
  std::vector<double> key_depths;      // depth (percent) of the needle of keys[i]
  std::vector<PromptParts> followups;  // turns 2..N: question and answer prefix
};
// Sized so the first prompt plus every turn's question and answer fits `target_tokens`.
Result<MultiTurnSample> SynthesizeMultiTurn(int num_needles, int64_t target_tokens, uint64_t seed,
                                            int index, const TaskContext& context);

}  // namespace shadowkv::eval
