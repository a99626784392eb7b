#include "train/run_record.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "dcp/planners.h"
#include "util/logging.h"
#include "util/stats.h"

namespace dcp {
using nlohmann::json;

namespace {

std::vector<int64_t> lengths_of(const MicroBatch& mb, const std::vector<Sample>& samples) {
  std::vector<int64_t> lengths;
  for (int64_t id : mb.sample_ids) lengths.push_back(samples[static_cast<size_t>(id)].length);
  return lengths;
}

json median_or_null(const std::vector<double>& values) { return values.empty() ? json() : json(median(values)); }

json counts(const std::map<int64_t, int64_t>& m) {
  json out = json::object();
  for (const auto& [k, n] : m) out[std::to_string(k)] = n;
  return out;
}

}  // namespace

RunRecord::RunRecord(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                     const MemoryModel& memory, double budget_bytes, std::string plan_source)
    : samples_(samples),
      world_size_(world_size),
      cost_(cost),
      memory_(memory),
      budget_bytes_(budget_bytes),
      plan_source_(std::move(plan_source)) {}

// Per rank: the memory model's peak for the largest of its micro-batches (exact sample lengths), or the model's
// resident bytes for a rank without micro-batches.
std::vector<double> RunRecord::predicted_rank_peaks(const StepPlan& plan) const {
  const double base = memory_.coefficients().base_bytes;
  std::vector<double> out(static_cast<size_t>(world_size_), base);
  for (const auto& g : plan.groups) {
    double peak = base;
    for (const auto& mb : g.micro_batches) {
      peak = std::max(peak, memory_.bytes(lengths_of(mb, samples_), g.sp_size, mb.recompute_layers));
    }
    for (int64_t r = g.first_rank; r < g.first_rank + g.sp_size && r < world_size_; ++r) {
      out[static_cast<size_t>(r)] = std::max(out[static_cast<size_t>(r)], peak);  // the max over its rounds
    }
  }
  return out;
}

std::vector<double> RunRecord::record_memory(const StepPlan& plan, const StepStats& r, int64_t step) {
  const std::vector<double> predicted_peaks = predicted_rank_peaks(plan);
  for (size_t i = 0; i < r.rank_peak_bytes.size(); ++i) {
    peak_bytes_ = std::max(peak_bytes_, r.rank_peak_bytes[i]);
    memory_errors_.push_back(std::abs(predicted_peaks[i] / static_cast<double>(r.rank_peak_bytes[i]) - 1.0));
  }
  // The budget stands for a device's memory: a measured peak above it would have been an out-of-memory
  // error there, whatever the model predicted. Warned once, counted in the summary.
  const auto measured_peak = std::max_element(r.rank_peak_bytes.begin(), r.rank_peak_bytes.end());
  if (measured_peak != r.rank_peak_bytes.end() && static_cast<double>(*measured_peak) > budget_bytes_) {
    const size_t rank = static_cast<size_t>(measured_peak - r.rank_peak_bytes.begin());
    if (steps_measured_over_budget_++ == 0) {
      spdlog::warn("step {}: rank {} measured a peak of {} bytes, over the memory budget of {:.0f} bytes (the "
                   "memory model predicted {:.0f}); such steps are counted as steps_measured_over_budget in "
                   "summary.json: raise memory.margin, lower memory.budget_bytes or re-profile",
                   step, rank, *measured_peak, budget_bytes_, predicted_peaks[rank]);
    }
  }
  const double predicted_peak = *std::max_element(predicted_peaks.begin(), predicted_peaks.end());
  if (predicted_peak > memory_.budget_bytes() && !warned_over_budget_) {
    spdlog::warn("step {}: predicted peak {:.0f} bytes exceeds the memory budget {:.0f} bytes ({} plans do not "
                 "consult the memory model; a planner such as dcp-opt does)",
                 step, predicted_peak, memory_.budget_bytes(), plan_source_);
    warned_over_budget_ = true;
  }
  return predicted_peaks;
}

RunRecord::PlanRecord RunRecord::record_plan(const StepPlan& plan) {
  PlanRecord p;
  p.rank_recompute.assign(static_cast<size_t>(world_size_), 0);
  auto& [sp_sizes, sp_modes, group_micro_batches, rank_recompute, round_sp_sizes, step_flops] = p;
  for (const auto& g : plan.groups) {
    sp_sizes.push_back(g.sp_size);
    sp_modes.push_back(g.sp_size > 1 ? sp_mode_name(g.sp_mode) : "none");
    if (g.sp_size > 1) ++sp_groups_by_mode_[sp_mode_name(g.sp_mode)];
    group_micro_batches.push_back(static_cast<int64_t>(g.micro_batches.size()));
    ++groups_by_sp_[g.sp_size];
    micro_batches_per_group_.push_back(static_cast<double>(g.micro_batches.size()));
    int64_t most = 0;  // the most layers any micro-batch of the group recomputes (the plan's answer to memory)
    for (const auto& mb : g.micro_batches) {
      most = std::max(most, mb.recompute_layers);
      ++micro_batches_by_recompute_[mb.recompute_layers];
      // MFU counts the model's FLOPs without recompute, causal attention included.
      const FlopCount f = cost_.flops(lengths_of(mb, samples_), 0);
      step_flops += f.linear + f.attention;
    }
    for (int64_t rk = g.first_rank; rk < g.first_rank + g.sp_size && rk < world_size_; ++rk) {
      rank_recompute[static_cast<size_t>(rk)] = std::max(rank_recompute[static_cast<size_t>(rk)], most);
    }
    if (static_cast<int64_t>(round_sp_sizes.size()) <= g.round) round_sp_sizes.resize(static_cast<size_t>(g.round + 1));
    round_sp_sizes[static_cast<size_t>(g.round)].push_back(g.sp_size);
  }
  ++steps_;
  rounds_ += plan.num_rounds();
  steps_with_rounds_ += plan.num_rounds() > 1 ? 1 : 0;
  if (std::adjacent_find(sp_sizes.begin(), sp_sizes.end(), std::not_equal_to<>()) != sp_sizes.end()) {
    ++steps_mixed_sp_;
  }
  flops_ += step_flops;
  return p;
}

json RunRecord::step(const StepPlan& plan, const StepStats& r, double step_time_s, double lr, double grad_norm,
                     TrainState& state) {
  const std::vector<double> predicted_peaks = record_memory(plan, r, state.step);
  const PlanRecord p = record_plan(plan);
  seconds_ += step_time_s;

  // Online recalibration: the model's prediction times an EMA of measured / predicted over past steps.
  const StepCost model = evaluate_step(plan, samples_, world_size_, cost_, memory_);
  const double raw_prediction = model.step_s;
  predicted_s_ += raw_prediction;
  step_sample_ids_.push_back(plan.sample_ids());
  const json predicted = state.cost_calibration > 0 ? json(state.cost_calibration * raw_prediction) : json();
  if (!predicted.is_null()) prediction_errors_.push_back(std::abs(predicted.get<double>() / step_time_s - 1.0));
  model_errors_.push_back(std::abs(raw_prediction / step_time_s - 1.0));
  const double ratio = step_time_s / raw_prediction;
  state.cost_calibration = state.cost_calibration > 0 ? 0.9 * state.cost_calibration + 0.1 * ratio : ratio;

  const double max_busy = *std::max_element(r.rank_busy_s.begin(), r.rank_busy_s.end());
  double mean_busy = 0;
  for (double b : r.rank_busy_s) mean_busy += b / static_cast<double>(r.rank_busy_s.size());
  return {{"step", state.step},
          {"epoch", state.epoch},
          {"loss", r.loss},
          {"tokens", r.tokens},
          {"samples", r.samples},
          {"step_time_s", step_time_s},
          {"tokens_per_s", static_cast<double>(r.tokens) / step_time_s},
          {"lr", lr},
          {"grad_norm", grad_norm},
          {"rank_busy_s", r.rank_busy_s},
          {"rank_peak_bytes", r.rank_peak_bytes},
          {"rank_predicted_peak_bytes", predicted_peaks},
          {"rank_recompute_layers", p.rank_recompute},
          {"imbalance", max_busy > 0 ? 1.0 - mean_busy / max_busy : 0.0},
          {"sp_sizes", p.sp_sizes},
          {"sp_modes", p.sp_modes},
          {"rounds", plan.num_rounds()},
          {"round_sp_sizes", p.round_sp_sizes},
          {"model_round_s", model.round_makespan_s},
          {"rank_round_s", r.rank_round_s},
          {"group_micro_batches", p.group_micro_batches},
          {"model_flops", p.flops},
          {"predicted_step_s", predicted},
          {"model_step_s", raw_prediction}};
}

json RunRecord::summary() const {
  json plans = {{"groups_by_sp_size", counts(groups_by_sp_)},
                {"sp_groups_by_mode", sp_groups_by_mode_},
                {"steps_mixed_sp", steps_mixed_sp_},
                {"steps_with_rounds", steps_with_rounds_},
                {"rounds_per_step_mean", steps_ > 0 ? json(static_cast<double>(rounds_) / static_cast<double>(steps_)) : json()},
                {"micro_batches_by_recompute_layers", counts(micro_batches_by_recompute_)},
                {"micro_batches_per_group_mean",
                 micro_batches_per_group_.empty()
                     ? json()
                     : json(std::accumulate(micro_batches_per_group_.begin(), micro_batches_per_group_.end(), 0.0) /
                            static_cast<double>(micro_batches_per_group_.size()))},
                {"micro_batches_per_group_max",
                 micro_batches_per_group_.empty()
                     ? json()
                     : json(*std::max_element(micro_batches_per_group_.begin(), micro_batches_per_group_.end()))},
                {"predicted_s", steps_ > 0 ? json(predicted_s_) : json()},
                {"best_static_layout", json()},
                {"best_static_predicted_s", json()},
                {"predicted_speedup_over_best_static", json()}};
  // Only the summary needs the static layouts, so the step loop does not plan them.
  StaticBaselines static_baselines(world_size_, cost_, memory_);
  for (const auto& ids : step_sample_ids_) static_baselines.add_step(ids, samples_);
  if (const auto best = static_baselines.best(); best && predicted_s_ > 0) {
    plans["best_static_layout"] = best->layout;
    plans["best_static_predicted_s"] = best->predicted_s;
    plans["predicted_speedup_over_best_static"] = best->predicted_s / predicted_s_;
  }
  return {{"predicted_step_median_rel_err", median_or_null(prediction_errors_)},
          {"model_step_median_rel_err", median_or_null(model_errors_)},
          {"model_flops_per_s", seconds_ > 0 ? json(flops_ / seconds_) : json()},
          {"peak_bytes", peak_bytes_},
          {"steps_measured_over_budget", steps_measured_over_budget_},
          {"predicted_peak_median_rel_err", median_or_null(memory_errors_)},
          {"plans", plans}};
}

}  // namespace dcp
