// kv-eval's statistics over documents: the mean, the worst-decile mean and percentile bootstrap intervals.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>

#include "tools/kv_eval.h"

namespace dcp {

double mean_of(const std::vector<double>& values) {
  if (values.empty()) throw std::invalid_argument("mean_of: no values");
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

double worst_fraction_mean(const std::vector<double>& values, double fraction) {
  if (values.empty()) throw std::invalid_argument("worst_fraction_mean: no values");
  if (!(fraction > 0 && fraction <= 1)) {
    throw std::invalid_argument(fmt::format("worst_fraction_mean: fraction {} outside (0, 1]", fraction));
  }
  // ceil of a product such as 0.1 x 30 must not round 3.0000000000000004 up to 4.
  const auto k = static_cast<size_t>(
      std::max(1.0, std::ceil(fraction * static_cast<double>(values.size()) - 1e-9)));
  std::vector<double> sorted = values;
  std::partial_sort(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(k), sorted.end(),
                    std::greater<double>());
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += sorted[i];
  return sum / static_cast<double>(k);
}

KvEvalStat bootstrap_stat(const std::vector<double>& values, double (*statistic)(const std::vector<double>&),
                          int64_t resamples, uint64_t seed) {
  if (values.empty()) throw std::invalid_argument("bootstrap_stat: no values");
  if (resamples < 1) throw std::invalid_argument(fmt::format("bootstrap_stat: resamples {} must be >= 1", resamples));
  KvEvalStat out;
  out.value = statistic(values);
  // Indices drawn by hand from the raw generator (not std::uniform_int_distribution, whose algorithm differs
  // between standard libraries), so a seed gives the same resamples everywhere.
  std::mt19937_64 rng(seed);
  const uint64_t n = values.size();
  std::vector<double> stats, draw(values.size());
  stats.reserve(static_cast<size_t>(resamples));
  for (int64_t r = 0; r < resamples; ++r) {
    for (auto& d : draw) d = values[static_cast<size_t>(rng() % n)];
    stats.push_back(statistic(draw));
  }
  std::sort(stats.begin(), stats.end());
  // Percentiles by linear interpolation between order statistics.
  auto percentile = [&](double q) {
    const double pos = q * static_cast<double>(stats.size() - 1);
    const auto lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, stats.size() - 1);
    return stats[lo] + (stats[hi] - stats[lo]) * (pos - static_cast<double>(lo));
  };
  out.ci = {percentile(0.025), percentile(0.975)};
  return out;
}

KvEvalStat kv_eval_bootstrap(const std::vector<double>& values, const std::vector<int64_t>& cluster,
                             int64_t resamples, uint64_t seed) {
  if (values.empty()) throw std::invalid_argument("kv_eval_bootstrap: no values");
  if (cluster.size() != values.size()) {
    throw std::invalid_argument(fmt::format("kv_eval_bootstrap: {} cluster ids for {} values", cluster.size(),
                                            values.size()));
  }
  if (resamples < 1) throw std::invalid_argument(fmt::format("kv_eval_bootstrap: resamples {} must be >= 1", resamples));
  int64_t k = 0;
  for (int64_t c : cluster) {
    if (c < 0) throw std::invalid_argument(fmt::format("kv_eval_bootstrap: cluster id {} is negative", c));
    k = std::max(k, c + 1);
  }
  // Per cluster: the sum of its values and how many (every id below k must be used).
  std::vector<double> sum(static_cast<size_t>(k), 0.0);
  std::vector<int64_t> count(static_cast<size_t>(k), 0);
  for (size_t i = 0; i < values.size(); ++i) {
    sum[static_cast<size_t>(cluster[i])] += values[i];
    ++count[static_cast<size_t>(cluster[i])];
  }
  for (int64_t c = 0; c < k; ++c) {
    if (count[static_cast<size_t>(c)] == 0) {
      throw std::invalid_argument(fmt::format("kv_eval_bootstrap: cluster id {} has no value (ids must be 0..k-1)", c));
    }
  }
  KvEvalStat out;
  out.value = mean_of(values);
  // Clusters drawn by hand from the raw generator (as bootstrap_stat), so a seed resamples alike everywhere.
  std::mt19937_64 rng(seed);
  const auto uk = static_cast<uint64_t>(k);
  std::vector<double> stats;
  stats.reserve(static_cast<size_t>(resamples));
  for (int64_t r = 0; r < resamples; ++r) {
    double s = 0;
    int64_t n = 0;
    for (int64_t j = 0; j < k; ++j) {
      const auto c = static_cast<size_t>(rng() % uk);
      s += sum[c];
      n += count[c];
    }
    stats.push_back(s / static_cast<double>(n));
  }
  std::sort(stats.begin(), stats.end());
  auto percentile = [&](double q) {
    const double pos = q * static_cast<double>(stats.size() - 1);
    const auto lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, stats.size() - 1);
    return stats[lo] + (stats[hi] - stats[lo]) * (pos - static_cast<double>(lo));
  };
  out.ci = {percentile(0.025), percentile(0.975)};
  return out;
}

KvEvalStat kv_quantile_with_ci(const std::vector<double>& values, double q, double level) {
  if (values.empty()) throw std::invalid_argument("kv_quantile_with_ci: no values");
  if (!(q > 0 && q < 1) || !(level > 0 && level < 1)) {
    throw std::invalid_argument(fmt::format("kv_quantile_with_ci: q {} and level {} must lie in (0, 1)", q, level));
  }
  std::vector<double> sorted = values;
  std::sort(sorted.begin(), sorted.end());
  const auto n = static_cast<int64_t>(sorted.size());
  // 1-based order statistic x_(i) = sorted[i - 1].
  auto order = [&](int64_t i) { return sorted[static_cast<size_t>(i - 1)]; };
  const auto point = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(q * static_cast<double>(n) - 1e-9)), 1, n);
  // cdf[j] = P(B <= j) for B ~ Binomial(n, q), j = 0..n, from log terms.
  std::vector<double> cdf(static_cast<size_t>(n + 1));
  double acc = 0;
  for (int64_t j = 0; j <= n; ++j) {
    const double log_term = std::lgamma(static_cast<double>(n + 1)) - std::lgamma(static_cast<double>(j + 1)) -
                            std::lgamma(static_cast<double>(n - j + 1)) + static_cast<double>(j) * std::log(q) +
                            static_cast<double>(n - j) * std::log1p(-q);
    acc += std::exp(log_term);
    cdf[static_cast<size_t>(j)] = std::min(acc, 1.0);
  }
  const double tail = (1 - level) / 2;
  // Lower: the largest l with P(B <= l - 1) <= tail (then P(x_(l) <= xi) >= 1 - tail); upper: the smallest u with
  // P(B <= u - 1) >= 1 - tail.
  int64_t l = 0;
  for (int64_t i = 1; i <= n; ++i) {
    if (cdf[static_cast<size_t>(i - 1)] <= tail) l = i;
  }
  int64_t u = n + 1;
  for (int64_t i = n; i >= 1; --i) {
    if (cdf[static_cast<size_t>(i - 1)] >= 1 - tail) u = i;
  }
  const double inf = std::numeric_limits<double>::infinity();
  KvEvalStat out;
  out.value = order(point);
  out.ci = {l >= 1 ? order(l) : -inf, u <= n ? order(u) : inf};
  return out;
}

}  // namespace dcp
