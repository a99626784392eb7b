#include "plan/gas_solver.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dcp::planner_detail {

double gas_error(double seconds, int64_t g, double tau) {
  const double d = seconds * static_cast<double>(g) - tau;
  return d > 0 ? 1.2 * d : -d;
}

int64_t gas_upper_bound(const std::vector<double>& seconds, size_t i, int64_t max_gas) {
  const double t_max = *std::max_element(seconds.begin(), seconds.end());
  const double ratio = static_cast<double>(max_gas) * t_max / seconds[i];
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(ratio * (1 + 1e-9))));
}

std::vector<int64_t> solve_grad_accum_steps(const std::vector<double>& seconds, int64_t max_gas, int64_t min_gas,
                                            const std::vector<int64_t>& caps) {
  if (max_gas < 1) throw std::invalid_argument(fmt::format("gas solver: max_gas {} must be at least 1", max_gas));
  if (min_gas < 1) throw std::invalid_argument(fmt::format("gas solver: min_gas {} must be at least 1", min_gas));
  for (size_t i = 0; i < seconds.size(); ++i) {
    if (!(seconds[i] > 0) || !std::isfinite(seconds[i])) {
      throw std::invalid_argument(fmt::format("gas solver: group {} time {} s must be positive", i, seconds[i]));
    }
  }
  if (!caps.empty() && caps.size() != seconds.size()) {
    throw std::invalid_argument(fmt::format("gas solver: {} caps for {} groups", caps.size(), seconds.size()));
  }
  for (size_t i = 0; i < caps.size(); ++i) {
    if (caps[i] < 1) throw std::invalid_argument(fmt::format("gas solver: group {} cap {} must be at least 1", i, caps[i]));
  }
  const size_t n = seconds.size();
  if (n == 0) return {};
  std::vector<int64_t> hi(n);
  for (size_t i = 0; i < n; ++i) {
    hi[i] = gas_upper_bound(seconds, i, max_gas);
    if (!caps.empty()) hi[i] = std::min(hi[i], caps[i]);
  }

  std::vector<int64_t> best(n, 1), cur(n);
  double best_total = std::numeric_limits<double>::infinity();
  std::vector<double> tried;
  for (size_t o = 0; o < n; ++o) {
    if (std::find(tried.begin(), tried.end(), seconds[o]) != tried.end()) continue;
    tried.push_back(seconds[o]);
    for (int64_t m = 1; m <= hi[o]; ++m) {
      const double tau = seconds[o] * static_cast<double>(m);
      double total = 0;
      for (size_t i = 0; i < n; ++i) {
        const auto below = static_cast<int64_t>(std::floor(tau / seconds[i]));
        const int64_t a = std::clamp<int64_t>(below, 1, hi[i]), b = std::clamp<int64_t>(below + 1, 1, hi[i]);
        cur[i] = gas_error(seconds[i], b, tau) < gas_error(seconds[i], a, tau) ? b : a;
        total += gas_error(seconds[i], cur[i], tau);
      }
      if (total < best_total) best_total = total, best = cur;
    }
  }
  const int64_t top = *std::max_element(best.begin(), best.end());
  if (top < min_gas) {
    const int64_t factor = (min_gas + top - 1) / top;
    for (size_t i = 0; i < n; ++i) best[i] = std::min(best[i] * factor, caps.empty() ? best[i] * factor : caps[i]);
  }
  return best;
}

}  // namespace dcp::planner_detail
