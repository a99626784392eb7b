// Executing StepPlans: gradient of one global step, the optimizer loop, checkpoints and evaluation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
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

/// Learning rate at `step` (0-based): linear warm-up over warmup_steps, then cosine decay to
/// lr * min_lr_ratio at max_steps (Loshchilov & Hutter 2017, SGDR without restarts).
double lr_at(int64_t step, const TrainConfig& cfg);

/// Held-out mean loss in bits per byte over the first eval.max_tokens tokens of the held-out samples,
/// evaluated in shards over all ranks and summed with one all-reduce.
double heldout_bits_per_byte(Transformer& model, const Corpus& corpus, const Config& cfg, const ProcessGroups& groups);

/// Trains `cfg` on the corpus of cfg.data, writing run_dir outputs: config.yaml, metrics.jsonl, summary.json,
/// checkpoint/, logs/. Steps follow static plans (groups of parallel.sp_size ranks), or, when `plans` is
/// non-empty, the given plans in order, repeated as epochs. With `resume`, continues from run_dir/checkpoint
/// exactly (same data order, optimizer state and LR schedule). `groups` must hold every SP size the plans use.
struct TrainOptions {
  bool resume = false;             ///< continue from run_dir/checkpoint (or the .old a crash left)
  bool allow_data_change = false;  ///< resume although the corpus fingerprint differs (a warning instead)
  std::vector<StepPlan> plans;     ///< execute these instead of planning (repeated as epochs)
};

/// One run dir holds one run: run_dir/run.lock (lock_run_dir) refuses a second concurrent one. A non-finite loss
/// or gradient norm stops the run before the optimizer step (train.nonfinite stop) or drops that update (skip).
/// Throws std::runtime_error for bad data, a failed peer, a busy run dir, a non-finite step, a checkpoint that is
/// corrupt or of another corpus (TrainOptions::allow_data_change), and std::invalid_argument for a plan that does
/// not fit.
void train(const Config& cfg, const ProcessGroups& groups, const TrainOptions& options = {});

}  // namespace dcp
