// What every training loop of the trainer shares: its optimizer and its thread count (trainer, dcp distill).
#pragma once

#include <torch/optim/adamw.h>

#include <memory>

#include "dcp/config.h"
#include "dcp/dist.h"
#include "dcp/model.h"

namespace dcp {

/// AdamW over all of `model`'s parameters in two groups: tensors of 2 or more dimensions with
/// cfg.weight_decay, the rest (norm gains, per-head scalars) without. A checkpoint's optimizer.pt is this
/// optimizer's state.
std::unique_ptr<torch::optim::AdamW> make_optimizer(Transformer& model, const TrainConfig& cfg);

/// Intra-op threads per rank: train.threads, or the machine's cores divided by the ranks on this node.
int64_t threads_per_rank(const TrainConfig& cfg, const DistEnv& env);

}  // namespace dcp
