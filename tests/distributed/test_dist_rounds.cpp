// Run under `dcp launch --nproc 4 -- test_dist_rounds --gtest_filter=...`, one fault per launch (a fault leaves
// the process groups unusable): a rank that dies, or hangs, when its next round begins stops the other ranks
// within dist.timeout_s, each naming the round and the group where it stood.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "dcp/sequence_parallel.h"
#include "distributed/fixtures.h"

using namespace dcp;
using namespace dcp::test;

namespace {

constexpr double kTimeoutS = 4.0;

const ProcessGroups& short_groups() {
  static ProcessGroups g(DistEnv::from_environment(), kTimeoutS, {1, 2, 4});
  return g;
}

MicroBatch micro_batch(const Corpus& corpus, std::vector<int64_t> ids, int64_t recompute_layers) {
  MicroBatch mb{std::move(ids), 0, recompute_layers};
  for (int64_t id : mb.sample_ids) mb.num_tokens += corpus.samples()[static_cast<size_t>(id)].length;
  return mb;
}

// Round 0: every rank alone; round 1: one Ulysses group of all four.
StepPlan two_rounds(const Corpus& corpus) {
  StepPlan p;
  for (int64_t r = 0; r < 4; ++r) p.groups.push_back(GroupPlan{r, 1, {micro_batch(corpus, {r}, 0)}});
  GroupPlan all{0, 4, {micro_batch(corpus, {10, 11}, 1)}};
  all.round = 1;
  p.groups.push_back(all);
  for (const auto& g : p.groups)
    for (const auto& mb : g.micro_batches) p.global_num_tokens += mb.num_tokens;
  return p;
}

// What rank 3 does: the step runner's round 0 (the plan check, then its micro-batch, as compute_step_gradients
// runs it), then `fault` where round 1 begins.
void rank3_reaches_round_one(Transformer& model, const Corpus& corpus, const StepPlan& plan,
                             const std::function<void()>& fault) {
  check_same_plan(plan, short_groups().world());
  std::vector<int64_t> lengths;
  for (const auto& s : corpus.samples()) lengths.push_back(s.length);
  for (const MicroBatchWork& w : rank_micro_batches(plan, lengths, short_groups(), model->cfg.n_heads)) {
    if (w.round == 1) fault();
    PackedBatch batch = make_shard(corpus, w.sample_ids, w.context.sp_rank, w.layout);
    batch.attention = group_attention(w.layout, short_groups());
    model->loss_sum(batch, w.context.recompute_layers).backward();
  }
}

void expect_round_one_named(const std::function<void()>& fault, const char* what) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  const StepPlan plan = two_rounds(corpus);
  plan.validate(4, corpus.samples(), cfg.model.n_layers);
  Transformer model = fresh_model(cfg);
  if (short_groups().world().rank() == 3) {
    rank3_reaches_round_one(model, corpus, plan, fault);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    compute_step_gradients(model, corpus, plan, short_groups());
    FAIL() << "expected an error when rank 3 " << what;
  } catch (const std::runtime_error& e) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string m = e.what();
    EXPECT_NE(m.find("step plan (epoch 0, index 0), round 1 of 2, the group at rank 0 (sp_size 4, sp_mode ulysses), "
                     "micro_batch 0: "),
              std::string::npos)
        << m;
    EXPECT_LT(waited, kTimeoutS + 10.0) << m;  // the collective's timeout, with room for a loaded machine
  }
}

}  // namespace

// The rank's process ends (exit 0, so that the launcher does not stop the others first) as round 1 begins.
TEST(RoundFaults, ARankThatDiesInARoundIsNamedByThePeers) {
  expect_round_one_named([] { std::_Exit(0); }, "dies");
}

// The rank stops answering for three timeouts as round 1 begins, then ends.
TEST(RoundFaults, ARankThatHangsInARoundMakesThePeersFailWithinTheTimeout) {
  expect_round_one_named(
      [] {
        std::this_thread::sleep_for(std::chrono::duration<double>(3 * kTimeoutS));
        std::_Exit(0);
      },
      "hangs");
}
