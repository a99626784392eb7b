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

namespace dcp {

/// What one rank measured in one global step, after the step's single gradient reduction.
struct StepResult {
  double loss = 0;                  ///< mean next-token loss over the step's global_num_tokens (nats)
  int64_t tokens = 0;               ///< global_num_tokens
  int64_t samples = 0;              ///< samples in the step, all groups
  std::vector<double> rank_busy_s;  ///< per rank: forward+backward seconds before the reduction
};

/// Runs this rank's micro-batches of `plan` (forward, backward with every token loss divided by
/// plan.global_num_tokens), then one SUM all-reduce over the world of all parameter gradients together with
/// the loss and the per-rank busy times. Afterwards every rank holds the gradient of the step's mean token
/// loss. Gradients are overwritten, not accumulated. Throws std::runtime_error when the ranks' plans differ
/// (hash check, naming the step) or a peer fails.
StepResult compute_step_gradients(Transformer& model, const Corpus& corpus, const StepPlan& plan,
                                  const ProcessGroups& groups);

/// Learning rate at `step` (0-based): linear warm-up over warmup_steps, then cosine decay to
/// lr * min_lr_ratio at max_steps (Loshchilov & Hutter 2017, SGDR without restarts).
double lr_at(int64_t step, const TrainConfig& cfg);

/// Held-out mean loss in bits per byte over the first eval.max_tokens tokens of the held-out samples,
/// evaluated in shards over all ranks and summed with one all-reduce.
double heldout_bits_per_byte(Transformer& model, const Corpus& corpus, const Config& cfg, const ProcessGroups& groups);

/// Trains `cfg` on `corpus` following static data-parallel plans (or `plan_file`), writing run_dir outputs:
/// config.yaml, metrics.jsonl, summary.json, checkpoint/, logs/. With `resume`, continues from
/// run_dir/checkpoint exactly (same data order, optimizer state and LR schedule).
/// Returns the process exit code (0 on success); throws on errors that every rank sees.
int train(const Config& cfg, const ProcessGroups& groups, bool resume);

}  // namespace dcp
