// What DCP's planning gained: the predicted time of the same steps under the best static layout.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcp/cost_model.h"
#include "dcp/data.h"

namespace dcp {

/// The static layouts a run's plans are compared with: `packed` and `bucket` (planners.h) at every SP size that
/// divides world_size and the heads, each with the recompute the longest sample of the step needs (per step,
/// which favours the static layouts, so the gain is never overstated). Each step's samples are
/// planned as one step by every layout and costed by the same CostModel and MemoryModel as the run's plans.
class StaticBaselines {
 public:
  StaticBaselines(int64_t world_size, const CostModel& cost, const MemoryModel& memory);

  /// Plans and costs one step's samples (`ids` index `samples`) with every layout. A layout that cannot place
  /// every sample of some step (memory) is out of the comparison from then on.
  void add_step(const std::vector<int64_t>& ids, const std::vector<Sample>& samples);

  struct Best {
    std::string layout;  ///< e.g. "packed sp 2"
    double predicted_s;  ///< summed predicted step seconds over the added steps (CostModel, no calibration)
  };
  /// The layout with the least summed predicted time among those that placed every step; nullopt when none did
  /// or no step was added.
  std::optional<Best> best() const;

 private:
  int64_t world_size_;
  const CostModel& cost_;
  const MemoryModel& memory_;
  std::vector<int64_t> sp_sizes_;
  std::map<std::string, double> total_s_;
  std::set<std::string> infeasible_;
};

}  // namespace dcp
