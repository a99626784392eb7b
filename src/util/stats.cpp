#include "util/stats.h"

#include <algorithm>

namespace dcp {

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<long>(mid), values.end());
  if (values.size() % 2 == 1) return values[mid];
  const double upper = values[mid];
  return 0.5 * (upper + *std::max_element(values.begin(), values.begin() + static_cast<long>(mid)));
}

SplitErrors split_errors(const std::vector<double>& errors, const std::vector<bool>& held_out) {
  std::vector<double> heldout, fit;
  for (size_t i = 0; i < std::min(errors.size(), held_out.size()); ++i) (held_out[i] ? heldout : fit).push_back(errors[i]);
  SplitErrors s;
  s.heldout_median = median(heldout);
  s.heldout_max = heldout.empty() ? 0.0 : *std::max_element(heldout.begin(), heldout.end());
  s.fit_median = median(fit);
  return s;
}

}  // namespace dcp
