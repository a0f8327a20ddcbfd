// Percentile-bootstrap 95% intervals for eval means: one row's mean, the average over rows
// (stratified by row) and paired differences between policies, reproducible from a seed.
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

namespace shadowkv::eval {

// Resamples per interval and the interval's coverage; fixed so that a report's intervals are
// the same wherever it is re-tabled (scripts/eval_table.py uses the same numbers).
inline constexpr int kBootstrapResamples = 2000;
inline constexpr double kBootstrapLevel = 0.95;

struct Interval {
  double low = std::numeric_limits<double>::quiet_NaN();
  double high = std::numeric_limits<double>::quiet_NaN();
};

// The statistic every interval here is of: the mean over the non-empty strata of each stratum's
// mean (one stratum: the plain mean). NaN when every stratum is empty.
double MeanOfMeans(const std::vector<std::vector<double>>& strata);

// Percentile bootstrap of MeanOfMeans. Each resample redraws every stratum with replacement at
// its own size (strata in order, draws Rng(seed).Below(size)), so strata never mix; the bounds
// are the (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled statistics, linear
// between order statistics. A paired difference is this over per-question differences. NaN
// when every stratum is empty or any holds a single value (one question has no spread to show).
Interval BootstrapMeanOfMeans(const std::vector<std::vector<double>>& strata, uint64_t seed,
                              int resamples = kBootstrapResamples, double level = kBootstrapLevel);

// The seed of one row's intervals at one length (row "" for the average over rows), derived
// from the report's seed; every policy of a row shares it.
uint64_t BootstrapSeed(uint64_t report_seed, int64_t length, std::string_view row);

}  // namespace shadowkv::eval
