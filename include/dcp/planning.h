// Plans for training: a dcp model config seen by the planners, and an epoch planned over the training samples.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/planners.h"

namespace dcp {

/// The planners' view of a dcp model: SwiGLU (3 MLP matrices), the byte vocabulary, and `bytes_per_element`
/// (2 for bf16 on GPUs, 4 for this CPU build's fp32).
ModelShape model_shape_of(const ModelConfig& model, int64_t bytes_per_element = 2);

/// One epoch of the training samples planned by `planner` (a name of planner_names()): the planner sees the
/// training samples as a dense list, and the plans it returns are mapped back to corpus sample ids. Samples
/// the planner cannot place (no SP size fits memory) are returned in `skipped_ids` (corpus ids).
/// Throws std::invalid_argument for an unknown planner name and what the planner throws.
PlanSet plan_training_epoch(const std::string& planner, const std::vector<Sample>& samples,
                            const std::vector<int64_t>& train_ids, int64_t epoch, int64_t world_size,
                            const CostModel& cost, const MemoryModel& memory, const PlannerOptions& options);

}  // namespace dcp
