// `dcp simulate`: plan an epoch with each planner under a cost model and compare their predicted epochs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/data.h"
#include "dcp/planners.h"

namespace dcp {

/// Everything a planner needs: the samples, the model shape and the device models (made from `dcp plan` and
/// `dcp simulate` options by make_planning_inputs, src/cli/planning_inputs.h).
struct PlanningInputs {
  std::string source;  ///< the lengths file or workload name
  std::vector<int64_t> lengths;
  std::vector<Sample> samples;
  ModelShape shape;
  std::unique_ptr<CostModel> cost;
  std::unique_ptr<MemoryModel> memory;
  PlannerOptions options;
};

/// The error of a planner that fits none of `samples` samples in the per-rank planning budget `budget_bytes`
/// (MemoryModel::budget_bytes: memory.budget_bytes less memory.margin): a ConfigError, exit 2, as `dcp train`
/// gives for the same fault. `dcp simulate` and `dcp plan` throw it.
ConfigError planner_fits_no_sample(const std::string& planner, size_t samples, double budget_bytes);

/// Plans the samples of `in` with every planner of `names` on `world_size` ranks, validates every step (a partition
/// of the ranks, every sample exactly once, the predicted peak within the budget) and prints, per planner, the
/// predicted epoch, the lower bound and their ratio, the speed-up over bucket (planned too when not named), the
/// planning time, samples trained and skipped, the rounds per step (and the steps of more than one) and the SP
/// sizes used: a markdown table, with `by_sp_size` one more per round index, SP size and mode (groups counted in
/// each round they run), or with `json` one JSON array. `native_iterations`: dcp-intra, dcp-inter and dcp-inter-pac form
/// their own iterations (PlannerOptions). Throws std::runtime_error naming the planner and the step for an invalid
/// plan or a predicted peak over the budget; ConfigError (exit 2) when a planner fits no sample
/// (planner_fits_no_sample).
void run_simulation(const PlanningInputs& in, const std::vector<std::string>& names, int64_t world_size,
                    bool native_iterations, bool by_sp_size, bool json);

}  // namespace dcp
