// kv-eval's statistics over documents: the mean, the worst-decile mean and percentile bootstrap intervals.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
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

}  // namespace dcp
