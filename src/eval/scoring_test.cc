// RULER's string-match metrics on hand-made predictions.
#include "eval/scoring.h"

#include <gtest/gtest.h>

namespace shadowkv::eval {
namespace {

using Refs = std::vector<std::string>;

TEST(ScoringTest, CorrectAnswerScoresOneAndWrongScoresZero) {
  const Refs refs = {"4821937"};
  EXPECT_EQ(StringMatchAll(": 4821937.", refs), 1.0);
  EXPECT_EQ(StringMatchAll(": 4821936.", refs), 0.0);
  EXPECT_EQ(StringMatchAll("", refs), 0.0);
  EXPECT_EQ(StringMatchPart(": 4821937.", refs), 1.0);
  EXPECT_EQ(StringMatchPart("no idea", refs), 0.0);
}

TEST(ScoringTest, PartialListsScorePartially) {
  const Refs refs = {"ZQWXA", "PLMOK", "RTYUI", "VBNMC"};
  EXPECT_DOUBLE_EQ(StringMatchAll("ZQWXA RTYUI", refs), 0.5);
  EXPECT_DOUBLE_EQ(StringMatchAll("ZQWXA PLMOK RTYUI", refs), 0.75);
  EXPECT_DOUBLE_EQ(StringMatchAll("VBNMC, RTYUI, PLMOK and ZQWXA", refs), 1.0);
  // string_match_part only needs one of them.
  EXPECT_EQ(StringMatchPart("RTYUI", refs), 1.0);
}

TEST(ScoringTest, IgnoresCase) {
  EXPECT_EQ(StringMatchAll("The answer: Crimson-Lantern", Refs{"crimson-lantern"}), 1.0);
  EXPECT_EQ(StringMatchAll("ab12cd34-0000-4abc-8def-0123456789ab",
                           Refs{"AB12CD34-0000-4ABC-8DEF-0123456789AB"}),
            1.0);
}

TEST(ScoringTest, CleanPredictionTurnsControlCharactersIntoNewlinesAndTrims) {
  EXPECT_EQ(CleanPrediction("  \x01"
                            "abc\tdef\r\n"),
            "abc\ndef");
  EXPECT_EQ(CleanPrediction(" \n\t "), "");
  EXPECT_EQ(CleanPrediction("x"), "x");
}

TEST(ScoringTest, ScoreAppliesTheMetricToTheCleanedPrediction) {
  const Refs words = {"apple", "river", "candle"};
  EXPECT_DOUBLE_EQ(Score(Metric::kStringMatchAll, " 1. apple 2. River\n", words), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(Score(Metric::kStringMatchPart, " 1. apple 2. River\n", words), 1.0);
  EXPECT_EQ(Score(Metric::kStringMatchAll, "anything", Refs{}), 0.0);
}

}  // namespace
}  // namespace shadowkv::eval
