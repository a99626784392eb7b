// `dcp profile`'s report: the grid's measured and predicted times and peaks, the fits and their errors.
#pragma once

#include <string>

#include "dcp/config.h"
#include "profile/profiler.h"

namespace dcp {

/// Prints the profile of `model` (at `precision`, PrecisionChoice::describe()) as markdown tables on stdout: per grid point measured and predicted
/// milliseconds and megabytes with their errors (held-out points marked), the fitted rates and their errors, and
/// under `dcp launch` the all-to-all and ring fits per SP size and the validation micro-batches; then where the
/// profile was written (`out_path`).
void print_profile_report(const ModelConfig& model, const std::string& precision, const ProfileOptions& options,
                          const ProfileResult& r, const std::string& out_path);

}  // namespace dcp
