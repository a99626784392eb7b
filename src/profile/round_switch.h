// The round switch of `dcp profile` under `dcp launch`: what a step pays when its ranks move from one round's
// groups to the next round's (StepPlan rounds), beyond the time of the rounds themselves.
#pragma once

#include <cstdint>

#include "dcp/config.h"
#include "dcp/dist.h"
#include "dcp/model.h"
#include "profile/profiler.h"

namespace dcp {

/// Times, on every rank at once, four steps of the model built from real micro-batches of `local_tokens`
/// random bytes per rank: `first` (round 0 alone: every rank runs its own sp-1 micro-batch), `second` (round 1
/// alone: a micro-batch of local_tokens * sp tokens on `group`, sharded as compute_step_gradients shards it,
/// under SequenceParallelAttention), `both` (round 0 then round 1, no barrier between: the ranks enter the
/// group as each finishes its sp-1 micro-batch, as the step runner does) and `barrier` (nothing). Each run
/// starts after a barrier of `world` and ends with one, so that it times the slowest rank; the four alternate,
/// `repeats` times after one warm-up each, and each is the median, then the mean over the ranks. The switch is
///   raw_s = both - first - second + barrier
/// (each run holds one closing barrier) and switch_s = max(0, raw_s). Every rank returns the same result.
/// Throws std::invalid_argument when local_tokens or repeats < 1, the group has one member, or
/// local_tokens * sp exceeds data.max_seq_len; what the model and the collectives throw.
RoundSwitchProfile profile_round_switch(Transformer& model, const Communicator& world, const Communicator& group,
                                        const Config& cfg, int64_t local_tokens, int64_t repeats);

}  // namespace dcp
