// Run under `dcp launch --nproc 2 -- test_dist_step`: every rank executes the same checks.
#include <gtest/gtest.h>

#include "dcp/planning.h"
#include "distributed/fixtures.h"
#include "train/step_guard.h"

using namespace dcp;
using namespace dcp::test;

namespace {

StepPlan first_plan(const Config& cfg, const Corpus& corpus, int64_t recompute_layers, int64_t sp_size = 1) {
  DataParallelOptions dp{groups().world().size(), cfg.train.global_batch_tokens, cfg.train.micro_batch_tokens,
                         recompute_layers, sp_size};
  return plan_data_parallel(corpus.samples(), epoch_order(corpus.train_ids(), 5, 0), 0, dp).at(0);
}

}  // namespace

TEST(DistributedStep, DataParallelGradientEqualsSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = first_plan(cfg, corpus, 0);
  ASSERT_GT(plan.group_of(1).micro_batches.size(), 0u);  // both ranks have work
  expect_step_matches_reference(cfg, corpus, plan);
}

TEST(DistributedStep, StaticSequenceParallelGradientEqualsSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  expect_step_matches_reference(cfg, corpus, first_plan(cfg, corpus, 1, 2));
}

TEST(DistributedStep, RecomputeGivesSameGradients) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  for (int64_t recompute : {1, 3}) {
    StepPlan plan = first_plan(cfg, corpus, recompute);
    // Mixed settings inside one step: each micro-batch its own recompute_layers.
    for (auto& g : plan.groups)
      for (size_t i = 0; i < g.micro_batches.size(); ++i)
        g.micro_batches[i].recompute_layers = (recompute + static_cast<int64_t>(i)) % 4;
    expect_step_matches_reference(cfg, corpus, plan);
  }
}

TEST(DistributedStep, PlanMismatchIsAnErrorNamingTheStep) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = first_plan(cfg, corpus, 0);
  if (groups().world().rank() == 1) plan.groups[1].micro_batches[0].recompute_layers = 2;
  Transformer model = fresh_model(cfg);
  try {
    compute_step_gradients(model, corpus, plan, groups());
    FAIL() << "expected a plan mismatch error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("mismatch at epoch 0 step 0"), std::string::npos) << e.what();
  }
}

TEST(DistributedStep, EveryPlannersFirstTwoStepsGiveTheSingleProcessGradient) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  const ModelShape shape = model_shape_of(cfg);
  const DeviceSpec device = DeviceSpec::named("h200");
  PlannerOptions opt;
  opt.tokens_per_step = 150;
  for (const auto& name : planner_names()) {
    PlanSet set = planner_by_name(name)(corpus.samples(), groups().world().size(), CostModel(shape, device),
                                        MemoryModel(shape, device), opt);
    ASSERT_GE(set.steps.size(), 2u) << name;
    for (size_t i = 0; i < 2; ++i) {
      SCOPED_TRACE(name + " step " + std::to_string(i));
      expect_step_matches_reference(cfg, corpus, set.steps[i]);
    }
  }
}

TEST(Runtime, ResolvesItsPrecisionAndPlansAtItsWidth) {
  RuntimeOptions o;
  o.shape = model_shape_of(tiny_config(), 4);
  for (const auto& [precision, bytes] : std::vector<std::pair<std::string, int64_t>>{{"bf16", 2}, {"fp32", 4}}) {
    o.precision = precision;
    const Runtime runtime(o, groups());
    EXPECT_EQ(precision_name(runtime.precision().precision), precision);
    EXPECT_EQ(runtime.precision().reason, "train.precision=" + precision);
    EXPECT_EQ(runtime.cost().shape().bytes_per_element, bytes) << precision;
    EXPECT_EQ(runtime.memory().shape().bytes_per_element, bytes) << precision;
  }
  o.precision = "auto";
  EXPECT_EQ(Runtime(o, groups()).precision().precision, resolve_precision("auto").precision);
  o.precision = "fp16";
  EXPECT_THROW(Runtime(o, groups()), ConfigError);
}

// R3: a non-finite loss on one rank only (rank 1) is seen by every rank, which all skip or all stop.
TEST(StepGuard, ANonFiniteValueOnOneRankStopsOrSkipsEveryRank) {
  const Communicator& world = groups().world();
  const double loss = world.rank() == 1 ? std::nan("") : 2.0;
  TrainConfig skip;
  skip.nonfinite = "skip";
  StepGuard skipping(skip, 0);
  EXPECT_FALSE(skipping.admit(1, loss, 1.0, world, ""));
  EXPECT_TRUE(skipping.admit(2, 2.0, 1.0, world, ""));
  StepGuard stopping(TrainConfig{}, 0);
  EXPECT_THROW(stopping.admit(3, loss, 1.0, world, ""), std::runtime_error);
  EXPECT_TRUE(stopping.admit(4, 2.0, 1.0, world, ""));  // every rank is still in step
}
