// Small statistics shared by the profiler, the trainer's summary and the bench report.
#pragma once

#include <vector>

namespace dcp {

/// The median of `values` (the mean of the two middle values for an even count); 0 for an empty list.
double median(std::vector<double> values);

}  // namespace dcp
