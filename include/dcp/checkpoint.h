// Checkpoints that survive crashes and refuse corruption: model, optimizer, training position and the resolved
// config, each file checksummed in a manifest, installed with renames that never remove the last good one.
#pragma once

#include <torch/optim/optimizer.h>

#include <string>

#include "dcp/config.h"
#include "dcp/model.h"

namespace dcp {

/// Where training stands; with the config's seed this fixes the data order, so resuming repeats no sample.
struct TrainState {
  int64_t step = 0;            ///< optimizer steps done (skipped non-finite steps included)
  int64_t epoch = 0;
  int64_t index_in_epoch = 0;  ///< next step of the epoch's plan list
  int64_t tokens_trained = 0;
  int64_t samples_trained = 0;
  int64_t nonfinite_skips = 0; ///< steps whose update train.nonfinite skip dropped, over all invocations
  double heldout_bits_per_byte_initial = 0;  ///< NaN when there is no held-out sample (null in JSON)
  double wall_time_s = 0;      ///< training wall time of all earlier invocations
  double cost_calibration = 0; ///< measured / predicted step time, EMA; 0 = not measured yet
  std::string data_fingerprint;  ///< corpus_fingerprint() of the corpus trained on; "" in older checkpoints
  std::string loaded_from;       ///< the folder load_checkpoint read (`dir`, or `dir`.old); not saved
};

/// Writes checkpoint `dir`: every file into `dir`.tmp, flushed and fsynced, then manifest.json (each file's
/// bytes and CRC32, and the step), the folder synced; then installed by renames, `dir` -> `dir`.old (only when
/// `dir` is complete, so an earlier crash's only good checkpoint `dir`.old is never removed first; the `dir`.old
/// of the save before is removed then), `dir`.tmp -> `dir`, the parent synced. `dir`.old stays: the previous
/// checkpoint, which a load falls back to when `dir` is corrupt. A crash at any point leaves `dir` or `dir`.old
/// loadable. Throws std::runtime_error naming the path and the OS error (a full disk: "No space left on device"),
/// or naming a parameter that holds NaN or inf (nothing is written); the previous checkpoint is then left in place.
void save_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer& optimizer,
                     const TrainState& state, const Config& cfg);

/// The folder of checkpoint `dir` that holds state.json: `dir`, else `dir`.old (left by a crash between the two
/// renames); nothing is verified. Throws std::runtime_error "checkpoint '<dir>' not found" when neither does.
std::string checkpoint_folder(const std::string& dir);

/// Reads the config stored in checkpoint `dir` (its config.yaml), from the newest folder that verifies as
/// load_checkpoint does. Throws RunFailure (kFailureCheckpointRefused, a std::runtime_error) naming the path when
/// no folder verifies or the file is empty or not a valid config (a checkpoint's content is data: these are
/// runtime failures, exit 1, not usage errors).
Config load_checkpoint_config(const std::string& dir);

/// Throws RunFailure (kFailureCheckpointRefused) naming the first key whose value differs between `current` and the config stored
/// in checkpoint `dir`, among the model shape (model.recompute_layers excepted: it changes neither weights nor
/// data order), the attention keys that fix the attention parameters (backend, feature_map, num_features,
/// input_norm, normalizer) and everything that fixes the data order (data.*, run.seed, train batch sizes,
/// parallel.sp_size): resuming across such a change would load mismatched weights or repeat and skip samples.
void check_resumable(const std::string& dir, const Config& current);

/// Loads model weights (and optimizer state when `optimizer` is non-null) and returns the state. Every file of
/// the folder is verified first: its size and CRC32 against manifest.json (a checkpoint without one, written
/// before manifests existed, loads with a warning, printed once), the CRC32 of every zip entry inside model.pt and
/// optimizer.pt, and state.json's fields. When `dir` is missing or fails verification and `dir`.old (the previous
/// checkpoint) passes, that one loads, with a warning printed once that names both and why (TrainState::loaded_from
/// tells which). Throws RunFailure (kFailureCheckpointRefused) naming the file and the field or parameter: a
/// missing, truncated or corrupt file (size or CRC32 differs from the manifest or a zip entry's own), a manifest
/// crc32 that is not hex digits (either case reads), a state.json field that is missing, not a whole number, out of
/// range (negative or above 2^53) or inconsistent (index_in_epoch or epoch above step, a step other than the
/// manifest's), a stored tensor whose shape differs from the one `model` was built with, optimizer moments whose
/// shapes differ from their parameters', and weights or moments that are not finite.
TrainState load_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer* optimizer);

}  // namespace dcp
