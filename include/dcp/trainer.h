// The trainer of dcp's own model: the optimizer loop over StepPlans, its learning-rate schedule, checkpoints and
// held-out evaluation. One step's gradient is the runtime's (dcp/step_runner.h).
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
