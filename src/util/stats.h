// Small statistics shared by the profiler, the trainer's summary and the bench report.
#pragma once

#include <vector>

namespace dcp {

/// The median of `values` (the mean of the two middle values for an even count); 0 for an empty list.
double median(std::vector<double> values);

/// Relative errors of a fit, split by whether their point was held out of it.
struct SplitErrors {
  double heldout_median = 0;  ///< median of the held-out points' errors (0 for none)
  double heldout_max = 0;     ///< max of the same (0 for none)
  double fit_median = 0;      ///< median of the other points' errors (0 for none)
};
/// `errors[i]` belongs to a held-out point when `held_out[i]`; the lists must be as long (the shorter decides).
SplitErrors split_errors(const std::vector<double>& errors, const std::vector<bool>& held_out);

}  // namespace dcp
