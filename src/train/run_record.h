// The trainer's record phase: one metrics.jsonl line per step, and over this invocation the summary's
// aggregates, among them what the plans decided and what they gained over the best static layout.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dcp/checkpoint.h"
#include "dcp/cost_model.h"
#include "dcp/data.h"
#include "dcp/plan.h"
#include "dcp/runtime.h"
#include "plan/static_baseline.h"

namespace dcp {

class RunRecord {
 public:
  /// `plan_source` names where the plans come from (a planner name or "plan-file") in warnings. `budget_bytes`
  /// is the whole per-rank budget measured peaks are checked against (memory's own budget, the planners', may
  /// be smaller by memory.margin).
  RunRecord(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost, const MemoryModel& memory,
            double budget_bytes, std::string plan_source);

  /// Records an executed step (state.step already counts it) and returns its metrics.jsonl line (README, "Where
  /// results go"). Updates state.cost_calibration, the EMA of measured / predicted step seconds.
  nlohmann::json step(const StepPlan& plan, const StepStats& stats, double step_time_s, double lr, double grad_norm,
                      TrainState& state);

  /// summary.json's fields from this invocation's steps: prediction errors, model FLOP/s, peaks, and "plans"
  /// (SP sizes, micro-batches per group, recompute, mixed steps, the best static layout's predicted time).
  nlohmann::json summary() const;

 private:
  /// What a step's plan decided, per group (metrics.jsonl), counted into the summary's aggregates.
  struct PlanRecord {
    std::vector<int64_t> sp_sizes;
    std::vector<std::string> sp_modes;      ///< "none" for sp 1
    std::vector<int64_t> group_micro_batches;
    std::vector<int64_t> rank_recompute;    ///< per rank: the most layers a micro-batch of its groups recomputes
    std::vector<std::vector<int64_t>> round_sp_sizes;  ///< per round: its groups' SP sizes
    double flops = 0;                       ///< the model's FLOPs without recompute
  };
  std::vector<double> predicted_rank_peaks(const StepPlan& plan) const;
  /// Measured against predicted peaks per rank; warns once when a measured or predicted peak is over the budget.
  /// Returns the predicted peaks.
  std::vector<double> record_memory(const StepPlan& plan, const StepStats& stats, int64_t step);
  PlanRecord record_plan(const StepPlan& plan);

  const std::vector<Sample>& samples_;
  int64_t world_size_;
  const CostModel& cost_;
  const MemoryModel& memory_;
  double budget_bytes_;
  std::string plan_source_;
  std::vector<std::vector<int64_t>> step_sample_ids_;  // the static layouts plan them once, in summary()
  bool warned_over_budget_ = false;
  int64_t steps_measured_over_budget_ = 0;  // steps where some rank's measured peak exceeded the budget  // static and file plans do not consult the memory model: say so once
  int64_t peak_bytes_ = 0;
  std::vector<double> memory_errors_;      // |predicted / measured - 1| per rank and step
  std::vector<double> prediction_errors_;  // |calibrated prediction / measured - 1| per step
  std::vector<double> model_errors_;       // |uncalibrated cost-model prediction / measured - 1| per step
  double flops_ = 0, seconds_ = 0, predicted_s_ = 0;
  int64_t steps_ = 0, steps_mixed_sp_ = 0, steps_with_rounds_ = 0, rounds_ = 0;
  std::map<int64_t, int64_t> groups_by_sp_, micro_batches_by_recompute_;
  std::map<std::string, int64_t> sp_groups_by_mode_;  // groups of sp_size > 1 by sp_mode
  std::vector<double> micro_batches_per_group_;
};

}  // namespace dcp
