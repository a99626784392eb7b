// The trainer's checkpoint phase: where a run resumes from, when it saves, and the checks that keep a resume exact.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

#include "dcp/checkpoint.h"
#include "dcp/config.h"
#include "dcp/data.h"
#include "dcp/model.h"

namespace dcp {

/// run_dir/checkpoint of one run: built from the resolved config (which every checkpoint stores, and against
/// which a resume is checked: check_resumable) and train.checkpoint_every / train.max_steps.
class Checkpointer {
 public:
  Checkpointer(const std::string& run_dir, const Config& cfg);

  const std::string& dir() const { return dir_; }

  /// Loads the checkpoint (or the .old a crash or a refused newest checkpoint leaves, with a warning) into model
  /// and optimizer, after check_resumable, and checks that `fingerprint` (corpus_fingerprint of the corpus now) is
  /// the one it was trained on. Throws RunFailure (kFailureCheckpointRefused) naming the folder, the key or the
  /// fingerprints (a changed corpus unless allow_data_change, which warns instead), and what load_checkpoint throws.
  TrainState resume(Transformer& model, torch::optim::Optimizer& optimizer, const std::string& fingerprint,
                    bool allow_data_change);
  /// The state of a fresh run on `corpus`; warns when a checkpoint exists (this run replaces it).
  TrainState fresh(const Corpus& corpus) const;
  /// Throws std::runtime_error when a resumed position lies beyond its epoch's `epoch_steps` plans.
  void check_position(const TrainState& state, size_t epoch_steps) const;

  /// Whether step `step` (done) is one of the every-train.checkpoint_every saves before the last step.
  bool due(int64_t step) const;
  /// save_checkpoint of model, optimizer and state with the run's config (rank 0 only: the caller's choice). After
  /// a resume that fell back from a refused newest checkpoint to .old, the refused one is removed first, so that
  /// the good one stays the previous checkpoint.
  void save(Transformer& model, torch::optim::Optimizer& optimizer, const TrainState& state);
  /// Whether the newest checkpoint (dir, not .old) is that of step `step`: saved by this object, or resumed from.
  bool holds(int64_t step) const;
  /// "<dir> (step N)": what a restart would resume from.
  std::string describe(int64_t step) const;

 private:
  std::string dir_;
  Config cfg_;
  int64_t every_, max_steps_;
  int64_t saved_step_ = -1;     // the step dir_ holds, when known (a save or a resume from it)
  bool replace_newest_ = false; // dir_ was refused at resume: the next save removes it first
};

/// On resume, metrics.jsonl lines past the checkpoint's step belong to steps that will run again: keeps the lines
/// of steps <= keep_through_step (none for 0), rewritten through a new file and a rename. A partial last line (a
/// crash, a full disk) is dropped with a warning; a malformed line before it is refused (std::runtime_error
/// naming the file and line). A missing file, or lines missing among steps 1..keep_through_step (a shortened
/// file), are warned about naming the file and the steps; the run goes on.
void truncate_metrics(const std::string& path, int64_t keep_through_step);

}  // namespace dcp
