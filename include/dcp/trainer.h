// The trainer of dcp's own model: the optimizer loop over StepPlans, its learning-rate schedule, checkpoints and
// held-out evaluation. One step's gradient is the runtime's (dcp/step_runner.h).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dcp/checkpoint.h"
#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/data.h"
#include "dcp/dist.h"
#include "dcp/model.h"
#include "dcp/plan.h"
#include "dcp/planning.h"
#include "dcp/precision.h"

namespace dcp {

class FileLock;  // util/file_lock.h

/// Learning rate at `step` (0-based): linear warm-up over warmup_steps, then cosine decay to
/// lr * min_lr_ratio at max_steps (Loshchilov & Hutter 2017, SGDR without restarts).
double lr_at(int64_t step, const TrainConfig& cfg);

/// Held-out mean loss in bits per byte of `model` over the first eval.max_tokens tokens of the held-out samples
/// (all when 0), packed into batches of at most `batch_tokens` tokens, sharded round-robin over the ranks of
/// `world` and summed with one all-reduce. NaN when there is no held-out sample.
double heldout_bits_per_byte(Transformer& model, const Corpus& corpus, const EvalConfig& eval, int64_t batch_tokens,
                             const Communicator& world);

/// How a run trains besides its config (`dcp train`'s flags).
struct TrainOptions {
  bool resume = false;             ///< continue from run_dir/checkpoint (or the .old a crash left)
  bool allow_data_change = false;  ///< resume although the corpus fingerprint differs (a warning instead)
  std::vector<StepPlan> plans;     ///< execute these instead of planning (repeated as epochs)
};

/// What a run sets up before its cost models can be resolved: the run dir (created and locked, its logs
/// started), the corpus with its training lengths, the precision and the threads. The model shape and the longest
/// sample it gives are what resolve_cost_models (dcp/profile.h) needs.
struct TrainSetup {
  std::chrono::steady_clock::time_point started;  ///< wall time of the run counts from here
  std::string run_dir;
  std::shared_ptr<FileLock> run_lock;  ///< rank 0's lock on run_dir/run.lock (lock_run_dir); null elsewhere
  int64_t threads = 1;                 ///< intra-op threads of this rank (set in LibTorch)
  Corpus corpus;
  std::vector<int64_t> train_lengths;  ///< tokens of every training sample, in id order
  LengthHistogram lengths;             ///< of train_lengths (logged)
  PrecisionChoice precision;           ///< train.precision resolved on this CPU
  ModelShape shape;                    ///< the model as the cost models see it, at that precision
};

/// The set-up phase: creates and locks run.dir (a second run on it fails), starts the rank's log (logs/), checks
/// that every rank holds the same config (all keys but run.dir, run.log_level, train.threads and
/// train.profile_dir), sets the threads, loads the corpus (logging what it kept and skipped) and resolves the
/// precision. Collective: every rank of `groups` calls it. Throws std::runtime_error naming the folder, the
/// holder of the lock, the rank whose config differs or the corpus problem; ConfigError for a bad precision.
TrainSetup open_training(const Config& cfg, const ProcessGroups& groups, bool resume);

class Checkpointer;
class EpochPlanner;
class Progress;
class RunRecord;
class StepGuard;

/// The trainer of dcp's own model, in phases as torchtitan's Trainer: the constructor builds every part from
/// its own config section and is handed the cost models (resolved by the command: resolve_cost_models); then
/// restore() (resume or start fresh), step() per StepPlan, maybe_checkpoint(), finish(). train() runs them:
///
///   TrainSetup setup = open_training(cfg, groups, options.resume);
///   RunCostModels models = resolve_cost_models(cfg, setup.shape, setup.threads, setup.lengths.max, groups);
///   Trainer(cfg, groups, std::move(setup), std::move(models), options).train();
///
/// It writes run_dir/config.yaml, metrics.jsonl, summary.json and checkpoint/ (README, "Where results go").
/// Steps follow the planner's plans (train.planner; static: groups of parallel.sp_size ranks), or the given
/// plans in order, repeated as epochs. With resume it continues from run_dir/checkpoint exactly (same data order,
/// optimizer state and LR schedule). `groups` must hold every SP size the plans use. A non-finite loss or gradient
/// norm stops the run before the optimizer step (train.nonfinite stop) or drops that update (skip). Collective:
/// every rank runs every phase. Throws std::runtime_error for bad data, a failed peer, a non-finite step, a
/// checkpoint that is corrupt or of another corpus (TrainOptions::allow_data_change), std::invalid_argument for a
/// plan that does not fit.
class Trainer {
 public:
  /// Builds the model (seeded by run.seed), the optimizer, the checkpointer, the step guard, the planner of the
  /// epochs and the record of the steps, and checks the given plans against the corpus. Logs the model, the
  /// precision, the memory budget and what each length needs under it.
  Trainer(const Config& cfg, const ProcessGroups& groups, TrainSetup setup, RunCostModels models,
          TrainOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// restore(), then step(next_plan()) and maybe_checkpoint() until done(), then finish().
  void train();

  /// Resumes from run_dir/checkpoint (TrainOptions::resume) or starts fresh, checks that every rank holds the
  /// same weights, plans the epoch, writes config.yaml and truncates metrics.jsonl to the checkpoint's step, and
  /// evaluates the held-out loss of a fresh run. Throws what load_checkpoint throws and for a changed corpus.
  void restore();
  /// Whether the run is over: train.max_steps reached, or train.stop_after_steps steps in this invocation.
  bool done() const;
  /// The next step's plan (a new epoch is planned when the last one is used up).
  const StepPlan& next_plan();
  /// One global step: the gradient over every rank (compute_step_gradients), clipped to train.grad_clip, the
  /// guard's verdict on non-finite values, the learning rate of the schedule (lr_at) and the optimizer update;
  /// then its metrics.jsonl line (rank 0) and the progress. Throws what the guard and the step runner throw.
  void step(const StepPlan& plan);
  /// Saves the checkpoint every train.checkpoint_every steps (not at max_steps: finish() saves that one).
  void maybe_checkpoint();
  /// The final checkpoint, the held-out loss after training and summary.json.
  void finish();

 private:
  nlohmann::json summary(double final_bpb, double train_time_s) const;

  const ProcessGroups& groups_;
  TrainSetup setup_;
  const RunCostModels models_;
  double budget_bytes_ = 0;  ///< memory.budget_bytes (or fraction x device memory): measured peaks are checked against it
  const TrainOptions options_;
  const TrainConfig train_cfg_;
  const EvalConfig eval_cfg_;
  const DataConfig data_cfg_;
  const std::string config_yaml_;  // the resolved config, written to run_dir/config.yaml
  Transformer model_{nullptr};
  int64_t parameters_ = 0;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<EpochPlanner> planner_;
  std::unique_ptr<StepGuard> guard_;
  std::unique_ptr<RunRecord> record_;
  std::unique_ptr<Progress> progress_;
  TrainState state_;
  std::vector<StepPlan> plans_;  // this epoch's
  int64_t first_step_ = 0;       // where this invocation started
  std::string last_checkpoint_;  // what a restart resumes from, for the guard's message
  std::chrono::steady_clock::time_point train_start_;
};

}  // namespace dcp
