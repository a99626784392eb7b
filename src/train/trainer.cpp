// The trainer in phases: build, restore, step, checkpoint, finish (include/dcp/trainer.h).
#include "dcp/trainer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>

#include "dcp/memory_meter.h"
#include "dcp/step_runner.h"
#include "runtime/optimizer.h"
#include "train/checkpointer.h"
#include "train/data_fingerprint.h"
#include "train/epoch_planner.h"
#include "train/progress.h"
#include "train/run_record.h"
#include "train/step_guard.h"
#include "util/clock.h"
#include "util/file_lock.h"
#include "util/file_write.h"
#include "util/logging.h"

namespace dcp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Identical seeds give identical initial weights on every rank; check it rather than trust it.
void check_same_weights(Transformer& model, const Communicator& world) {
  double sum = 0;
  for (const auto& p : model->parameters()) sum += p.to(torch::kFloat64).sum().item<double>();
  auto t = torch::tensor({sum, -sum}, torch::kFloat64);
  world.allreduce_max(t);
  if (t[0].item<double>() != sum || -t[1].item<double>() != sum) {
    throw std::runtime_error(fmt::format("rank {} starts from different weights than its peers (checksum {})",
                                         world.rank(), sum));
  }
}

json memory_needs_json(const std::vector<LengthNeed>& needs) {
  json out = json::array();
  for (const LengthNeed& n : needs) {
    out.push_back({{"length", n.length}, {"sp_size", n.sp_size}, {"recompute_layers", n.recompute_layers},
                   {"predicted_bytes", n.bytes}});
  }
  return out;
}

}  // namespace

Trainer::Trainer(const Config& cfg, const ProcessGroups& groups, TrainSetup setup, RunCostModels models,
                 TrainOptions options)
    : groups_(groups),
      setup_(std::move(setup)),
      models_(std::move(models)),
      options_(std::move(options)),
      train_cfg_(cfg.train),
      eval_cfg_(cfg.eval),
      data_cfg_(cfg.data),
      config_yaml_(cfg.to_yaml()) {
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  model_ = Transformer(cfg.model, cfg.attention, setup_.precision.precision);
  optimizer_ = make_optimizer(model_, cfg.train);
  for (const auto& p : model_->parameters()) parameters_ += p.numel();
  spdlog::info("model: {} parameters, d_model {}, {} layers, {} heads, d_ff {}", parameters_, cfg.model.d_model,
               cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_ff);
  spdlog::info("precision: {}; fp32 master weights, gradients and AdamW moments", setup_.precision.describe());
  checkpointer_ = std::make_unique<Checkpointer>(setup_.run_dir, cfg);

  // The memory checks and the plans before the run_dir's files are touched (restore): a refused run leaves an
  // earlier run's files as they were.
  const int64_t world_size = groups_.env().world_size;
  for (const auto& p : options_.plans) p.validate(world_size, setup_.corpus.samples(), cfg.model.n_layers);
  const MemoryModel& memory = models_.memory;
  budget_bytes_ = memory_budget_bytes(cfg.memory, models_.cost.device());
  spdlog::info("memory: per-rank budget {:.1f} MB ({}){}, {} memory model, peaks measured by the {}",
               budget_bytes_ / 1e6,
               cfg.memory.budget_bytes > 0 ? "memory.budget_bytes"
                                           : fmt::format("memory.fraction {} x {:.1f} GB", cfg.memory.fraction,
                                                         models_.cost.device().memory_bytes / 1e9),
               cfg.memory.margin > 0 ? fmt::format(", planned within {:.1f} MB (memory.margin {})",
                                                   memory.budget_bytes() / 1e6, cfg.memory.margin)
                                     : "",
               memory.source(), MemoryMeter::install());
  planner_ = std::make_unique<EpochPlanner>(cfg.train, cfg.parallel, cfg.model, static_cast<uint64_t>(cfg.run.seed),
                                            world_size, setup_.corpus, setup_.train_lengths, models_, options_.plans);
  record_ = std::make_unique<RunRecord>(setup_.corpus.samples(), world_size, models_.cost, models_.memory,
                                        budget_bytes_, planner_->name());
}

Trainer::~Trainer() = default;

void Trainer::train() {
  restore();
  while (!done()) {
    step(next_plan());
    maybe_checkpoint();
  }
  finish();
}

void Trainer::restore() {
  const Communicator& world = groups_.world();
  const Corpus& corpus = setup_.corpus;
  state_ = options_.resume ? checkpointer_->resume(model_, *optimizer_, corpus_fingerprint(corpus),
                                                    options_.allow_data_change)
                           : checkpointer_->fresh(corpus);
  check_same_weights(model_, world);
  plans_ = planner_->plans(state_.epoch);
  checkpointer_->check_position(state_, plans_.size());

  if (world.rank() == 0) {
    write_file_atomically(fs::path(setup_.run_dir) / "config.yaml", config_yaml_);
    truncate_metrics((fs::path(setup_.run_dir) / "metrics.jsonl").string(), options_.resume ? state_.step : 0);
  }
  if (corpus.heldout_ids().empty()) {
    spdlog::warn("no held-out samples (data.heldout_fraction={}): held-out evaluation skipped, reported as null",
                 data_cfg_.heldout_fraction);
  }
  if (!options_.resume) {
    state_.heldout_bits_per_byte_initial =
        heldout_bits_per_byte(model_, corpus, eval_cfg_, train_cfg_.micro_batch_tokens, world);
    if (!corpus.heldout_ids().empty()) {  // else NaN: the warning above says why
      spdlog::info("held-out bits per byte before training: {:.4f}", state_.heldout_bits_per_byte_initial);
    }
  }

  train_start_ = std::chrono::steady_clock::now();
  first_step_ = state_.step;
  progress_ = std::make_unique<Progress>(train_cfg_.max_steps, first_step_, world.rank() == 0);
  guard_ = std::make_unique<StepGuard>(train_cfg_, state_.nonfinite_skips);
  last_checkpoint_ = options_.resume ? checkpointer_->describe(state_.step) : "";
}

bool Trainer::done() const {
  return state_.step >= train_cfg_.max_steps ||
         (train_cfg_.stop_after_steps > 0 && state_.step - first_step_ >= train_cfg_.stop_after_steps);
}

const StepPlan& Trainer::next_plan() {
  if (state_.index_in_epoch >= static_cast<int64_t>(plans_.size())) {
    ++state_.epoch;
    state_.index_in_epoch = 0;
    plans_ = planner_->plans(state_.epoch);
    spdlog::info("epoch {} begins ({} steps)", state_.epoch, plans_.size());
  }
  return plans_[static_cast<size_t>(state_.index_in_epoch)];
}

void Trainer::step(const StepPlan& plan) {
  const Communicator& world = groups_.world();
  const auto step_start = std::chrono::steady_clock::now();
  const StepStats r = compute_step_gradients(model_, setup_.corpus, plan, groups_);
  // The norm before clipping, also without clipping: the guard needs it.
  const double grad_norm = torch::nn::utils::clip_grad_norm_(
      model_->parameters(), train_cfg_.grad_clip > 0 ? train_cfg_.grad_clip : std::numeric_limits<double>::infinity());
  const bool update = guard_->admit(state_.step + 1, r.loss, grad_norm, world, last_checkpoint_);
  const double lr = lr_at(state_.step, train_cfg_);
  for (auto& g : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  if (update) optimizer_->step();
  const double step_time = seconds_since(step_start);

  ++state_.step;
  ++state_.index_in_epoch;
  if (update) {
    state_.tokens_trained += r.tokens;
    state_.samples_trained += r.samples;
  }
  state_.nonfinite_skips = guard_->skips();
  json line = record_->step(plan, r, step_time, lr, grad_norm, state_);
  if (!update) line["update_skipped_nonfinite"] = true;
  if (world.rank() == 0) append_line_checked(fs::path(setup_.run_dir) / "metrics.jsonl", line.dump());
  progress_->update(state_.step, r.loss, line["tokens_per_s"].get<double>(), lr);
  throw_if_logging_failed();
}

void Trainer::maybe_checkpoint() {
  if (!checkpointer_->due(state_.step)) return;
  if (groups_.world().rank() == 0) {
    TrainState snapshot = state_;
    snapshot.wall_time_s += seconds_since(setup_.started);
    checkpointer_->save(model_, *optimizer_, snapshot);
    groups_.report_checkpoint(state_.step);  // what `dcp launch --max-restarts` resumes from
  }
  groups_.world().barrier();
  last_checkpoint_ = checkpointer_->describe(state_.step);
}

void Trainer::finish() {
  const Communicator& world = groups_.world();
  progress_->finish();
  const double train_time = seconds_since(train_start_);
  state_.wall_time_s += seconds_since(setup_.started);
  // Not again when the last periodic save (or the checkpoint resumed from) is of this step already.
  if (world.rank() == 0 && !checkpointer_->holds(state_.step)) {
    checkpointer_->save(model_, *optimizer_, state_);
    groups_.report_checkpoint(state_.step);
  }
  world.barrier();

  const double final_bpb = heldout_bits_per_byte(model_, setup_.corpus, eval_cfg_, train_cfg_.micro_batch_tokens, world);
  if (setup_.corpus.heldout_ids().empty()) {
    spdlog::info("held-out bits per byte: none (no held-out samples) after {} steps", state_.step);
  } else {
    spdlog::info("held-out bits per byte: {:.4f} before training, {:.4f} after {} steps",
                 state_.heldout_bits_per_byte_initial, final_bpb, state_.step);
  }
  if (world.rank() == 0) {
    write_file_atomically(fs::path(setup_.run_dir) / "summary.json", summary(final_bpb, train_time).dump(2) + "\n");
    spdlog::info("wrote {}/summary.json, metrics.jsonl, config.yaml and checkpoint/", setup_.run_dir);
  }
}

json Trainer::summary(double final_bpb, double train_time_s) const {
  const Corpus& corpus = setup_.corpus;
  const LengthHistogram& lengths = setup_.lengths;
  auto skipped = corpus.skipped().by_reason;
  for (const auto& [reason, n] : planner_->skipped()) skipped[reason] += n;
  json summary = {{"heldout_bits_per_byte_initial", state_.heldout_bits_per_byte_initial},
                  {"heldout_bits_per_byte_final", final_bpb},
                  {"steps", state_.step},
                  {"epochs_started", state_.epoch + 1},
                  {"tokens_trained", state_.tokens_trained},
                  {"samples_trained", state_.samples_trained},
                  {"nonfinite_steps_skipped", state_.nonfinite_skips},
                  {"loss_spike_warnings", guard_->spikes()},
                  {"samples_skipped", skipped},
                  {"precision", precision_name(setup_.precision.precision)},
                  {"planner", planner_->name()},
                  {"max_rounds", train_cfg_.max_rounds},
                  {"cost_model", train_cfg_.cost_model},
                  {"cost_model_file", models_.source},
                  {"memory_budget_bytes", budget_bytes_},
                  {"memory_planning_budget_bytes", models_.memory.budget_bytes()},
                  {"memory_model", models_.memory.source()},
                  {"memory_needs", memory_needs_json(planner_->needs())},
                  {"memory_meter", MemoryMeter::method()},
                  {"train_lengths", {{"min", lengths.min}, {"p50", lengths.p50}, {"p90", lengths.p90},
                                     {"max", lengths.max}, {"tokens", lengths.tokens}}},
                  {"documents_skipped", corpus.skipped().total()},
                  {"documents_kept", corpus.num_documents()},
                  {"train_samples_per_epoch", corpus.train_ids().size()},
                  {"heldout_samples", corpus.heldout_ids().size()},
                  {"wall_time_s", state_.wall_time_s},
                  {"train_time_s_this_run", train_time_s},
                  {"world_size", groups_.env().world_size},
                  {"process_group_creation_s", groups_.creation_seconds()},
                  {"restarts", groups_.env().restart_count},
                  {"process_group_warm_up_s", groups_.warm_up_seconds()},
                  {"threads_per_rank", setup_.threads},
                  {"parameters", parameters_}};
  summary.update(record_->summary());
  return summary;
}

}  // namespace dcp
