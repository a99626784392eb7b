// Atomic checkpoints: model, optimizer, training position and the resolved config.
#pragma once

#include <torch/optim/optimizer.h>

#include <string>

#include "dcp/config.h"
#include "dcp/model.h"

namespace dcp {

/// Where training stands; with the config's seed this fixes the data order, so resuming repeats no sample.
struct TrainState {
  int64_t step = 0;            ///< optimizer steps done
  int64_t epoch = 0;
  int64_t index_in_epoch = 0;  ///< next step of the epoch's plan list
  int64_t tokens_trained = 0;
  int64_t samples_trained = 0;
  double heldout_bits_per_byte_initial = 0;  ///< NaN when there is no held-out sample (null in JSON)
  double wall_time_s = 0;      ///< training wall time of all earlier invocations
  double cost_calibration = 0; ///< measured / predicted step time, EMA; 0 = not measured yet
};

/// Writes `dir` atomically: into `dir`.tmp first, then renamed over `dir`. Throws std::runtime_error naming
/// the path when writing fails.
void save_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer& optimizer,
                     const TrainState& state, const Config& cfg);

/// Reads the config stored in checkpoint `dir` (its config.yaml). Throws std::runtime_error naming the path
/// when the directory or file is missing, and naming the checkpoint when the file is not a valid config (never
/// ConfigError: a checkpoint's content is data, not a usage error).
Config load_checkpoint_config(const std::string& dir);

/// Throws std::runtime_error naming the first key whose value differs between `current` and the config stored
/// in checkpoint `dir`, among the model shape, the attention keys that fix the attention parameters (backend,
/// feature_map, num_features, input_norm, normalizer) and everything that fixes the data order (data.*,
/// run.seed, train batch sizes, parallel.sp_size): resuming across such a change would load mismatched weights
/// or repeat and skip samples.
void check_resumable(const std::string& dir, const Config& current);

/// Loads model weights (and optimizer state when `optimizer` is non-null) and returns the state. Throws
/// std::runtime_error naming the path when files are missing or unreadable, and naming the parameter and both
/// shapes when a stored tensor's shape differs from the one `model` was built with (another model config).
TrainState load_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer* optimizer);

}  // namespace dcp
