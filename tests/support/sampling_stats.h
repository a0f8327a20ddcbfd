// Goodness of fit for the sampler tests: the truncated softmax a draw must follow, Pearson's
// chi-square of observed counts against it, and a bound that statistic passes by chance with
// probability below 1e-6.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace shadowkv::testing {

// softmax(logits / temperature) renormalised over `ids`, zero elsewhere ([logits.size()]).
inline std::vector<double> TruncatedSoftmax(const std::vector<float>& logits,
                                            const std::vector<int32_t>& ids, float temperature) {
  std::vector<double> p(logits.size(), 0.0);
  double max_logit = -INFINITY, sum = 0.0;
  for (int32_t id : ids) max_logit = std::max(max_logit, static_cast<double>(logits[id]));
  for (int32_t id : ids) sum += p[id] = std::exp((logits[id] - max_logit) / temperature);
  for (double& v : p) v /= sum;
  return p;
}

// Pearson's statistic of `counts` against probabilities `p`, over the ids with p > 0; a count
// where p is 0 makes it infinite. Ids expected fewer than 5 times are pooled into one cell (into
// the largest cell when the pool too is expected fewer than 5 times), as the statistic's
// chi-square law needs. `df` gets the degrees of freedom.
inline double ChiSquare(const std::vector<double>& counts, const std::vector<double>& p, int* df) {
  double n = 0.0;
  for (double c : counts) n += c;
  std::vector<double> observed, expected;
  double pool_observed = 0.0, pool_expected = 0.0;
  for (size_t v = 0; v < p.size(); ++v) {
    if (p[v] <= 0.0) {
      if (counts[v] > 0) return INFINITY;
      continue;
    }
    if (n * p[v] < 5.0) {
      pool_observed += counts[v];
      pool_expected += n * p[v];
    } else {
      observed.push_back(counts[v]);
      expected.push_back(n * p[v]);
    }
  }
  if (pool_expected >= 5.0 || observed.empty()) {
    observed.push_back(pool_observed);
    expected.push_back(pool_expected);
  } else if (pool_expected > 0.0) {
    const size_t largest = std::max_element(expected.begin(), expected.end()) - expected.begin();
    observed[largest] += pool_observed;
    expected[largest] += pool_expected;
  }
  double chi = 0.0;
  for (size_t i = 0; i < observed.size(); ++i) {
    const double d = observed[i] - expected[i];
    chi += d * d / expected[i];
  }
  *df = static_cast<int>(observed.size()) - 1;
  return chi;
}

// The chi-square quantile 1 - 3e-7 (z = 5) by the Wilson–Hilferty approximation.
inline double ChiSquareBound(int df) {
  const double k = std::max(df, 1), a = 2.0 / (9.0 * k);
  return k * std::pow(1.0 - a + 5.0 * std::sqrt(a), 3.0);
}

}  // namespace shadowkv::testing
