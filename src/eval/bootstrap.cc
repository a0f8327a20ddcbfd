// Percentile bootstrap over strata of scores.
#include "eval/bootstrap.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "eval/rng.h"

namespace shadowkv::eval {
namespace {

// Quantile q of sorted values, linear between the order statistics around q * (n - 1).
double Quantile(const std::vector<double>& sorted, double q) {
  const double position = q * static_cast<double>(sorted.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(position));
  if (below + 1 >= sorted.size()) return sorted.back();
  return sorted[below] +
         (position - static_cast<double>(below)) * (sorted[below + 1] - sorted[below]);
}

}  // namespace

double MeanOfMeans(const std::vector<std::vector<double>>& strata) {
  double total = 0.0;
  int used = 0;
  for (const std::vector<double>& stratum : strata) {
    if (stratum.empty()) continue;
    double sum = 0.0;
    for (double v : stratum) sum += v;
    total += sum / static_cast<double>(stratum.size());
    used++;
  }
  return used ? total / used : std::numeric_limits<double>::quiet_NaN();
}

Interval BootstrapMeanOfMeans(const std::vector<std::vector<double>>& strata, uint64_t seed,
                              int resamples, double level) {
  Interval interval;
  if (resamples < 1 || std::isnan(MeanOfMeans(strata))) return interval;
  // One question shows no spread: resampling it would claim a zero-width interval.
  for (const std::vector<double>& stratum : strata) {
    if (stratum.size() == 1) return interval;
  }
  Rng rng(seed);
  std::vector<double> statistics;
  statistics.reserve(resamples);
  for (int b = 0; b < resamples; ++b) {
    double total = 0.0;
    int used = 0;
    for (const std::vector<double>& stratum : strata) {
      if (stratum.empty()) continue;
      double sum = 0.0;
      for (size_t i = 0; i < stratum.size(); ++i) sum += stratum[rng.Below(stratum.size())];
      total += sum / static_cast<double>(stratum.size());
      used++;
    }
    statistics.push_back(total / used);
  }
  std::sort(statistics.begin(), statistics.end());
  interval.low = Quantile(statistics, (1.0 - level) / 2.0);
  interval.high = Quantile(statistics, (1.0 + level) / 2.0);
  return interval;
}

uint64_t BootstrapSeed(uint64_t report_seed, int64_t length, std::string_view row) {
  return DeriveSeed(report_seed, "bootstrap:" + std::string(row), static_cast<uint64_t>(length));
}

}  // namespace shadowkv::eval
