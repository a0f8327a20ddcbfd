// StopMatcher: stop sequences split across pieces, earliest match, held text released.
#include "server/stop_matcher.h"

#include <gtest/gtest.h>

namespace shadowkv::server {
namespace {

TEST(StopMatcherTest, NoStopsPassesEverything) {
  StopMatcher m({});
  EXPECT_EQ(m.Push("abc"), "abc");
  EXPECT_EQ(m.Push(""), "");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, StopSplitAcrossPieces) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.Push("hello E"), "hello ");  // "E" may begin "END"
  EXPECT_EQ(m.Push("N"), "");
  EXPECT_EQ(m.Push("D tail"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Push("more"), "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, FalseStartIsReleased) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.Push("EN"), "");
  EXPECT_EQ(m.Push("x"), "ENx");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.Push("E"), "");
  EXPECT_EQ(m.Flush(), "E");  // generation ended: the held text is output
}

TEST(StopMatcherTest, EarliestOfSeveralStopsWins) {
  StopMatcher m({"world", "o"});
  EXPECT_EQ(m.Push("hello world"), "hell");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcherTest, OverlappingPrefixHoldsLongestCandidate) {
  StopMatcher m({"aab"});
  EXPECT_EQ(m.Push("xaa"), "x");
  EXPECT_EQ(m.Push("a"), "a");  // "aaa": only the last "aa" can still begin "aab"
  EXPECT_EQ(m.Push("b!"), "");
  EXPECT_TRUE(m.stopped());
}

}  // namespace
}  // namespace shadowkv::server
