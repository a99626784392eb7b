// Executing one StepPlan on dcp's own model: the gradient of one global step over every rank, and its plain
// single-process reference twin with the comparison of the two (dcp verify-plan).
#pragma once

#include "dcp/data.h"
#include "dcp/dist.h"
#include "dcp/model.h"
#include "dcp/plan.h"
#include "dcp/runtime.h"

namespace dcp {

/// Runs this rank's micro-batches of `plan` (rank_micro_batches in dcp/runtime.h; forward, backward with every token loss divided by
/// plan.global_num_tokens; in a group of sp_size > 1 each rank holds one shard of every micro-batch and
/// attention exchanges across the group), then reduce_step: one SUM all-reduce over the world of all parameter gradients
/// together with the loss, the per-rank busy times and the per-rank peak bytes (MemoryMeter::reset_peak() starts
/// the window).
/// Afterwards every rank holds the gradient of the step's mean token loss. Gradients are overwritten, not
/// accumulated. Throws std::runtime_error when the ranks' plans differ
/// (hash check, naming the step) or a peer fails, std::out_of_range when no process group of a plan's
/// sp_size exists, std::invalid_argument when n_heads is not divisible by an sp_size.
StepStats compute_step_gradients(Transformer& model, const Corpus& corpus, const StepPlan& plan,
                                  const ProcessGroups& groups);

/// The plain single-process reference of a step: loads every sample of `plan` into one packed stream on this
/// process, no communication, and sets each parameter's .grad to the gradient of
/// (1 / plan.global_num_tokens) * (sum of token losses). Returns the mean token loss (nats).
double reference_step_gradients(Transformer& model, const Corpus& corpus, const StepPlan& plan);

/// How far `model`'s parameter gradients are from `reference` (same parameter order).
struct GradientComparison {
  double max_abs_err = 0;  ///< max over all elements of |g - g_ref|
  double max_abs_ref = 0;  ///< max over all elements of |g_ref|
  double max_rel_err = 0;  ///< max_abs_err / max_abs_ref: scale-free, well defined where g_ref is near 0
};
/// Throws std::invalid_argument when the parameter lists differ in length or shape.
GradientComparison compare_gradients(Transformer& model, Transformer& reference);

}  // namespace dcp
