// Task synthesis with a whitespace token count: determinism, sizing, needles and their depths,
// and answers re-derived from the generated text (chains followed, words counted).
#include "eval/tasks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <sstream>

namespace shadowkv::eval {
namespace {

int64_t CountWords(const std::string& text) {
  std::istringstream in(text);
  std::string word;
  int64_t count = 0;
  while (in >> word) ++count;
  return count;
}

int64_t Occurrences(const std::string& text, const std::string& part) {
  int64_t count = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++count;
  return count;
}

// Prose-like corpus: sentences of 6..15 made-up words.
EssayCorpus MakeCorpus() {
  EssayCorpus corpus;
  const char* syllables[] = {"ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo"};
  uint32_t x = 99;
  for (int s = 0; s < 4000; ++s) {
    x = x * 1103515245u + 12345u;
    const int length = 6 + (x >> 16) % 10;
    for (int w = 0; w < length; ++w) {
      x = x * 1103515245u + 12345u;
      std::string word = std::string(syllables[(x >> 16) % 8]) + syllables[(x >> 20) % 8];
      if (w == 0) word[0] = static_cast<char>(std::toupper(word[0]));
      if (w == length - 1) word += ".";
      corpus.words.push_back(word);
    }
  }
  return corpus;
}

class TasksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    corpus_ = MakeCorpus();
    vocabulary_ = CorpusVocabulary(corpus_);  // 64 words: cwe also needs made-up ones
    context_.corpus = &corpus_;
    context_.vocabulary = &vocabulary_;
    context_.render = [](const PromptParts& p) { return p.user + "\n" + p.answer_prefix; };
    context_.count_tokens = CountWords;
  }
  Sample Make(const std::string& task, int64_t target, uint64_t seed = 1, int index = 0,
              double depth = -1) {
    SampleRequest request;
    request.task = task;
    request.target_tokens = target;
    request.seed = seed;
    request.index = index;
    request.depth = depth;
    auto sample = SynthesizeSample(request, context_);
    EXPECT_TRUE(sample.ok()) << sample.status().ToString();
    return sample.ok() ? *sample : Sample{};
  }

  EssayCorpus corpus_;
  std::vector<std::string> vocabulary_;
  TaskContext context_;
};

TEST_F(TasksTest, SameSeedSameTextOtherSeedOrIndexOtherText) {
  for (const TaskInfo& task : AllTasks()) {
    SCOPED_TRACE(task.name);
    const Sample a = Make(task.name, 3000, 5, 0);
    const Sample b = Make(task.name, 3000, 5, 0);
    EXPECT_EQ(a.prompt, b.prompt);
    EXPECT_EQ(a.answers, b.answers);
    EXPECT_NE(a.prompt, Make(task.name, 3000, 6, 0).prompt);
    EXPECT_NE(a.prompt, Make(task.name, 3000, 5, 1).prompt);
  }
}

TEST_F(TasksTest, PromptPlusGenerationCapFillsTheTarget) {
  for (const TaskInfo& task : AllTasks()) {
    for (int64_t target : {1500, 6000}) {
      SCOPED_TRACE(task.name + " at " + std::to_string(target));
      const Sample s = Make(task.name, target);
      EXPECT_EQ(s.prompt_tokens, CountWords(s.prompt));
      EXPECT_EQ(s.max_new_tokens, task.max_new_tokens);
      EXPECT_LE(s.prompt_tokens + s.max_new_tokens, target);
      EXPECT_GE(s.prompt_tokens + s.max_new_tokens, 0.97 * target);
    }
  }
}

TEST_F(TasksTest, EachNeedleIsInTheContextExactlyOnce) {
  const std::regex needle(R"(One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.)");
  for (const std::string task : {"niah_single_1", "niah_single_2", "niah_single_3",
                                 "niah_multikey_1", "niah_multivalue", "niah_multiquery"}) {
    SCOPED_TRACE(task);
    const Sample s = Make(task, 4000, 3);
    std::map<std::string, std::vector<std::string>> values_by_key;
    for (std::sregex_iterator it(s.context.begin(), s.context.end(), needle), end; it != end;
         ++it) {
      values_by_key[(*it)[2]].push_back((*it)[3]);
    }
    int64_t needles = 0;
    for (const auto& [key, values] : values_by_key) needles += values.size();
    const int64_t expected =
        task == "niah_multikey_1" || task == "niah_multiquery" || task == "niah_multivalue" ? 4 : 1;
    EXPECT_EQ(needles, expected);
    for (const std::string& answer : s.answers) {
      EXPECT_EQ(Occurrences(s.context, answer + "."), 1) << answer;
    }
    // The question names the keys whose values are the answers.
    std::vector<std::string> asked;
    for (const auto& [key, values] : values_by_key) {
      if (s.parts.answer_prefix.find(" " + key) != std::string::npos) {
        asked.insert(asked.end(), values.begin(), values.end());
      }
    }
    std::vector<std::string> answers = s.answers;
    std::sort(asked.begin(), asked.end());
    std::sort(answers.begin(), answers.end());
    EXPECT_EQ(asked, answers);
  }
  EXPECT_EQ(Make("niah_single_2", 3000).answers[0].size(), 7u);
  EXPECT_EQ(Make("niah_single_3", 3000).answers[0].size(), 36u);  // a UUID
  EXPECT_EQ(Make("niah_multiquery", 3000).answers.size(), 4u);
}

TEST_F(TasksTest, NeedleSitsAtTheRequestedDepth) {
  for (const std::string task : {"niah_single_1", "niah_single_2", "passkey"}) {
    for (double depth : {0.0, 25.0, 50.0, 90.0, 100.0}) {
      SCOPED_TRACE(task + " depth " + std::to_string(depth));
      const Sample s = Make(task, 4000, 1, 0, depth);
      const std::string& value = s.answers[0];
      const size_t at = s.context.find(value);
      ASSERT_NE(at, std::string::npos);
      EXPECT_NEAR(100.0 * at / s.context.size(), depth, 2.5);
      ASSERT_EQ(s.depths.size(), 1u);
      EXPECT_NEAR(s.depths[0], depth, 2.5);
    }
  }
}

TEST_F(TasksTest, DefaultDepthIsDrawnPerSampleFromTheGrid) {
  std::set<double> seen;
  for (int index = 0; index < 12; ++index) {
    const Sample s = Make("niah_single_1", 2000, 1, index);
    seen.insert(s.depths[0]);
  }
  EXPECT_GE(seen.size(), 5u);
  EXPECT_EQ(DefaultDepths().size(), 40u);
  EXPECT_EQ(DefaultDepths().front(), 0.0);
  EXPECT_EQ(DefaultDepths().back(), 100.0);
}

TEST_F(TasksTest, MultikeyHaystackLinesAreAllDistractorNeedles) {
  const std::regex line(R"(One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.)");
  for (const std::string task : {"niah_multikey_2", "niah_multikey_3"}) {
    SCOPED_TRACE(task);
    const Sample s = Make(task, 3000, 2);
    std::istringstream lines(s.context);
    std::string text;
    int count = 0;
    std::string asked_value;
    while (std::getline(lines, text)) {
      std::smatch m;
      ASSERT_TRUE(std::regex_match(text, m, line)) << text;
      ++count;
      if (s.parts.answer_prefix.find(" " + m[2].str() + " ") != std::string::npos) {
        EXPECT_TRUE(asked_value.empty()) << "the asked key appears twice";
        asked_value = m[3];
      }
    }
    EXPECT_GT(count, 50);
    EXPECT_EQ(asked_value, s.answers[0]);
  }
}

TEST_F(TasksTest, VariableTrackingChainLeadsFromTheValueToTheAnswers) {
  const Sample s = Make("vt", 4000, 9);
  ASSERT_EQ(s.answers.size(), 5u);
  const std::regex assign(R"(^VAR ([A-Z]+) = (VAR ([A-Z]+)|(\d+))$)");
  std::map<std::string, std::string> source;  // variable -> variable or value
  std::istringstream lines(s.context);
  std::string text;
  while (std::getline(lines, text)) {
    std::smatch m;
    if (std::regex_match(text, m, assign)) source[m[1]] = m[3].matched ? m[3].str() : m[4].str();
  }
  ASSERT_EQ(source.size(), 5u);
  // The value asked in the question, and every variable that resolves to it.
  std::smatch q;
  ASSERT_TRUE(std::regex_search(s.parts.answer_prefix, q,
                                std::regex(R"(assigned the value (\d+), they are)")));
  std::set<std::string> resolved;
  for (const auto& [name, from] : source) {
    std::string x = from;
    for (int hop = 0; hop < 10 && source.contains(x); ++hop) x = source[x];
    if (x == q[1]) resolved.insert(name);
  }
  EXPECT_EQ(resolved, std::set<std::string>(s.answers.begin(), s.answers.end()));
  for (const std::string& name : s.answers) EXPECT_EQ(name.size(), 5u);
  // One worked example with its own chain and answer comes first.
  EXPECT_EQ(Occurrences(s.parts.user, "Memorize and track"), 2);
  EXPECT_LT(s.parts.user.find("they are:"), s.parts.user.rfind("Memorize and track"));
}

// Word counts of a "1. word 2. word ..." list.
std::map<std::string, int> CountList(const std::string& list) {
  std::map<std::string, int> counts;
  std::istringstream in(list);
  std::string number, word;
  while (in >> number >> word) counts[word]++;
  return counts;
}

TEST_F(TasksTest, CommonWordsAnswerIsTheTenMostRepeatedWords) {
  for (int64_t target : {2000, 6000}) {
    SCOPED_TRACE(target);
    const Sample s = Make("cwe", target, 4);
    const std::map<std::string, int> counts = CountList(s.context);
    std::vector<std::pair<int, std::string>> ranked;
    for (const auto& [word, count] : counts) ranked.push_back({count, word});
    std::sort(ranked.rbegin(), ranked.rend());
    ASSERT_GT(ranked.size(), 20u);
    std::set<std::string> top;
    for (int i = 0; i < 10; ++i) top.insert(ranked[i].second);
    EXPECT_EQ(top, std::set<std::string>(s.answers.begin(), s.answers.end()));
    const int common = target < 4096 ? 6 : 30, other = target < 4096 ? 1 : 3;
    EXPECT_EQ(ranked[0].first, common);
    EXPECT_EQ(ranked[9].first, common);
    EXPECT_EQ(ranked[10].first, other);
    // One worked example (question and answer), then the real question.
    EXPECT_EQ(Occurrences(s.parts.user, "What are the 10 most common words"), 2);
    EXPECT_EQ(Occurrences(s.parts.user, "most often in the list are: 1. "), 1);
    EXPECT_EQ(Occurrences(s.parts.answer_prefix, "most often in the list are:"), 1);
  }
}

TEST_F(TasksTest, FrequentWordsAnswerIsRanksTwoToFour) {
  const Sample s = Make("fwe", 5000, 8);
  std::map<std::string, int> counts;
  std::istringstream in(s.context);
  std::string word;
  while (in >> word) counts[word]++;
  std::vector<std::pair<int, std::string>> ranked;
  for (const auto& [w, count] : counts) ranked.push_back({count, w});
  std::sort(ranked.rbegin(), ranked.rend());
  EXPECT_EQ(ranked[0].second, "...");
  ASSERT_EQ(s.answers.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ranked[i + 1].second, s.answers[i]);
    EXPECT_GT(ranked[i + 1].first, ranked[i + 2].first);  // no ties at the cut
    EXPECT_EQ(s.answers[i].size(), 6u);
  }
}

TEST_F(TasksTest, PasskeyAppearsInOneNeedle) {
  const Sample s = Make("passkey", 2000, 11);
  ASSERT_EQ(s.answers.size(), 1u);
  EXPECT_EQ(s.answers[0].size(), 5u);
  EXPECT_EQ(Occurrences(s.context, s.answers[0]),
            2);  // "The pass key is X. ... X is the pass key."
  EXPECT_EQ(Occurrences(s.context, "The pass key is " + s.answers[0] + ". Remember it."), 1);
}

TEST_F(TasksTest, MultiTurnHasEveryNeedleOnceAndOneQuestionPerTurn) {
  auto sample = SynthesizeMultiTurn(5, 6000, 3, 0, context_);
  ASSERT_TRUE(sample.ok()) << sample.status().ToString();
  ASSERT_EQ(sample->keys.size(), 5u);
  ASSERT_EQ(sample->followups.size(), 4u);
  EXPECT_EQ(std::set<std::string>(sample->keys.begin(), sample->keys.end()).size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(Occurrences(sample->first.context,
                          "for " + sample->keys[i] + " is: " + sample->values[i] + "."),
              1);
    const std::string& asked =
        i == 0 ? sample->first.parts.answer_prefix : sample->followups[i - 1].answer_prefix;
    EXPECT_NE(asked.find(" " + sample->keys[i] + " "), std::string::npos);
    // The recorded depth is where the needle really is.
    const size_t at = sample->first.context.find(sample->values[i]);
    EXPECT_NEAR(100.0 * at / sample->first.context.size(), sample->key_depths[i], 2.5);
  }
  EXPECT_EQ(sample->first.answers, std::vector<std::string>{sample->values[0]});
  EXPECT_LT(sample->first.prompt_tokens, 6000 - 5 * 128);
}

TEST_F(TasksTest, UnknownTaskAndTooSmallTargetAreErrors) {
  SampleRequest request;
  request.task = "qa_1";
  auto unknown = SynthesizeSample(request, context_);
  EXPECT_EQ(unknown.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("SQuAD"), std::string::npos);
  request.task = "niah_single_2";
  request.target_tokens = 100;
  EXPECT_EQ(SynthesizeSample(request, context_).status().code(), ErrorCode::kOutOfRange);
}

}  // namespace
}  // namespace shadowkv::eval
