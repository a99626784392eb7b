// Run under `dcp launch --nproc 2 -- test_dist_step`: every rank executes the same checks.
#include <gtest/gtest.h>

#include "dcp/train.h"

using namespace dcp;

namespace {

const ProcessGroups& groups() {
  static ProcessGroups g(DistEnv::from_environment(), 30.0);
  return g;
}

Config tiny_config() {
  return Config::load("", {"--model.d_model=32", "--model.n_layers=3", "--model.n_heads=4", "--model.d_ff=64",
                           "--data.max_seq_len=48", "--train.micro_batch_tokens=100",
                           "--train.global_batch_tokens=400"});
}

Corpus tiny_corpus(const Config& cfg) {
  std::vector<std::pair<std::string, std::string>> docs;
  for (int i = 0; i < 12; ++i) {
    std::string text;
    for (int j = 0; j < 7 + 13 * i; ++j) text.push_back(static_cast<char>('a' + (i * 7 + j * 3) % 26));
    docs.emplace_back("doc" + std::to_string(i), text);
  }
  return Corpus::from_documents(docs, cfg.data);
}

Transformer fresh_model(const Config& cfg) {
  torch::manual_seed(42);
  return Transformer(cfg.model, cfg.attention);
}

// Single-process reference: gradient of (1/N) * sum of token losses over all of the step's samples.
std::vector<torch::Tensor> reference_gradients(const Config& cfg, const Corpus& corpus, const StepPlan& plan) {
  Transformer model = fresh_model(cfg);
  std::vector<int64_t> ids;
  for (const auto& g : plan.groups)
    for (const auto& mb : g.micro_batches) ids.insert(ids.end(), mb.sample_ids.begin(), mb.sample_ids.end());
  torch::Tensor loss = model->loss_sum(make_batch(corpus, ids)) / static_cast<double>(plan.global_num_tokens);
  loss.backward();
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

void expect_grads_equal(Transformer& model, const std::vector<torch::Tensor>& ref) {
  auto params = model->parameters();
  ASSERT_EQ(params.size(), ref.size());
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_err = std::max(max_err, (params[i].grad() - ref[i]).abs().max().item<double>());
    max_ref = std::max(max_ref, ref[i].abs().max().item<double>());
  }
  EXPECT_LT(max_err, 1e-5 * max_ref) << "max abs err " << max_err << ", max |grad| " << max_ref;
}

StepPlan first_plan(const Config& cfg, const Corpus& corpus, int64_t recompute_layers) {
  DataParallelOptions dp{groups().world().size(), cfg.train.global_batch_tokens, cfg.train.micro_batch_tokens,
                         recompute_layers};
  auto plans = plan_data_parallel(corpus.samples(), epoch_order(corpus.train_ids(), 5, 0), 0, dp);
  return plans.at(0);
}

}  // namespace

TEST(DistributedStep, DataParallelGradientEqualsSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = first_plan(cfg, corpus, 0);
  ASSERT_GT(plan.group_of(1).micro_batches.size(), 0u);  // both ranks have work
  Transformer model = fresh_model(cfg);
  StepResult r = compute_step_gradients(model, corpus, plan, groups());
  EXPECT_EQ(r.rank_busy_s.size(), 2u);
  expect_grads_equal(model, reference_gradients(cfg, corpus, plan));
}

TEST(DistributedStep, RecomputeGivesSameGradients) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  for (int64_t recompute : {1, 3}) {
    StepPlan plan = first_plan(cfg, corpus, recompute);
    // Mixed settings inside one step: each micro-batch its own recompute_layers.
    for (auto& g : plan.groups)
      for (size_t i = 0; i < g.micro_batches.size(); ++i) g.micro_batches[i].recompute_layers = (recompute + i) % 4;
    Transformer model = fresh_model(cfg);
    compute_step_gradients(model, corpus, plan, groups());
    expect_grads_equal(model, reference_gradients(cfg, corpus, plan));
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
