// Combining per-rank measurements so that every rank of a run holds the same numbers (and so fits the same
// model): the profiler's mean times and max peaks.
#pragma once

#include <vector>

#include "dcp/dist.h"

namespace dcp {

/// Per value, the mean and the max over the ranks.
struct OverRanks {
  std::vector<double> mean;
  std::vector<double> max;
};

/// Mean and max over the ranks of `world` of each of this rank's `values` (every rank passes as many), with one
/// allreduce: each rank writes its values into its own row of a zero [world size, n] fp64 tensor, the MAX
/// reduction fills every row, and each rank then sums the rows in rank order, so all ranks get bit-identical
/// results. With one rank both are `values`. Throws std::invalid_argument for a negative or non-finite value
/// (a zero row would beat it), and what the collective throws (a failed or hung peer).
OverRanks over_ranks(const Communicator& world, const std::vector<double>& values);

}  // namespace dcp
