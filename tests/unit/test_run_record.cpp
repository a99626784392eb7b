#include <gtest/gtest.h>

#include <limits>

#include "dcp/planners.h"
#include "train/run_record.h"
#include "plan/static_baseline.h"

using namespace dcp;

namespace {

const ModelShape kShape;  // the 1.3B decoder of the h200 model
const DeviceSpec kH200 = DeviceSpec::named("h200");

std::vector<Sample> samples_of(const std::vector<int64_t>& lengths) { return samples_from_lengths(lengths, "s"); }

MicroBatch micro_batch(std::vector<int64_t> ids, const std::vector<Sample>& samples, int64_t recompute) {
  MicroBatch mb;
  for (int64_t id : ids) mb.num_tokens += samples[static_cast<size_t>(id)].length;
  mb.sample_ids = std::move(ids);
  mb.recompute_layers = recompute;
  return mb;
}

}  // namespace

TEST(StaticBaselines, BestLayoutIsTheCheapestThatPlacesEverySample) {
  // 432000 tokens do not fit one H200 even with every layer recomputed, so no "sp 1" layout may win.
  const auto samples = samples_of({432000, 4096, 2048, 1024, 512});
  const CostModel cost(kShape, kH200);
  const MemoryModel memory = MemoryModel::analytic(kShape, 0.9 * kH200.memory_bytes);
  StaticBaselines baselines(4, cost, memory);
  baselines.add_step({0, 1, 2, 3, 4}, samples);
  const auto best = baselines.best();
  ASSERT_TRUE(best.has_value());
  EXPECT_EQ(best->layout.find("sp 1"), std::string::npos) << best->layout;

  // The same number from the planners directly: the least predicted step over packed and bucket at sp 2 and 4.
  double expected = std::numeric_limits<double>::infinity();
  PlannerOptions options;
  options.samples_per_step = 5;
  for (int64_t sp : {2, 4}) {
    options.static_sp_size = sp;
    for (const auto& set : {plan_packed(samples, 4, cost, memory, options), plan_bucket(samples, 4, cost, memory, options)}) {
      ASSERT_TRUE(set.skipped_ids.empty());
      expected = std::min(expected, evaluate_step(set.steps[0], samples, 4, cost, memory).step_s);
    }
  }
  EXPECT_DOUBLE_EQ(best->predicted_s, expected);
}

TEST(StaticBaselines, NoneWhenNoLayoutPlacesEveryStep) {
  const auto samples = samples_of({432000});
  const CostModel cost(kShape, kH200);
  const MemoryModel memory = MemoryModel::analytic(kShape, 0.9 * kH200.memory_bytes);
  StaticBaselines baselines(1, cost, memory);  // one rank: only sp 1, where 432000 tokens do not fit
  EXPECT_FALSE(baselines.best().has_value());  // no step yet
  baselines.add_step({0}, samples);
  EXPECT_FALSE(baselines.best().has_value());
}

TEST(RunRecord, ReportsWhatThePlansDecided) {
  const auto samples = samples_of({4096, 1024, 1024, 512, 512, 256});
  const CostModel cost(kShape, kH200);
  const MemoryModel memory = MemoryModel::analytic(kShape, 0.9 * kH200.memory_bytes);
  RunRecord record(samples, 4, cost, memory, memory.budget_bytes(), "test");
  TrainState state;
  StepStats stats;
  stats.rank_busy_s = {1.0, 0.5, 0.5, 0.5};
  stats.rank_peak_bytes = {int64_t{40} << 30, int64_t{40} << 30, int64_t{30} << 30, int64_t{30} << 30};

  // Step 1: one sp 2 group with two micro-batches (one recomputing 3 layers) beside two sp 1 groups: mixed.
  StepPlan mixed;
  mixed.groups = {{0, 2, {micro_batch({0}, samples, 3), micro_batch({1}, samples, 0)}},
                  {2, 1, {micro_batch({2}, samples, 0)}},
                  {3, 1, {micro_batch({3, 4}, samples, 0)}}};
  state.step = 1;
  const auto line1 = record.step(mixed, stats, 2.0, 1e-3, 0.5, state);
  EXPECT_EQ(line1["sp_sizes"], nlohmann::json({2, 1, 1}));
  EXPECT_EQ(line1["group_micro_batches"], nlohmann::json({2, 1, 1}));
  EXPECT_EQ(line1["rank_recompute_layers"], nlohmann::json({3, 3, 0, 0}));
  EXPECT_TRUE(line1["predicted_step_s"].is_null());  // nothing to calibrate with yet
  EXPECT_GT(state.cost_calibration, 0);
  EXPECT_DOUBLE_EQ(line1["imbalance"].get<double>(), 1.0 - 0.625);

  // Step 2: four sp 1 groups, not mixed.
  StepPlan uniform;
  for (int64_t r = 0; r < 4; ++r) uniform.groups.push_back({r, 1, {micro_batch({r == 3 ? 5 : r}, samples, 0)}});
  state.step = 2;
  const auto line2 = record.step(uniform, stats, 1.0, 1e-3, 0.5, state);
  EXPECT_FALSE(line2["predicted_step_s"].is_null());

  const auto summary = record.summary();
  const auto& plans = summary["plans"];
  EXPECT_EQ(plans["steps_mixed_sp"], 1);
  EXPECT_EQ(plans["groups_by_sp_size"], nlohmann::json({{"1", 6}, {"2", 1}}));
  EXPECT_EQ(plans["micro_batches_by_recompute_layers"], nlohmann::json({{"0", 7}, {"3", 1}}));
  EXPECT_DOUBLE_EQ(plans["micro_batches_per_group_mean"].get<double>(), 8.0 / 7.0);
  EXPECT_EQ(plans["micro_batches_per_group_max"].get<double>(), 2.0);
  const double predicted = evaluate_step(mixed, samples, 4, cost, memory).step_s +
                           evaluate_step(uniform, samples, 4, cost, memory).step_s;
  EXPECT_DOUBLE_EQ(plans["predicted_s"].get<double>(), predicted);
  ASSERT_FALSE(plans["best_static_layout"].is_null());
  EXPECT_DOUBLE_EQ(plans["predicted_speedup_over_best_static"].get<double>(),
                   plans["best_static_predicted_s"].get<double>() / predicted);
  EXPECT_EQ(summary["peak_bytes"], int64_t{40} << 30);
  EXPECT_FALSE(summary["predicted_step_median_rel_err"].is_null());
}

// memory.margin: the planners plan within (1 - margin) x the budget (the MemoryModel's budget), while a step's
// measured peak is checked against the whole budget, which stands for the device's memory. A peak between the two
// is inside the device and not counted; one above the whole budget is.
TEST(RunRecord, MeasuredPeaksAreCheckedAgainstTheWholeBudgetNotThePlannersShare) {
  const auto samples = samples_of({1024, 512});
  const CostModel cost(kShape, kH200);
  const double budget = 0.9 * kH200.memory_bytes, margin = 0.03;
  const MemoryModel memory = MemoryModel::analytic(kShape, (1 - margin) * budget);
  RunRecord record(samples, 2, cost, memory, budget, "test");
  StepPlan plan;
  for (int64_t r = 0; r < 2; ++r) plan.groups.push_back({r, 1, {micro_batch({r}, samples, 0)}});
  TrainState state;
  StepStats stats;
  stats.rank_busy_s = {1.0, 1.0};
  stats.rank_peak_bytes = {static_cast<int64_t>((1 - margin / 2) * budget), int64_t{1} << 30};  // above the share
  state.step = 1;
  record.step(plan, stats, 1.0, 1e-3, 0.5, state);
  EXPECT_EQ(record.summary()["steps_measured_over_budget"], 0);
  stats.rank_peak_bytes = {int64_t{1} << 30, static_cast<int64_t>(1.01 * budget)};  // above the whole budget
  state.step = 2;
  record.step(plan, stats, 1.0, 1e-3, 0.5, state);
  EXPECT_EQ(record.summary()["steps_measured_over_budget"], 1);
}
