// The trainer's planning phase: every epoch's StepPlans, from the planner train.planner names (or the static
// data-parallel layout, or a plan file), under the run's cost and memory models.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/data.h"
#include "dcp/plan.h"
#include "dcp/planning.h"

namespace dcp {

class EpochPlanner {
 public:
  /// Built from train.* (planner, max_rounds, batch sizes), parallel.* (the static layout's sp_size, sp_sizes, sp_mode,
  /// ulysses_size), model.n_heads and model.recompute_layers, run.seed. Logs what one sample of each length needs
  /// under the memory budget and, for the static planner sized to the longest sample (parallel.sp_size 0), the
  /// layout it chose. `file_plans` non-empty: every epoch runs them, in order. The referenced corpus and models
  /// must outlive the planner. Throws what resolve_sp_sizes and size_static_planner throw.
  EpochPlanner(const TrainConfig& train, const ParallelConfig& parallel, const ModelConfig& model, uint64_t seed,
               int64_t world_size, const Corpus& corpus, const std::vector<int64_t>& train_lengths,
               const RunCostModels& models, std::vector<StepPlan> file_plans);

  /// The plans of `epoch` (identical on every rank). Samples no SP size can hold under the budget are skipped,
  /// logged with an example and counted in skipped().
  std::vector<StepPlan> plans(int64_t epoch);
  /// Samples skipped so far by reason ("exceeds_memory_budget").
  const std::map<std::string, int64_t>& skipped() const { return skipped_; }
  /// What one sample of each power-of-two length up to the longest needs (summary.json memory_needs).
  const std::vector<LengthNeed>& needs() const { return needs_; }
  /// train.planner, or "plan-file" when the plans are given.
  const std::string& name() const { return name_; }

 private:
  const Corpus& corpus_;
  const RunCostModels& models_;
  std::vector<StepPlan> file_plans_;
  std::string planner_, name_;
  uint64_t seed_;
  int64_t world_size_, global_batch_tokens_, max_rounds_;
  DataParallelOptions dp_;
  int64_t static_max_sample_tokens_ = std::numeric_limits<int64_t>::max();  // static: longer samples skipped
  std::vector<LengthNeed> needs_;
  std::map<std::string, int64_t> skipped_;
};

}  // namespace dcp
