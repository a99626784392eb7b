// train.cost_model resolved on this machine: the cost and memory models a training run is handed
// (dcp/trainer.h). `auto` profiles the model here on first use (every rank at once) and caches the profile.
#pragma once

#include <cstdint>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/dist.h"
#include "dcp/planning.h"

namespace dcp {

/// The run's RunCostModels for a model of `shape` (model_shape_of at the run's precision): train.cost_model
/// `auto` resolves to this machine's cached profile, or profiles the model first on every rank of `groups`
/// with `threads` intra-op threads each (resolve_cached_profile, src/profile/cache.h; logged with where the
/// profile is cached); `h200` is the analytic H200 (with a warning on this CPU); anything else is a `dcp profile`
/// file. The memory model bounds a sample by `longest_sample_tokens` and takes its budget from cfg.memory
/// (memory_model_for). Collective under auto: every rank calls it. Throws ConfigError (exit 2) when auto cannot
/// build the profile's grids from data.max_seq_len (min_profile_max_length) or when memory.budget_bytes is below
/// the model's resident bytes (weights, gradients, AdamW moments: nothing could run), and what the profile,
/// DeviceSpec::named and memory_model_for throw (a profile of another model or precision is refused).
RunCostModels resolve_cost_models(const Config& cfg, const ModelShape& shape, int64_t threads,
                                  int64_t longest_sample_tokens, const ProcessGroups& groups);

}  // namespace dcp
