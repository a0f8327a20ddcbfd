// Bootstrap intervals on small known samples: width, coverage of the mean, strata, pairing, seeds.
#include "eval/bootstrap.h"

#include <gtest/gtest.h>

#include <cmath>

namespace shadowkv::eval {
namespace {

TEST(BootstrapTest, AConstantSampleHasAZeroWidthInterval) {
  const Interval interval = BootstrapMeanOfMeans({{40.0, 40.0, 40.0, 40.0}}, 11);
  EXPECT_EQ(interval.low, 40.0);
  EXPECT_EQ(interval.high, 40.0);
}

TEST(BootstrapTest, TheIntervalContainsTheMeanAndStaysInsideTheSample) {
  const std::vector<std::vector<double>> sample = {{0, 100, 100, 0, 100, 100, 100, 0, 100, 100}};
  EXPECT_DOUBLE_EQ(MeanOfMeans(sample), 70.0);
  const Interval interval = BootstrapMeanOfMeans(sample, 5);
  EXPECT_LT(interval.low, 70.0);
  EXPECT_GT(interval.high, 70.0);
  EXPECT_GE(interval.low, 0.0);
  EXPECT_LE(interval.high, 100.0);
  // Ten Bernoulli(0.7) answers: the interval is wide (roughly +-28 points), not a point.
  EXPECT_GT(interval.high - interval.low, 30.0);
  EXPECT_LT(interval.high - interval.low, 80.0);
}

TEST(BootstrapTest, TheAverageResamplesWithinEachRow) {
  // Row means 100 and 0 with one stratum constant each: the average over rows is always 50,
  // whereas pooling the questions would make it vary with the rows' shares.
  const std::vector<std::vector<double>> rows = {{100, 100, 100}, {0, 0, 0, 0, 0, 0, 0}};
  EXPECT_DOUBLE_EQ(MeanOfMeans(rows), 50.0);
  const Interval interval = BootstrapMeanOfMeans(rows, 3);
  EXPECT_EQ(interval.low, 50.0);
  EXPECT_EQ(interval.high, 50.0);
  // Empty rows (a task not run at this length) are left out of the average, as in the table.
  EXPECT_DOUBLE_EQ(MeanOfMeans({{100, 0}, {}, {20, 20}}), 35.0);
  const Interval skipping = BootstrapMeanOfMeans({{100, 0}, {}, {20, 20}}, 3);
  EXPECT_EQ(skipping.low, 10.0);   // (0 + 20) / 2
  EXPECT_EQ(skipping.high, 60.0);  // (100 + 20) / 2
  EXPECT_TRUE(std::isnan(BootstrapMeanOfMeans({{}, {}}, 3).low));
  // A row of one question (one sample per grid cell) gives no interval, nor does an average
  // over such rows: its spread is unknown, not zero.
  EXPECT_TRUE(std::isnan(BootstrapMeanOfMeans({{100}}, 3).low));
  EXPECT_TRUE(std::isnan(BootstrapMeanOfMeans({{100, 0}, {100}}, 3).high));
}

TEST(BootstrapTest, ThePairedDifferenceOfIdenticalAnswersIsExactlyZero) {
  const std::vector<double> a = {100, 0, 50, 100, 0}, b = a;
  std::vector<double> difference;
  for (size_t i = 0; i < a.size(); ++i) difference.push_back(b[i] - a[i]);
  const Interval interval = BootstrapMeanOfMeans({difference, {0.0, 0.0}}, 9);
  EXPECT_EQ(interval.low, 0.0);
  EXPECT_EQ(interval.high, 0.0);
}

TEST(BootstrapTest, TheSameSeedGivesTheSameIntervalAndAnotherSeedAnother) {
  const std::vector<std::vector<double>> rows = {{3, 17, 29, 41, 55, 62, 78, 90, 11, 47},
                                                 {100, 0, 0, 35, 80}};
  const Interval first = BootstrapMeanOfMeans(rows, BootstrapSeed(42, 4096, "vt"));
  const Interval again = BootstrapMeanOfMeans(rows, BootstrapSeed(42, 4096, "vt"));
  EXPECT_EQ(first.low, again.low);
  EXPECT_EQ(first.high, again.high);
  EXPECT_NE(BootstrapSeed(42, 4096, "vt"), BootstrapSeed(43, 4096, "vt"));
  EXPECT_NE(BootstrapSeed(42, 4096, "vt"), BootstrapSeed(42, 8192, "vt"));
  EXPECT_NE(BootstrapSeed(42, 4096, "vt"), BootstrapSeed(42, 4096, ""));
  const Interval other = BootstrapMeanOfMeans(rows, BootstrapSeed(43, 4096, "vt"));
  EXPECT_TRUE(other.low != first.low || other.high != first.high);
}

}  // namespace
}  // namespace shadowkv::eval
